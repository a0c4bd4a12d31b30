"""The unit of data a model consumes: dense floats, sparse ids as a KeyedJaggedTensor, labels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@dataclass
class Batch:
    """One mini-batch.

    dense:   (B, n_dense) float32, already filled and transformed.
    sparse:  KeyedJaggedTensor with one key per sparse feature (schema order), int64 ids,
             lengths of shape (n_sparse * B,); per-id weights when a feature is weighted.
    labels:  (B,) float32 in {0, 1}.
    weights: (B,) float32 >= 0, each row's importance weight (``schema.weight``); None: every row weighs 1.
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor
    weights: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=self.sparse.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            weights=None if self.weights is None else self.weights.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        weights = None if self.weights is None else self.weights.pin_memory()
        return Batch(self.dense.pin_memory(), self.sparse.pin(), self.labels.pin_memory(), weights)
