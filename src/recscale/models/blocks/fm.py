"""Factorization-machine interactions over an embedding matrix X (B, n, d)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from recscale.models.blocks.cast import batched_weight
from recscale.models.flops import matmul_flops


class FullFM(nn.Module):
    """(B, n, d) -> (B, n, n): all pairwise dot products X Xᵀ; O(n²d)."""

    def __init__(self, n: int, dim: int) -> None:
        super().__init__()
        self.n, self.dim = n, dim

    def forward(self, x: Tensor) -> Tensor:
        return torch.bmm(x, x.transpose(1, 2))

    def flops_per_example(self) -> int:
        return matmul_flops(self.n, self.n, self.dim)


class OptimizedFM(nn.Module):
    """(B, n, d) -> (B, n, k): Wukong's optimized FM X (Xᵀ Y) with a learnable Y (n, k).

    Equals (X Xᵀ) Y, i.e. k learned linear combinations of the n×n dot-product matrix, but the
    product is taken right to left so the cost is O(nkd) instead of O(n²d).
    """

    def __init__(self, n: int, k: int, dim: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.n, self.k, self.dim = n, k, dim
        self.y = nn.Parameter(torch.empty(n, k, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Keep each output column of (X Xᵀ) Y at the scale of a single dot product.
        nn.init.normal_(self.y, std=1.0 / math.sqrt(self.n))

    def forward(self, x: Tensor) -> Tensor:
        # (Xᵀ Y)ᵀ = Yᵀ X, taken per example so that x is never copied to a transposed layout.
        zt = torch.bmm(batched_weight(self.y.t(), x), x)  # (B, k, d)
        return torch.bmm(x, zt.transpose(1, 2))

    def flops_per_example(self) -> int:
        return matmul_flops(self.dim, self.k, self.n) + matmul_flops(self.n, self.k, self.dim)


def fm_pairwise(x: Tensor) -> Tensor:
    """(B, n, d) -> (B,): Σ_{i<j} <x_i, x_j> = ½ Σ_d ((Σ_i x_i)² − Σ_i x_i²), in O(nd) (Rendle's FM)."""
    return 0.5 * (x.sum(1).square() - x.square().sum(1)).sum(-1)
