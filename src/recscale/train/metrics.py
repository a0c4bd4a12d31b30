"""CTR metrics: AUC, LogLoss, normalized entropy (NE) and calibration.

NE is the LogLoss divided by the entropy of the background CTR (the LogLoss of always predicting
the mean label), the metric of Meta's recommendation papers: 1.0 means no better than the base
rate. AUC uses torchmetrics' exact (threshold-free) binary AUROC.
"""

from __future__ import annotations

import math

import torch
from torchmetrics.functional.classification import binary_auroc


def binary_entropy(p: float) -> float:
    """Entropy in nats of a Bernoulli(p); 0 at p in {0, 1}."""
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


def normalized_entropy(logloss: float, ctr: float) -> float:
    """LogLoss over the entropy of the labels' CTR; NaN where the labels have one class (no entropy)."""
    base = binary_entropy(ctr)
    return logloss / base if base > 0 else float("nan")


def ctr_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Metrics of one evaluation pass. logits, labels: (N,) -> {auc, logloss, ne, calibration, rows}."""
    logits, labels = logits.double().flatten(), labels.double().flatten()
    n = int(labels.numel())
    if n == 0:
        raise ValueError("no rows to evaluate")
    logloss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).item()
    ctr = labels.mean().item()
    has_both = 0.0 < ctr < 1.0
    return {
        "auc": binary_auroc(torch.sigmoid(logits), labels.long()).item() if has_both else float("nan"),
        "logloss": logloss,
        "ne": normalized_entropy(logloss, ctr),
        "calibration": torch.sigmoid(logits).mean().item() / ctr if ctr > 0 else float("nan"),
        "rows": n,
    }
