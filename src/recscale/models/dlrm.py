"""DLRM (Naumov et al. 2019): bottom MLP on dense features, dot-product interaction, top MLP.

The bottom MLP is the embedding layer's dense MLP (``EmbeddingConfig.dense_hidden``), so the dense
embeddings are the first ``num_dense_outputs`` rows of X0. The top MLP sees the dense embeddings
concatenated with the dot products of all distinct pairs of embeddings (dense ones included; no
self-products, the reference code's default). The bottom MLP ends in a plain Linear, as it does for every
model here, where the reference code's (and TorchRec's ``DenseArch``, FuxiCTR's) applies ReLU to its output.

Without dense features the top MLP sees only dot products, whose gradient with respect to one
embedding is the other: at the zoo's default ``init_std`` of 1e-4 both factors are tiny and training
stalls at AUC 0.5 (measured on Frappe). TorchRec's DLRM initialises tables uniformly in ±1/sqrt(rows);
here use ``model.embedding.init_std`` of about 0.05 (Frappe: valid AUC 0.982).

``interaction: cat`` feeds the top MLP flatten(X0) instead, FuxiCTR's ``interaction_op: cat``: the
variant behind BARS's DLRM figures (its Frappe_x1 entry, 0.9840, is this one).
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from recscale.models.base import ModelParams, RecModel
from recscale.models.blocks import MLP, DotInteraction, Norm, Widths
from recscale.models.embedding import EmbeddingConfig, FeatureSet
from recscale.models.registry import register

STALL_INIT_STD = 1e-2  # below this, dot products of two fresh embeddings give vanishing gradients


class DLRMParams(ModelParams):
    interaction: Literal["dot", "cat"] = "dot"
    top_mlp: Widths = [256, 128]
    norm: Norm = "none"
    dropout: float = Field(0.0, ge=0, lt=1)


@register("dlrm", DLRMParams)
class DLRM(RecModel):
    """X0 (B, n, d) -> top_mlp([flatten(dense embeddings), triu(X0 X0ᵀ)]) -> (B,); with
    ``interaction: cat``, X0 (B, n, d) -> top_mlp(flatten(X0)) -> (B,)."""

    def __init__(
        self,
        features: FeatureSet,
        embedding: EmbeddingConfig,
        params: DLRMParams,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(features, embedding, device)
        n, d = self.embedding.num_outputs, self.embedding.dim
        cat = params.interaction == "cat"
        if not cat and n < 2:  # no pair: the top MLP saw 0 inputs and trained a constant (AUC 0.5)
            raise ValueError(
                f"the dot interaction takes the products of pairs of embedding vectors, and these features give "
                f"{n} (one sparse feature and no dense, or every feature packed by small_dim_features), so the top "
                "MLP would see no input and predict a constant; set model.interaction=cat or add features"
            )
        if not cat and self.embedding.num_dense_outputs == 0 and embedding.init_std < STALL_INIT_STD:
            warnings.warn(
                f"dlrm: no dense features and model.embedding.init_std={embedding.init_std:g}: the dot products "
                "start near zero and may never learn; set model.embedding.init_std=0.05",
                stacklevel=2,
            )
        self.interaction = None if cat else DotInteraction(n, d)
        in_features = n * d if self.interaction is None else (
            self.embedding.num_dense_outputs * d + self.interaction.out_features)  # fmt: skip
        self.top_mlp = MLP(in_features, params.top_mlp, 1, params.norm, params.dropout, device)

    def interact(self, x0: Tensor) -> Tensor:
        if self.interaction is None:
            return self.top_mlp(x0.flatten(1)).squeeze(-1)
        dense = x0[:, : self.embedding.num_dense_outputs].flatten(1)
        return self.top_mlp(torch.cat([dense, self.interaction(x0)], dim=1)).squeeze(-1)
