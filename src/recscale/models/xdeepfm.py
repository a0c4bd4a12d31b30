"""xDeepFM (Lian et al., KDD 2018): linear + CIN + DNN, logits summed.

The linear term is Linear(flatten X0), as in ``lr.py``: it has LR's capacity without a 1-dim table.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor, nn

from recscale.models.base import ModelParams, RecModel
from recscale.models.blocks import CIN, MLP, Norm, Widths
from recscale.models.embedding import EmbeddingConfig, FeatureSet
from recscale.models.registry import register


class XDeepFMParams(ModelParams):
    cin_layers: Widths = Field([16, 16], min_length=1)  # feature maps per CIN layer
    split_half: bool = True
    mlp: Widths = [256, 256]
    norm: Norm = "none"
    dropout: float = Field(0.0, ge=0, lt=1)


@register("xdeepfm", XDeepFMParams)
class XDeepFM(RecModel):
    """X0 (B, n, d) -> linear(flatten) + w · CIN(X0) + DNN(flatten) -> (B,)."""

    def __init__(
        self,
        features: FeatureSet,
        embedding: EmbeddingConfig,
        params: XDeepFMParams,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(features, embedding, device)
        n, d = self.embedding.num_outputs, self.embedding.dim
        self.linear = nn.Linear(n * d, 1, device=device)
        self.cin = CIN(n, d, params.cin_layers, params.split_half, device)
        self.cin_out = nn.Linear(self.cin.out_features, 1, bias=False, device=device)
        self.dnn = MLP(n * d, params.mlp, 1, params.norm, params.dropout, device)

    def interact(self, x0: Tensor) -> Tensor:
        x = x0.flatten(1)
        return (self.linear(x) + self.cin_out(self.cin(x0)) + self.dnn(x)).squeeze(-1)
