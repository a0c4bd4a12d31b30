"""MaskNet's MaskBlock."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from recscale.models.blocks.mlp import MLP


class MaskBlock(nn.Module):
    """(B, D_emb), (B, D_in) -> (B, D_out): ReLU(LN(W (mask(V_emb) ⊙ V_in))) (Wang et al. 2021).

    The instance-guided mask is a two-layer MLP of the flattened embeddings whose aggregation layer
    has ``reduction_ratio · D_in`` units.
    """

    def __init__(
        self,
        emb_features: int,
        in_features: int,
        out_features: int,
        reduction_ratio: float,
        dropout: float = 0.0,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        aggregation = max(1, round(reduction_ratio * in_features))
        self.mask = MLP(emb_features, [aggregation], in_features, device=device)
        self.hidden = MLP(in_features, [out_features], norm="layer", dropout=dropout, device=device)
        self.out_features = out_features

    def forward(self, v_emb: Tensor, v_in: Tensor) -> Tensor:
        return self.hidden(self.mask(v_emb) * v_in)

    def flops_per_example(self) -> int:
        return self.mask.flops_per_example() + self.hidden.flops_per_example()
