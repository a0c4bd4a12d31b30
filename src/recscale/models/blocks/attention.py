"""AutoInt's interacting layer: multi-head self-attention over field embeddings."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from recscale.models.flops import linear_flops, matmul_flops


class MultiHeadSelfAttention(nn.Module):
    """(B, n, d_in) -> (B, n, heads·head_dim): ReLU(MHSA(X) + W_res X) (Song et al. 2019).

    Scores are plain dot products <W_q e_i, W_k e_j>, unscaled, as in the AutoInt paper.
    """

    def __init__(
        self, n: int, in_dim: int, heads: int, head_dim: int, device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.n, self.heads, self.head_dim = n, heads, head_dim
        self.out_dim = heads * head_dim
        self.qkv = nn.Linear(in_dim, 3 * self.out_dim, bias=False, device=device)
        self.residual = nn.Linear(in_dim, self.out_dim, bias=False, device=device)

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (B, h, n, dh)
        att = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        return torch.relu(att.transpose(1, 2).reshape(b, n, self.out_dim) + self.residual(x))

    def flops_per_example(self) -> int:
        proj = self.n * (linear_flops(self.qkv) + linear_flops(self.residual))
        return proj + 2 * self.heads * matmul_flops(self.n, self.n, self.head_dim)  # scores, weighted sum
