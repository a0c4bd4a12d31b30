"""xDeepFM's Compressed Interaction Network."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import torch
from torch import Tensor, nn

from recscale.models.flops import matmul_flops


class CIN(nn.Module):
    """(B, m, d) -> (B, out_features): explicit vector-wise interactions of growing order (Lian et al. 2018).

    Layer k: X^k_h = Σ_{i,j} W^{k,h}_{ij} (X^{k-1}_i ∘ X^0_j), a 1x1 convolution over the H_{k-1}·m
    outer products; each layer's feature maps are sum-pooled over d. With ``split_half`` every layer but
    the last sends half its maps to the output and half to the next layer (as in the authors' code).
    """

    def __init__(
        self,
        num_fields: int,
        dim: int,
        layer_sizes: Sequence[int],
        split_half: bool = True,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.dim = dim
        self.convs = nn.ModuleList()
        self.halves: list[bool] = []  # whether a layer splits its maps between the next layer and the output
        h_prev = num_fields
        for i, h in enumerate(layer_sizes):
            half = split_half and i < len(layer_sizes) - 1
            if half and h % 2:
                raise ValueError(f"CIN with split_half needs even layer sizes (but the last), got {h}")
            self.convs.append(nn.Conv1d(h_prev * num_fields, h, kernel_size=1, device=device))
            self.halves.append(half)
            h_prev = h // 2 if half else h
        self.out_features = sum(
            h // 2 if half else h for h, half in zip(layer_sizes, self.halves, strict=True)
        )

    def forward(self, x0: Tensor) -> Tensor:
        b, _, d = x0.shape
        x, pooled = x0, []
        for conv, half in zip(self.convs, self.halves, strict=True):
            z = (x.unsqueeze(2) * x0.unsqueeze(1)).reshape(b, -1, d)  # (B, H_{k-1}·m, d) outer products
            h = conv(z)  # (B, H_k, d)
            x, out = h.chunk(2, dim=1) if half else (h, h)
            pooled.append(out.sum(-1))
        return torch.cat(pooled, dim=1)

    def flops_per_example(self) -> int:
        convs = cast(Iterable[nn.Conv1d], self.convs)  # __init__ appends only Conv1d layers
        return sum(matmul_flops(c.out_channels, self.dim, c.in_channels) for c in convs)
