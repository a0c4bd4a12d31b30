"""DCNv2 (Wang et al., WWW 2021): a cross network and a deep MLP on flatten(X0), stacked or parallel.

stacked:  logit = w · deep(cross(x0))
parallel: logit = w · [cross(x0), deep(x0)]
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from recscale.models.base import ModelParams, RecModel
from recscale.models.blocks import MLP, CrossNet, Norm, Widths
from recscale.models.embedding import EmbeddingConfig, FeatureSet
from recscale.models.registry import register


class DCNv2Params(ModelParams):
    num_cross_layers: int = Field(3, ge=1)
    low_rank: int | None = Field(None, ge=1)  # None = full-rank W; r = W ≈ U Vᵀ of rank r
    structure: Literal["stacked", "parallel"] = "parallel"
    mlp: Widths = [256, 256]  # the deep network's hidden widths
    norm: Norm = "none"
    dropout: float = Field(0.0, ge=0, lt=1)


@register("dcnv2", DCNv2Params)
class DCNv2(RecModel):
    """X0 (B, n, d) -> flatten (B, n·d) -> cross / deep -> (B,)."""

    def __init__(
        self,
        features: FeatureSet,
        embedding: EmbeddingConfig,
        params: DCNv2Params,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(features, embedding, device)
        width = self.embedding.num_outputs * self.embedding.dim
        self.stacked = params.structure == "stacked"
        self.cross = CrossNet(width, params.num_cross_layers, params.low_rank, device)
        self.deep = MLP(width, params.mlp, norm=params.norm, dropout=params.dropout, device=device)
        self.out = nn.Linear(self.deep.out_features + (0 if self.stacked else width), 1, device=device)

    def interact(self, x0: Tensor) -> Tensor:
        x = x0.flatten(1)
        h = self.deep(self.cross(x)) if self.stacked else torch.cat([self.cross(x), self.deep(x)], dim=1)
        return self.out(h).squeeze(-1)
