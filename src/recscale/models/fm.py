"""Factorization machine (Rendle 2010): LR + Σ_{i<j} <e_i, e_j> over all embeddings of X0."""

from __future__ import annotations

from torch import Tensor

from recscale.models.blocks import fm_pairwise
from recscale.models.lr import LR, LRParams
from recscale.models.registry import register


class FMParams(LRParams):
    """FM has no hyperparameters beyond the embedding config."""


@register("fm", FMParams)
class FM(LR):
    """LR's linear term plus the FM pairwise term."""

    def interact(self, x0: Tensor) -> Tensor:
        # The pairwise term is element-wise work, free in the FLOP count (FlopCounterMode agrees).
        return super().interact(x0) + fm_pairwise(x0)
