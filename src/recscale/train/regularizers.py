"""What the train step applies besides the loss and the optimizers: the embedding L2 penalty, the
decoupled decay of the tables, and a moving average of the dense weights."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from recscale.models.base import TrainableModel


class EmbeddingL2:
    """``train.embedding_l2``: λ·Σ‖x‖²/B over the embedding vectors X0 of the latest forward (B: this
    rank's samples), added to the loss; it regularises the looked-up rows, frequent ids more. X0 is
    what the model's ``x0_sources()`` name (module and weight of its squared norm: for a DMT model
    chosen so the tables get the flat model's gradient)."""

    def __init__(self, model: TrainableModel, weight: float) -> None:
        self.weight = weight
        self.parts: dict[int, tuple[torch.Tensor, float]] = {}
        for i, (module, scale) in enumerate(model.x0_sources()):
            module.register_forward_hook(lambda m, x, out, i=i, s=scale: self.parts.__setitem__(i, (out, s)))

    def __call__(self, batch_size: float) -> torch.Tensor:
        total = sum(s * x.square().sum() for x, s in self.parts.values())
        assert isinstance(total, torch.Tensor)  # after a forward: the hooks have filled every part
        return self.weight * total / batch_size


class TableDecay:
    """``train.table_weight_decay``: every row of this rank's tables (their storage: shards are views
    of the fused weights) shrinks by ``1 - lr·wd`` after each step, looked up or not."""

    def __init__(self, shards: list[torch.Tensor], weight: float) -> None:
        self.shards, self.weight = shards, weight

    @torch.no_grad()
    def __call__(self, table_lr: float) -> None:
        torch._foreach_mul_(self.shards, 1 - table_lr * self.weight)


class DenseEMA:
    """``train.ema_decay``: an exponential moving average of the dense weights, updated after every
    step with decay min(decay, (1 + n) / (10 + n)) at step n, so early averages are not dominated by the
    initialisation (n is the run's step count, so a resumed run averages as the uninterrupted one).
    ``applied()`` swaps it into the model (for evaluation and the best checkpoint)."""

    def __init__(self, params: dict[str, torch.Tensor], decay: float) -> None:
        self.params, self.decay = params, decay
        self.shadow = {k: p.detach().clone() for k, p in params.items()}

    @torch.no_grad()
    def update(self, step: int) -> None:
        d = min(self.decay, (1 + step) / (10 + step))
        torch._foreach_lerp_(list(self.shadow.values()), [p.detach() for p in self.params.values()], 1 - d)

    @torch.no_grad()
    def reset(self) -> None:
        """Average from the model's current weights on (after they were replaced, e.g. by the best)."""
        _copy(list(self.shadow.values()), list(self.params.values()))

    @torch.no_grad()
    def apply(self, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Put the average (or ``weights``) into the model."""
        src = weights or self.shadow
        _copy(list(self.params.values()), [src[k] for k in self.params])

    @contextmanager
    def applied(self) -> Iterator[None]:
        raw = {k: p.detach().clone() for k, p in self.params.items()}
        self.apply()
        try:
            yield
        finally:
            self.apply(raw)


def _copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])``, one by one: FSDP2's DTensor parameters (``distributed.dense: fsdp``) have no
    ``_foreach_copy_``, which failed every evaluation of such a run with ``train.ema_decay`` set."""
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)
