"""AutoInt+ (Song et al., CIKM 2019): stacked multi-head self-attention over the field embeddings,
plus a parallel DNN on flatten(X0); the two logits are summed. ``mlp=[]`` gives plain AutoInt."""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor, nn

from recscale.models.base import ModelParams, RecModel
from recscale.models.blocks import MLP, MultiHeadSelfAttention, Norm, Widths
from recscale.models.embedding import EmbeddingConfig, FeatureSet
from recscale.models.registry import register


class AutoIntParams(ModelParams):
    attention_layers: int = Field(3, ge=1)
    heads: int = Field(2, ge=1)
    head_dim: int = Field(16, ge=1)
    mlp: Widths = [256, 256]  # the parallel DNN's hidden widths; [] = no DNN
    norm: Norm = "none"
    dropout: float = Field(0.0, ge=0, lt=1)


@register("autoint", AutoIntParams)
class AutoInt(RecModel):
    """X0 (B, n, d) -> attention layers (B, n, heads·head_dim) -> linear, + DNN(flatten X0) -> (B,)."""

    def __init__(
        self,
        features: FeatureSet,
        embedding: EmbeddingConfig,
        params: AutoIntParams,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(features, embedding, device)
        n, d = self.embedding.num_outputs, self.embedding.dim
        att_dim = params.heads * params.head_dim
        self.attention = nn.Sequential(
            *(
                MultiHeadSelfAttention(n, d if i == 0 else att_dim, params.heads, params.head_dim, device)
                for i in range(params.attention_layers)
            )
        )
        self.attention_out = nn.Linear(n * att_dim, 1, device=device)
        self.dnn = MLP(n * d, params.mlp, 1, params.norm, params.dropout, device) if params.mlp else None

    def interact(self, x0: Tensor) -> Tensor:
        logit = self.attention_out(self.attention(x0).flatten(1))
        if self.dnn is not None:
            logit = logit + self.dnn(x0.flatten(1))
        return logit.squeeze(-1)
