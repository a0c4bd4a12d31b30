"""What every CTR model shares: the embedding layer, logits, FLOP accounting, strict params."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recscale.models.blocks.calibration import Calibration
from recscale.models.embedding import EmbeddingConfig, EmbeddingLayer, FeatureSet
from recscale.models.flops import module_flops
from recscale.settings import Settings


class ModelParams(Settings):
    """Base of every model's hyperparameters: unknown keys are an error."""


class RecModel(nn.Module, ABC):
    """(dense (B, n_dense) float, sparse KJT) -> logits (B,) float32: the embedding layer gives X0 (B, n, d),
    ``interact`` does the model's own work, and ``calibration`` (the identity unless fit after training,
    ``train.calibrate``) rescales its logits."""

    def __init__(self, features: FeatureSet, embedding: EmbeddingConfig, device: torch.device | None) -> None:
        super().__init__()
        self.embedding = EmbeddingLayer(features, embedding, device)
        self.calibration = Calibration()

    @abstractmethod
    def interact(self, x0: Tensor) -> Tensor:
        """(B, n, d) -> logits (B,)."""

    def forward(self, dense: Tensor, sparse: KeyedJaggedTensor) -> Tensor:
        return self.calibration(self.interact(self.embedding(dense, sparse)))

    def flops_per_example(self) -> int:
        """Analytic forward FLOPs per example of the dense computation, summed over the submodules
        (each block counts its own; embedding lookups are free)."""
        return sum(module_flops(child) for child in self.children())

    def x0_sources(self) -> list[tuple[nn.Module, float]]:
        """The modules whose outputs make up X0, each with the weight of its squared norm in an L2
        penalty on X0 (``train.embedding_l2``): here the embedding layer, weight 1."""
        return [(self.embedding, 1.0)]


@runtime_checkable
class TrainableModel(Protocol):
    """What the trainer needs of a model beyond ``forward``: a flat ``RecModel`` or a DMT model."""

    def flops_per_example(self) -> int: ...

    def x0_sources(self) -> list[tuple[nn.Module, float]]: ...


def count_parameters(model: RecModel) -> dict[str, int]:
    """Dense and sparse (embedding table) parameter counts of an unsharded model."""
    tables = model.embedding.table_parameters()
    sparse = sum(p.numel() for p in tables)
    table_ids = {id(p) for p in tables}
    dense = sum(p.numel() for p in model.parameters() if id(p) not in table_ids)
    return {"dense": int(dense), "sparse": int(sparse)}
