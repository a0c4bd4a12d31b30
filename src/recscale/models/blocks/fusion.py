"""FinalMLP's multi-head bilinear fusion of two streams."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from recscale.models.flops import linear_flops, matmul_flops


class BilinearFusion(nn.Module):
    """(B, D_x), (B, D_y) -> (B,): b + w_xᵀx + w_yᵀy + Σ_h x_hᵀ W_h y_h over ``heads`` chunks of x and y."""

    def __init__(self, x_dim: int, y_dim: int, heads: int, device: torch.device | None = None) -> None:
        super().__init__()
        if x_dim % heads or y_dim % heads:
            raise ValueError(f"fusion heads ({heads}) must divide both stream widths ({x_dim}, {y_dim})")
        self.heads = heads
        self.w_x = nn.Linear(x_dim, 1, device=device)
        self.w_y = nn.Linear(y_dim, 1, bias=False, device=device)
        self.w_xy = nn.Parameter(torch.empty(heads, x_dim // heads, y_dim // heads, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_normal_(self.w_xy)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        b = x.shape[0]
        # One (B, D_x/h) @ (D_x/h, D_y/h) product per head; a broadcast matmul over (B, h, 1, D_x/h)
        # instead makes autograd materialise a (B, h, D_x/h, D_y/h) gradient for W (1 GB at B=4096).
        # bmm, not einsum: einsum's gradient for W came back with other strides than W's (DDP warned and
        # copied it every step).
        xw = torch.bmm(x.view(b, self.heads, -1).transpose(0, 1), self.w_xy).transpose(0, 1)  # (B, h, D_y/h)
        xwy = (xw * y.view(b, self.heads, -1)).sum(-1)  # (B, h)
        return (self.w_x(x) + self.w_y(y)).squeeze(-1) + xwy.sum(-1)

    def flops_per_example(self) -> int:
        # x_hᵀW_h is a matmul per head; its product with y_h is element-wise and a sum: free (models.flops).
        h, dx, dy = self.w_xy.shape
        return linear_flops(self.w_x) + linear_flops(self.w_y) + h * matmul_flops(1, dy, dx)
