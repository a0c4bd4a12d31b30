"""Platt scaling of a model's logits: p = sigmoid(a * logit + b), fit after training (``train.calibrate``).

A model kept at its best validation AUC or LogLoss can still be over-confident (Wukong on Frappe: the
fitted a is ~0.7). Two numbers, fit on held-out rows by LogLoss, fix that without moving the ranking
(a > 0 keeps the order, so AUC is unchanged), and live in the model as buffers, so checkpoints,
``recscale eval``, exports and the server all apply them. The targets are Platt's (1999) smoothed ones,
(N+ + 1)/(N+ + 2) for a positive and 1/(N- + 2) for a negative: on rows the logits separate perfectly the
LogLoss against 0/1 falls without end as a grows, and the fit stopped at a slope in the thousands.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Calibration(nn.Module):
    """logits (B,) -> a * logits + b (B,) in float32; a = 1, b = 0 (the identity) until ``fit``."""

    scale: Tensor
    bias: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("bias", torch.zeros(()))

    def forward(self, logits: Tensor) -> Tensor:
        return logits.float() * self.scale + self.bias

    @torch.no_grad()
    def fit(self, logits: Tensor, labels: Tensor, weights: Tensor | None = None) -> tuple[float, float]:
        """Set (a, b) to minimise the LogLoss of sigmoid(a * logits + b) on (logits (N,), labels (N,)),
        each row's weighted by ``weights`` (N,) if given, where ``logits`` are this model's uncalibrated
        outputs; returns them. Deterministic (float64 L-BFGS from the identity), so every rank fitting the
        same gathered logits gets the same numbers. Labels of one class (or a class of no weight), or a fit
        that reverses or flattens the ranking, keep the identity."""
        z, y = logits.double().cpu(), labels.double().cpu()
        w = None if weights is None else weights.double().cpu()
        positive, negative = _class_weights(y, w)
        # One class: the LogLoss falls without end as b grows, so there is nothing to fit.
        a, b = platt_fit(z, y, weights=w) if bool(positive > 0) and bool(negative > 0) else (1.0, 0.0)
        if not a > 0:  # a ranking reversed or flat is no calibration: keep the identity
            a, b = 1.0, 0.0
        self.set(a, b)
        return a, b

    @torch.no_grad()
    def set(self, scale: float, bias: float) -> None:
        self.scale.fill_(scale)
        self.bias.fill_(bias)


def _class_weights(y: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
    """(N+, N-), 0-dim: the positives' and negatives' count of 0/1 labels y, or their total ``weights``."""
    w = torch.ones_like(y) if weights is None else weights
    return (w * y).sum(), (w * (1 - y)).sum()


def platt_targets(y: Tensor, weights: Tensor | None = None) -> Tensor:
    """Platt's targets of 0/1 labels y: (N+ + 1)/(N+ + 2) for a positive, 1/(N- + 2) for a negative, whose
    LogLoss has a finite minimiser also where the logits separate the classes; N+ and N- are the classes'
    total ``weights`` where rows are weighted."""
    positives, negatives = _class_weights(y, weights)
    return torch.where(y > 0.5, (positives + 1) / (positives + 2), 1 / (negatives + 2))


def platt_fit(
    z: Tensor, y: Tensor, smoothed: bool = True, weights: Tensor | None = None
) -> tuple[float, float]:
    """The (a, b) minimising the LogLoss of sigmoid(a * z + b) against Platt's targets of y (``smoothed``;
    else y itself, the rule before them: bench/platt_targets.py compares the two), each row's weighted by
    ``weights`` (N,) if given, float64 L-BFGS from (1, 0)."""
    y = platt_targets(y, weights) if smoothed else y
    # Weights scaled to mean 1: the loss keeps the scale L-BFGS's tolerances are set for (1s stay 1s).
    w = None if weights is None else weights / weights.mean()
    ab = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([ab], max_iter=100, tolerance_change=1e-12, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        with torch.enable_grad():
            loss = F.binary_cross_entropy_with_logits(ab[0] * z + ab[1], y, weight=w)
            loss.backward()
        return loss

    opt.step(closure)
    a, b = ab.detach().tolist()
    return a, b
