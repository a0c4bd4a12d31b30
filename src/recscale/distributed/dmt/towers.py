"""DMT's tower modules (TM): per tower, (B, n_t, d) -> (B, c_t, d) before the output leaves the host.

c_t = ceil(n_t / compression), so the inter-host bytes of the tower's output shrink by about the
compression ratio. The module sees all of its tower's embeddings, so it can model the interactions
inside the tower before compressing (the paper's point: interact locally, send less).

- identity: c_t = n_t; DMT then computes exactly what the flat model computes.
- lcb: Wukong's linear compress block, a learned mix along the embedding axis.
- projection: a linear map of the flattened n_t·d vector to c_t·d (DLRM, DCNv2).
- wukong: one Wukong layer (FM block + LCB, residual, LayerNorm) with n_f + n_l = c_t.
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from recscale.config import TowerModuleConfig
from recscale.models.blocks import LinearCompressBlock
from recscale.models.wukong import WukongLayer, WukongParams


def tower_outputs(n: int, cfg: TowerModuleConfig) -> int:
    """c_t: how many d-vectors a tower of ``n`` embeddings sends."""
    return max(1, math.ceil(n / cfg.compression))


class Projection(nn.Module):
    """(B, n, d) -> (B, c, d): one linear layer on the flattened embeddings."""

    def __init__(self, n: int, c: int, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(n * dim, c * dim)
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x.flatten(1)).view(x.shape[0], -1, self.dim)


def build_tower_module(n: int, dim: int, cfg: TowerModuleConfig) -> nn.Module:
    c = tower_outputs(n, cfg)
    if cfg.type == "identity":
        return nn.Identity()
    if cfg.type == "lcb" or (cfg.type == "wukong" and c < 2):  # a Wukong layer needs n_f, n_l >= 1
        return LinearCompressBlock(n, c, dim)
    if cfg.type == "projection":
        return Projection(n, c, dim)
    params = WukongParams(num_layers=1, n_f=c // 2, n_l=c - c // 2, k=min(n, 4), fmb_mlp=[4 * c * dim // 2])
    return WukongLayer(n, dim, params)
