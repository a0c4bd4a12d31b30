"""Analytic FLOP counting conventions (tests/test_flops.py checks every model against ``FlopCounterMode``).

A FLOP count here is what ``torch.utils.flop_counter.FlopCounterMode`` reports: 2·m·n·k per matrix
product (matmul, linear, bmm, 1x1 conv); element-wise ops, norms, softmax and embedding lookups are
free. Models report forward FLOPs per example; training is counted as 3× forward (backward computes
two matmuls per forward matmul: one for the input gradient, one for the weight gradient).
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

from torch import nn

TRAIN_FLOPS_MULTIPLIER = 3


@runtime_checkable
class CountsFlops(Protocol):
    """A block that counts its own forward FLOPs per example."""

    def flops_per_example(self) -> int: ...


def mflop_text(mflops: float) -> str:
    """``mflops`` million FLOPs as text, with 3 decimals or, below 0.1, 3 significant digits: a logistic
    regression's few hundred FLOPs per example are 0.000320 MFLOP, not 0.000."""
    return f"{mflop_number(mflops)} MFLOP"


def mflop_number(mflops: float) -> str:
    """``mflops`` with 3 decimals or, below 0.1, 3 significant digits (``mflop_text`` without its unit)."""
    decimals = 3 if mflops <= 0 else max(3, 2 - math.floor(math.log10(mflops)))
    return f"{mflops:.{decimals}f}"


def matmul_flops(m: int, n: int, k: int) -> int:
    """FLOPs of an (m, k) @ (k, n) product."""
    return 2 * m * n * k


def linear_flops(layer: nn.Linear) -> int:
    """Forward FLOPs of ``layer`` on one input row (bias adds are free)."""
    return matmul_flops(1, layer.out_features, layer.in_features)


def module_flops(module: nn.Module) -> int:
    """Forward FLOPs per example of a block (its ``flops_per_example()``), an ``nn.Linear``, or a
    container of those (summed over its children; parameter-free children such as norms are free).

    A module whose matmuls are not one pass per child must define ``flops_per_example()``;
    the FlopCounterMode tests catch one that does not.
    """
    if isinstance(module, CountsFlops):
        return module.flops_per_example()
    if isinstance(module, nn.Linear):
        return linear_flops(module)
    return sum(module_flops(child) for child in module.children())
