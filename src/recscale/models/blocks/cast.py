"""Casting once under autocast (``train.precision=bf16``) what autocast would cast on every use.

Autocast casts an op's fp32 inputs afresh at each op, and caches only leaf parameters; an expanded
weight is not a leaf, so casting it materialises ``batch`` copies of the weight, and an activation
read by several products is cast once per product. Same values, fewer copies.
"""

from __future__ import annotations

import torch
from torch import Tensor


def autocast_dtype(x: Tensor) -> torch.dtype:
    """The dtype autocast computes products in on ``x``'s device, or ``x``'s own dtype outside autocast."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def as_compute(x: Tensor) -> Tensor:
    """``x`` in the dtype products compute in (a no-op outside autocast)."""
    return x.to(autocast_dtype(x))


def batched_weight(weight: Tensor, x: Tensor) -> Tensor:
    """(o, n) -> (B, o, n), the same weight for each of ``x``'s B examples (a view, cast before expanding)."""
    return weight.to(autocast_dtype(x)).expand(x.shape[0], -1, -1)
