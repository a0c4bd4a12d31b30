"""FinalMLP's stream-specific feature selection."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from recscale.models.blocks.mlp import MLP


class FeatureSelection(nn.Module):
    """(B, n, d) -> (B, n·d): flatten(X) ⊙ 2·sigmoid(MLP(context)) (Mao et al. 2023).

    The context is the embeddings at ``context`` positions of X, or, when empty, a learned vector
    shared by all examples (the paper's choice when no conditioning fields are given); the gate is
    then the same for every example and computed once per batch.
    """

    def __init__(
        self,
        n: int,
        dim: int,
        context: Sequence[int],
        hidden: Sequence[int],
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.context = list(context)
        self.bias = None if self.context else nn.Parameter(torch.zeros(1, dim, device=device))
        self.gate = MLP(dim * max(1, len(self.context)), hidden, n * dim, device=device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        ctx = x[:, self.context].flatten(1) if self.context else self.bias
        return x.flatten(1) * 2 * torch.sigmoid(self.gate(ctx))

    def flops_per_example(self) -> int:
        # A shared gate is one pass per batch, not per example: its cost per example vanishes with the batch.
        return self.gate.flops_per_example() if self.context else 0
