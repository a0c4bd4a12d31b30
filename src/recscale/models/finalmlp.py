"""FinalMLP (Mao et al., AAAI 2023): two MLP streams over gated embeddings, fused bilinearly.

stream s: o_s = MLP_s(flatten(X0) ⊙ 2σ(MLP(context_s)))
logit = b + w_1ᵀo_1 + w_2ᵀo_2 + Σ_h o_1hᵀ W_h o_2h
"""

from __future__ import annotations

from typing import cast

import torch
from pydantic import Field
from torch import Tensor, nn

from recscale.models.base import ModelParams, RecModel
from recscale.models.blocks import MLP, BilinearFusion, FeatureSelection, Norm, Widths
from recscale.models.embedding import EmbeddingConfig, EmbeddingLayer, FeatureSet
from recscale.models.registry import register


class FinalMLPParams(ModelParams):
    mlp1: Widths = [256, 256]
    mlp2: Widths = [256]
    # Sparse features whose embeddings condition each stream's gate; [] = a learned shared vector.
    fs1_context: list[str] = []
    fs2_context: list[str] = []
    fs_hidden: Widths = [64]  # hidden widths of the gate MLPs
    fusion_heads: int = Field(1, ge=1)
    norm: Norm = "none"
    dropout: float = Field(0.0, ge=0, lt=1)


def _context_positions(embedding: EmbeddingLayer, names: list[str]) -> list[int]:
    """Rows of X0 holding the given features' embeddings."""
    missing = [f for f in names if f not in embedding.positions]
    if missing:
        raise ValueError(
            f"FinalMLP context features {missing} have no own embedding "
            f"(unknown or small-dim); choose from {sorted(embedding.positions)}"
        )
    return [i for f in names for i in embedding.positions[f]]


@register("finalmlp", FinalMLPParams)
class FinalMLP(RecModel):
    """X0 (B, n, d) -> two gated MLP streams (B, mlp1[-1]), (B, mlp2[-1]) -> bilinear fusion -> (B,)."""

    def __init__(
        self,
        features: FeatureSet,
        embedding: EmbeddingConfig,
        params: FinalMLPParams,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(features, embedding, device)
        n, d = self.embedding.num_outputs, self.embedding.dim
        self.streams = nn.ModuleList()
        self.gates = nn.ModuleList()
        for hidden, context in ((params.mlp1, params.fs1_context), (params.mlp2, params.fs2_context)):
            positions = _context_positions(self.embedding, context)
            self.gates.append(FeatureSelection(n, d, positions, params.fs_hidden, device))
            self.streams.append(MLP(n * d, hidden, norm=params.norm, dropout=params.dropout, device=device))
        out1, out2 = (cast(MLP, s).out_features for s in self.streams)  # the two MLPs just appended
        self.fusion = BilinearFusion(out1, out2, params.fusion_heads, device)

    def interact(self, x0: Tensor) -> Tensor:
        o1, o2 = (mlp(gate(x0)) for gate, mlp in zip(self.gates, self.streams, strict=True))
        return self.fusion(o1, o2)
