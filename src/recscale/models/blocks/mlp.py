"""The one MLP used everywhere: hidden layers Linear -> norm -> ReLU -> dropout, then a linear output."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

import torch
from pydantic import Field
from torch import nn

from recscale.models.blocks.dropout import Dropout
from recscale.models.flops import linear_flops

Norm = Literal["none", "batch", "layer"]
# Hidden widths in a config: each at least 1 (a 0-wide layer makes a constant output; a negative one a torch error).
Widths = list[Annotated[int, Field(ge=1)]]


class MLP(nn.Sequential):
    """(B, in_features) -> (B, out_features).

    ``out_features=None`` ends on the last hidden layer (after its activation), so the MLP is a
    feature extractor; otherwise a final plain Linear maps to ``out_features`` (e.g. 1 logit).
    """

    def __init__(
        self,
        in_features: int,
        hidden: Sequence[int],
        out_features: int | None = None,
        norm: Norm = "none",
        dropout: float = 0.0,
        device: torch.device | None = None,
    ) -> None:
        # LayerNorm of one value is its bias: the layer, and a model with no path around it, was a constant.
        if norm == "layer" and 1 in hidden:
            raise ValueError(
                f"model.norm=layer over a hidden layer of width 1 (widths {list(hidden)}) outputs a constant (one "
                "value minus its mean is 0); widen the layer or choose another model.norm"
            )
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers.append(nn.Linear(width, h, device=device))
            if norm == "batch":
                layers.append(nn.BatchNorm1d(h, device=device))
            elif norm == "layer":
                layers.append(nn.LayerNorm(h, device=device))
            layers.append(nn.ReLU())
            if dropout > 0:
                layers.append(Dropout(dropout))
            width = h
        if out_features is not None:
            layers.append(nn.Linear(width, out_features, device=device))
            width = out_features
        super().__init__(*layers)
        self.in_features = in_features
        self.out_features = width

    def flops_per_example(self) -> int:
        return sum(linear_flops(m) for m in self if isinstance(m, nn.Linear))
