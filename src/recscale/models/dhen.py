"""DHEN (Zhang et al. 2022, arXiv 2203.11014): a deep, hierarchical ensemble of interaction modules.

Each layer runs several interaction modules on X_i (B, n_in, d), each giving (B, n_out, d):

- dot:            pairwise dot products (DLRM) -> Linear -> (B, n_out, d)
- cross:          one DCN cross layer on flatten(X) -> (B, n_in, d) -> LCB
- self_attention: AutoInt's multi-head self-attention (d -> d) -> LCB
- linear:         LCB (W X, Wukong's linear compress block)
- mlp:            MLP on flatten(X) -> (B, n_out, d)

and combines them as X_{i+1} = LayerNorm(LCB(concat(modules(X_i))) + shortcut(X_i)): the ensemble
is concatenated along the embedding axis and projected back to n_out; the shortcut is the identity,
or an LCB when n_in != n_out. A final MLP maps the flattened last layer to a logit.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from recscale.models.base import ModelParams, RecModel
from recscale.models.blocks import (
    MLP,
    CrossNet,
    DotInteraction,
    LinearCompressBlock,
    MultiHeadSelfAttention,
    Widths,
)
from recscale.models.embedding import EmbeddingConfig, FeatureSet
from recscale.models.registry import register

Interaction = Literal["dot", "cross", "self_attention", "linear", "mlp"]


class DHENParams(ModelParams):
    num_layers: int = Field(2, ge=1)
    num_embeddings: int = Field(16, ge=1)  # n_out of every layer
    modules: list[Interaction] = Field(["dot", "self_attention", "linear"], min_length=1)
    heads: int = Field(2, ge=1)  # self_attention heads; must divide the embedding dim
    module_mlp: Widths = [256]  # hidden widths of the "mlp" module
    final_mlp: Widths = [256]
    dropout: float = Field(0.0, ge=0, lt=1)

    @model_validator(mode="after")
    def _unique_modules(self) -> DHENParams:
        if len(set(self.modules)) != len(self.modules):
            raise ValueError(f"DHEN modules must be distinct, got {self.modules}")
        # Read by one module each: without it in modules they were dropped without a word.
        for key, module in (("heads", "self_attention"), ("module_mlp", "mlp")):
            if module not in self.modules and self.changed(key):
                raise ValueError(
                    f"{key} is read by the {module} module only, which modules {self.modules} lacks"
                )
        return self


def interaction_module(
    kind: Interaction, n_in: int, dim: int, params: DHENParams, device: torch.device | None
) -> nn.Module:
    """One ensemble member: (B, n_in, d) -> (B, n_out, d)."""
    n_out = params.num_embeddings
    if kind == "dot":
        dot = DotInteraction(n_in, dim)
        return nn.Sequential(
            dot, nn.Linear(dot.out_features, n_out * dim, device=device), nn.Unflatten(1, (n_out, dim))
        )
    if kind == "cross":
        return nn.Sequential(
            nn.Flatten(1),
            CrossNet(n_in * dim, num_layers=1, device=device),
            nn.Unflatten(1, (n_in, dim)),
            LinearCompressBlock(n_in, n_out, dim, device),
        )
    if kind == "self_attention":
        if dim % params.heads:
            raise ValueError(f"DHEN heads ({params.heads}) must divide the embedding dim ({dim})")
        return nn.Sequential(
            MultiHeadSelfAttention(n_in, dim, params.heads, dim // params.heads, device),
            LinearCompressBlock(n_in, n_out, dim, device),
        )
    if kind == "linear":
        return LinearCompressBlock(n_in, n_out, dim, device)
    return nn.Sequential(
        nn.Flatten(1),
        MLP(n_in * dim, params.module_mlp, n_out * dim, dropout=params.dropout, device=device),
        nn.Unflatten(1, (n_out, dim)),
    )


class DHENLayer(nn.Module):
    """(B, n_in, d) -> (B, n_out, d): LayerNorm(LCB(concat of the modules' outputs) + shortcut)."""

    def __init__(self, n_in: int, dim: int, params: DHENParams, device: torch.device | None = None) -> None:
        super().__init__()
        n_out = params.num_embeddings
        self.ensemble = nn.ModuleList(
            interaction_module(k, n_in, dim, params, device) for k in params.modules
        )
        self.combine = LinearCompressBlock(len(params.modules) * n_out, n_out, dim, device)
        self.shortcut = nn.Identity() if n_in == n_out else LinearCompressBlock(n_in, n_out, dim, device)
        self.norm = nn.LayerNorm(dim, device=device)

    def forward(self, x: Tensor) -> Tensor:
        ensemble = torch.cat([module(x) for module in self.ensemble], dim=1)
        return self.norm(self.combine(ensemble) + self.shortcut(x))


@register("dhen", DHENParams)
class DHEN(RecModel):
    """X0 (B, n, d) -> num_layers DHEN layers (B, n_out, d) -> MLP on the flattened output -> (B,)."""

    def __init__(
        self,
        features: FeatureSet,
        embedding: EmbeddingConfig,
        params: DHENParams,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(features, embedding, device)
        n, d, n_out = self.embedding.num_outputs, self.embedding.dim, params.num_embeddings
        self.layers = nn.Sequential(
            *(DHENLayer(n if i == 0 else n_out, d, params, device) for i in range(params.num_layers))
        )
        self.head = MLP(n_out * d, params.final_mlp, 1, dropout=params.dropout, device=device)

    def interact(self, x0: Tensor) -> Tensor:
        return self.head(self.layers(x0).flatten(1)).squeeze(-1)
