"""Logistic regression: one weight per (id, embedding coordinate), i.e. logit = w·flatten(X0) + b.

Each id's embedding is free, so a linear map of the flattened embeddings has exactly LR's capacity
(a learned scalar per id and field) without a separate 1-dim table.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from recscale.models.base import ModelParams, RecModel
from recscale.models.embedding import EmbeddingConfig, FeatureSet
from recscale.models.registry import register


class LRParams(ModelParams):
    """LR has no hyperparameters beyond the embedding config."""


@register("lr", LRParams)
class LR(RecModel):
    """logit = Linear(flatten(X0)): (B, n, d) -> (B,)."""

    def __init__(
        self,
        features: FeatureSet,
        embedding: EmbeddingConfig,
        params: LRParams,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(features, embedding, device)
        self.linear = nn.Linear(self.embedding.num_outputs * self.embedding.dim, 1, device=device)

    def interact(self, x0: Tensor) -> Tensor:
        return self.linear(x0.flatten(1)).squeeze(-1)
