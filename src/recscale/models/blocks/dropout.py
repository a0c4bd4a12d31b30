"""Dropout whose CPU mask costs a fraction of torch's (bernoulli_ 94 ms, this 11 ms per Wukong bf16 step).

On CPU ``nn.functional.dropout`` draws its mask with ``bernoulli_``, ~10 ns an element on this 2-core
machine: 16% of a Wukong training step in bf16 (docs/BENCHMARKS.md, "bf16 training speed"). Here the mask
comes from 16-bit slices of 64-bit random words (one ``random_`` call per four elements) compared with
``round(p * 2^16)``, so ``p`` is honoured to within 2^-17; the kept elements are scaled by 1 / (1 - p)
as in torch. Other devices use torch's dropout, which is fast there.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def _scaled_and_masked(x: Tensor, keep: Tensor, scale: float) -> Tensor:
    """``x * keep * scale`` to the bit (a product with exactly 1 or 0 commutes with the rounding of
    ``x * scale``), ~3x faster in bf16: torch multiplies by a bool tensor through a slow per-element
    conversion, while the same bytes viewed as uint8 convert to 0/1 in ``x``'s dtype at copy speed."""
    return (x * scale).mul_(keep.view(torch.uint8).to(x.dtype))


class _MaskedScale(torch.autograd.Function):
    """y = x * keep * scale; the gradient is masked and scaled alike (the mask is kept as bool)."""

    @staticmethod
    def forward(ctx, x: Tensor, keep: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return _scaled_and_masked(x, keep, scale)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (keep,) = ctx.saved_tensors
        return _scaled_and_masked(grad, keep, ctx.scale), None, None


def keep_mask(shape: torch.Size, p: float, device: torch.device) -> Tensor:
    """A bool tensor of ``shape``, each element True with probability 1 - p (to within 2^-17)."""
    numel = shape.numel()
    words = torch.empty((numel + 3) // 4, dtype=torch.int64, device=device).random_(-(2**63), None)
    # Each 16-bit slice is uniform on [-2^15, 2^15); drop the lowest round(p * 2^16) values.
    return words.view(torch.int16)[:numel].view(shape) >= round(p * 65536) - 32768


class Dropout(nn.Module):
    """(*) -> (*): ``nn.Dropout(p)`` with the cheaper CPU mask above; identity in eval mode."""

    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        if x.device.type != "cpu":
            return nn.functional.dropout(x, self.p, True)
        return _MaskedScale.apply(x, keep_mask(x.shape, self.p, x.device), 1 / (1 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}"
