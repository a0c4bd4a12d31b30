"""``train.precision``: the dense network's compute precision.

bf16 is mixed precision: ``torch.autocast`` runs matmuls (linear, bmm, ...) in bfloat16 while the
weights, their gradients and the optimizer state stay float32 (the master copy), and the loss and the
metrics are computed in float32 from float32 logits. Embedding lookups are not autocast: the tables
keep their own storage precision. On CPU bf16 matmuls run 2.5-4x faster than fp32 on machines with
AVX512-BF16 or AMX (an AVX512-BF16 AMD EPYC, 2 threads: 400 against 150 GFLOP/s for a 4096x1024x1024
product); elsewhere they are emulated and far slower (an AVX2-only AMD EPYC: 0.8 against 69 GFLOP/s),
so the trainer warns there.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import Literal

import torch

Precision = Literal["fp32", "bf16"]


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bf16 matrices in hardware (CUDA; on CPU AVX512-BF16 or AMX)."""
    if device.type != "cpu":
        return True
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def warn_if_emulated(precision: Precision, device: torch.device) -> None:
    if precision == "bf16" and not native_bf16(device):
        warnings.warn(
            "train.precision=bf16: this CPU has no bf16 matmul instructions (AVX512-BF16 or AMX), so "
            "bf16 is emulated and much slower than fp32 here; use train.precision=fp32",
            stacklevel=3,
        )


def autocast(precision: Precision, device: torch.device) -> AbstractContextManager[object]:
    """The forward pass's context for ``precision`` on ``device``."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)
