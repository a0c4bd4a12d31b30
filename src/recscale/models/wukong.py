"""Wukong (Zhang, Luo et al., ICML 2024, arXiv 2403.02545): stacked factorization machines.

Each layer maps X_i (B, n_in, d) to
    X_{i+1} = LayerNorm(concat(FMB(X_i), LCB(X_i)) + residual(X_i))    (B, n_F + n_L, d)
with FMB(X) = reshape(MLP(LayerNorm(flatten(FM(X))))) to (B, n_F, d) and LCB(X) = W_L X (n_L × n_in).
The residual is the identity, or a linear map along the embedding axis when n_in != n_F + n_L.
l layers capture interactions of order up to 2^l; a final MLP maps the flattened last layer to a logit.
The scaling knobs are num_layers, n_f, n_l, k and fmb_mlp (depth and width).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from recscale.models.base import ModelParams, RecModel
from recscale.models.blocks import MLP, FullFM, LinearCompressBlock, Norm, OptimizedFM, Widths, as_compute
from recscale.models.embedding import EmbeddingConfig, FeatureSet
from recscale.models.registry import register


class WukongParams(ModelParams):
    num_layers: int = Field(2, ge=1)  # l
    n_f: int = Field(8, ge=1)  # embeddings from the FM block per layer
    n_l: int = Field(8, ge=1)  # embeddings from the linear compress block per layer
    k: int = Field(8, ge=1)  # compressed embeddings of the optimized FM (columns of Y)
    fm: Literal["optimized", "full"] = "optimized"  # X (Xᵀ Y), n·k features; or X Xᵀ, n·n features
    fmb_mlp: Widths = [128]  # hidden widths of each FMB's MLP (its output layer is n_f·d)
    final_mlp: Widths = [128]
    norm: Norm = "none"  # on the hidden layers of every MLP (FMB and final), as the baselines' knob
    dropout: float = Field(0.0, ge=0, lt=1)

    @model_validator(mode="after")
    def _k_needs_the_optimized_fm(self) -> WukongParams:
        # The full FM has no Y: a k given with it was dropped without a word.
        if self.fm == "full" and self.changed("k"):
            raise ValueError(
                "k is the optimized FM's width, and fm is full (which has none); drop k or set fm=optimized"
            )
        return self


class FactorizationMachineBlock(nn.Module):
    """(B, n_in, d) -> (B, n_f, d): reshape(MLP(LayerNorm(flatten(FM(X)))))."""

    def __init__(self, n_in: int, dim: int, params: WukongParams, device: torch.device | None = None) -> None:
        super().__init__()
        self.fm = OptimizedFM(n_in, params.k, dim, device) if params.fm == "optimized" else FullFM(n_in, dim)
        fm_features = n_in * (params.k if params.fm == "optimized" else n_in)
        self.norm = nn.LayerNorm(fm_features, device=device)
        self.mlp = MLP(
            fm_features,
            params.fmb_mlp,
            params.n_f * dim,
            norm=params.norm,
            dropout=params.dropout,
            device=device,
        )
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.norm(self.fm(x).flatten(1))).view(x.shape[0], -1, self.dim)


class WukongLayer(nn.Module):
    """(B, n_in, d) -> (B, n_f + n_l, d)."""

    def __init__(self, n_in: int, dim: int, params: WukongParams, device: torch.device | None = None) -> None:
        super().__init__()
        n_out = params.n_f + params.n_l
        self.fmb = FactorizationMachineBlock(n_in, dim, params, device)
        self.lcb = LinearCompressBlock(n_in, params.n_l, dim, device)
        self.residual = nn.Identity() if n_in == n_out else LinearCompressBlock(n_in, n_out, dim, device)
        self.norm = nn.LayerNorm(dim, device=device)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(torch.cat([self.fmb(x), self.lcb(x)], dim=1) + self.residual(x))


@register("wukong", WukongParams)
class Wukong(RecModel):
    """Embedding layer -> num_layers Wukong layers -> MLP on the flattened (B, n_f + n_l, d)."""

    def __init__(
        self,
        features: FeatureSet,
        embedding: EmbeddingConfig,
        params: WukongParams,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(features, embedding, device)
        n, d, n_out = self.embedding.num_outputs, self.embedding.dim, params.n_f + params.n_l
        self.layers = nn.Sequential(
            *(WukongLayer(n if i == 0 else n_out, d, params, device) for i in range(params.num_layers))
        )
        self.head = MLP(
            n_out * d, params.final_mlp, 1, norm=params.norm, dropout=params.dropout, device=device
        )

    def interact(self, x0: Tensor) -> Tensor:
        # The first layer's four products all read x0: cast it to their dtype once (bf16 under autocast).
        return self.head(self.layers(as_compute(x0)).flatten(1)).squeeze(-1)
