"""DCNv2 cross network."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from recscale.models.flops import linear_flops


class CrossNet(nn.Module):
    """(B, D) -> (B, D): x_{l+1} = x_0 ⊙ (W_l x_l + b_l) + x_l, ``num_layers`` times (DCNv2).

    ``low_rank=r`` factorises each W_l as U_l V_lᵀ with U_l, V_l of shape (D, r): cost 4Dr instead of 2D².
    """

    def __init__(
        self,
        in_features: int,
        num_layers: int,
        low_rank: int | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(in_features, in_features, device=device)
            if low_rank is None
            else nn.Sequential(
                nn.Linear(in_features, low_rank, bias=False, device=device),
                nn.Linear(low_rank, in_features, device=device),
            )
            for _ in range(num_layers)
        )

    def forward(self, x0: Tensor) -> Tensor:
        x = x0
        for layer in self.layers:
            x = x0 * layer(x) + x
        return x

    def flops_per_example(self) -> int:
        return sum(linear_flops(m) for m in self.layers.modules() if isinstance(m, nn.Linear))
