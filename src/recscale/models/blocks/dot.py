"""DLRM's dot-product interaction."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from recscale.models.blocks.fm import FullFM


class DotInteraction(nn.Module):
    """(B, n, d) -> (B, n(n-1)/2): dot products of all distinct pairs (upper triangle of X Xᵀ)."""

    def __init__(self, n: int, dim: int) -> None:
        super().__init__()
        self.gram = FullFM(n, dim)
        self.out_features = n * (n - 1) // 2

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[1]
        # Indices are built per call, not stored as a buffer, so meta-device construction needs no init.
        i, j = torch.triu_indices(n, n, offset=1, device=x.device)
        # index_select backpropagates by index_add, far cheaper on CPU than the index_put of x[:, i, j]
        return self.gram(x).flatten(1).index_select(1, i * n + j)

    def flops_per_example(self) -> int:
        return self.gram.flops_per_example()
