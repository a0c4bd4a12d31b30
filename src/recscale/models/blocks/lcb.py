"""Linear Compress Block (Wukong): a linear map along the embedding axis."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from recscale.models.blocks.cast import batched_weight
from recscale.models.flops import matmul_flops


class LinearCompressBlock(nn.Module):
    """(B, n_in, d) -> (B, n_out, d): each output embedding is a learned mix of the input embeddings.

    Wukong's LCB (``W_L X``); also the shortcut projection whenever a layer changes the number of
    embeddings, and DHEN's "linear" module.
    """

    def __init__(self, n_in: int, n_out: int, dim: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.n_in, self.n_out, self.dim = n_in, n_out, dim
        self.weight = nn.Parameter(torch.empty(n_out, n_in, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's default

    def forward(self, x: Tensor) -> Tensor:
        # One small product per example: torch.matmul(W, x) would copy x to a transposed layout
        # first, which costs more than the product itself on CPU.
        return torch.bmm(batched_weight(self.weight, x), x)

    def flops_per_example(self) -> int:
        return matmul_flops(self.n_out, self.dim, self.n_in)
