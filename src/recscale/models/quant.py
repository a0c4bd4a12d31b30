"""Low-precision GEMM emulation: quantize-dequantize the inputs of a model's ``nn.Linear`` layers.

Formats (``FORMATS``), each emulated in fp32/fp64 arithmetic, so any CPU can measure what a format
would do to a model before hardware that computes in it is at hand:

    mxfp8_e4m3, mxfp8_e5m2, mxfp6_e2m3, mxfp6_e3m2, mxfp4, mxint8
        OCP Microscaling (MX) v1.0: blocks of ``block`` (32) consecutive elements along the last
        (reduction) dimension share one E8M0 power-of-two scale X = 2^(floor(log2 amax) - emax_elem),
        clamped to E8M0's range [2^-127, 2^127] (an all-zero block gets 2^-127; no fp32 input reaches
        the top, and a float64 block with amax >= 2^(128 + emax_elem) saturates there where
        microxcaling's reference gives NaN); each element is x / X rounded to nearest, ties to even,
        in the element format, saturated to its max normal, with the format's subnormals. A block holding NaN or Inf gets a NaN scale (spec 6.3), which
        we emulate by returning the whole block as NaN. MXINT8 elements are k/64, k in [-127, 127]
        (8-bit two's complement with an implicit 2^-6, saturated symmetrically).
    fp8_e4m3, fp8_e5m2
        FP8 with one fp32 scale per tensor, amax / max_normal, as FP8 training recipes do (a tensor
        holding NaN or Inf comes back all NaN, like an MX block). The activation's scale is its whole
        batch's, so a row's score depends on the rows scored with it (eval's batch, the server's dynamic
        batches); MX blocks are per row and do not.
    bf16, fp16
        Plain casts, for comparison (fp16 overflows to Inf past 65504: it is a cast).

``QuantLinear`` lowers one ``nn.Linear``: its activation input and its weight are fake-quantized
along the input-feature dimension with straight-through gradients (and, with ``gradients``, the
output gradient too); ``quantize_model`` swaps the layers a ``QuantConfig`` selects.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

import torch
import torch.nn.functional as F
from pydantic import model_validator
from torch import Tensor, nn

from recscale.errors import ConfigError
from recscale.models.flops import linear_flops
from recscale.settings import Settings

FormatName = Literal[
    "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4", "mxint8",
    "fp8_e4m3", "fp8_e5m2", "bf16", "fp16",
]  # fmt: skip

# E8M0's exponent range: the shared scale is clamped to 2^[-127, 127].
_E8M0_MIN, _E8M0_MAX = -127, 127


@dataclass(frozen=True)
class Elem:
    """An element format as a grid of representable magnitudes: ``mbits`` explicit mantissa bits,
    normals with exponents emin..emax, subnormals (quantum 2^(emin - mbits)) below 2^emin, and
    saturation at ``max_normal``. A fixed-point format is one with emin = emax (MXINT8)."""

    mbits: int
    emin: int
    emax: int  # emax_elem of the MX spec: the exponent of the largest normal
    max_normal: float


@dataclass(frozen=True)
class Format:
    """One entry of ``FORMATS``: how a tensor is scaled (per block, per tensor or a cast) and its elements."""

    kind: Literal["mx", "tensor", "cast"]
    bits: int  # bits per element (MX: plus 8 per block for the shared scale)
    elem: Elem | None = None
    dtype: torch.dtype | None = None  # cast formats


E4M3 = Elem(mbits=3, emin=-6, emax=8, max_normal=448.0)  # the "fn" variant: no Inf, S.1111.111 is NaN
E5M2 = Elem(mbits=2, emin=-14, emax=15, max_normal=57344.0)
E2M3 = Elem(mbits=3, emin=0, emax=2, max_normal=7.5)
E3M2 = Elem(mbits=2, emin=-2, emax=4, max_normal=28.0)
E2M1 = Elem(mbits=1, emin=0, emax=2, max_normal=6.0)
INT8 = Elem(mbits=6, emin=0, emax=0, max_normal=127 / 64)

FORMATS: dict[str, Format] = {
    "mxfp8_e4m3": Format("mx", 8, E4M3),
    "mxfp8_e5m2": Format("mx", 8, E5M2),
    "mxfp6_e2m3": Format("mx", 6, E2M3),
    "mxfp6_e3m2": Format("mx", 6, E3M2),
    "mxfp4": Format("mx", 4, E2M1),
    "mxint8": Format("mx", 8, INT8),
    "fp8_e4m3": Format("tensor", 8, E4M3),
    "fp8_e5m2": Format("tensor", 8, E5M2),
    "bf16": Format("cast", 16, dtype=torch.bfloat16),
    "fp16": Format("cast", 16, dtype=torch.float16),
}
assert set(FORMATS) == set(get_args(FormatName))


def round_to_elem(v: Tensor, elem: Elem) -> Tensor:
    """Round every value of ``v`` (any shape, float32/64) to the nearest value of ``elem``, ties to
    even mantissa, saturating at +-max_normal (Inf included); NaN stays NaN. Exact in v's dtype:
    the quantum is a power of two, so the division and product below do not round."""
    a = v.abs()
    # floor(log2 a) from the binary exponent (frexp: a = m * 2^e, m in [0.5, 1)); below emin the
    # grid is the subnormals' uniform one.
    e = (torch.frexp(a).exponent - 1).clamp(min=elem.emin)
    quantum = torch.ldexp(torch.ones_like(a), e - elem.mbits)
    q = torch.round(a / quantum) * quantum  # torch.round is round-half-to-even
    return torch.copysign(q.clamp(max=elem.max_normal), v)


def mx_encode(x: Tensor, elem: Elem, block: int = 32) -> tuple[Tensor, Tensor]:
    """MX encoding of x (..., K) in blocks of ``block`` along K: scales (..., ceil(K/block), 1), powers
    of two (NaN for a block holding NaN or Inf), and elements (..., ceil(K/block), block), values of
    ``elem``; a last partial block is zero-padded, which leaves its amax unchanged. Both float64:
    every scaled and dequantized fp32 value is exact there, the 2^-127 scale (an fp32 subnormal) included."""
    xd = F.pad(x.double(), (0, (-x.shape[-1]) % block)).unflatten(-1, (-1, block))
    amax = xd.abs().amax(-1, keepdim=True)  # NaN if the block has one
    shared = (torch.frexp(amax).exponent - 1 - elem.emax).clamp(_E8M0_MIN, _E8M0_MAX)
    shared = torch.where(amax > 0, shared, _E8M0_MIN)
    scale = torch.ldexp(torch.ones_like(amax), shared)
    scale = torch.where(torch.isfinite(amax), scale, torch.nan)
    return scale, round_to_elem(xd / scale, elem)


def _mx(x: Tensor, elem: Elem, block: int) -> Tensor:
    """MX quantize-dequantize of x (..., K) along K."""
    scale, q = mx_encode(x, elem, block)
    return (q * scale).flatten(-2)[..., : x.shape[-1]].to(x.dtype)


def _per_tensor(x: Tensor, elem: Elem) -> Tensor:
    """FP8 with one fp32 scale amax / max_normal for the whole tensor (1 for an all-zero or empty tensor,
    and for one so tiny that the scale underflows to 0, whose zeros would be 0/0 = NaN: it flushes to 0)."""
    xf = x.float()
    amax = xf.abs().amax() if xf.numel() else xf.new_zeros(())  # amax() of no elements raises
    scale = amax / elem.max_normal
    scale = torch.where(scale > 0, scale, 1.0)
    scale = torch.where(torch.isfinite(amax), scale, torch.nan)
    return (round_to_elem(xf / scale, elem) * scale).to(x.dtype)


def fake_quant(x: Tensor, fmt: str, block: int = 32) -> Tensor:
    """Quantize-dequantize ``x`` (..., K) to format ``fmt`` (MX blocks run along the last dim K);
    same shape and dtype as ``x``."""
    f = FORMATS[fmt]
    if f.kind == "cast":
        return x.to(f.dtype).to(x.dtype)
    assert f.elem is not None  # every per-tensor and MX format has an element type
    if f.kind == "tensor":
        return _per_tensor(x, f.elem)
    return _mx(x, f.elem, block)


class _FakeQuantSTE(torch.autograd.Function):
    """fake_quant forward, identity backward (straight-through estimator)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, fmt: str, block: int) -> Tensor:
        return fake_quant(x, fmt, block)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        return g, None, None


class _GradQuant(torch.autograd.Function):
    """Identity forward; backward fake-quantizes the incoming gradient (..., N) along its last dim."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, fmt: str, block: int) -> Tensor:
        ctx.fmt, ctx.block = fmt, block
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        return fake_quant(g, ctx.fmt, ctx.block), None, None


class QuantLinear(nn.Linear):
    """An ``nn.Linear`` whose GEMM inputs are lowered to ``fmt``: (..., in) -> (..., out).

    y = fq(x) @ fq(W).T + b, with fq quantizing along the input features (the reduction dim) and
    straight-through gradients; the bias stays fp32 (it is an add, not a GEMM input). With
    ``gradients`` the output gradient dL/dy is fake-quantized too, along the output features, before
    both backward GEMMs use it. The backward GEMMs take the forward's fq(x) and fq(W), blocked along
    the input features: MX training as in Microsoft's microxcaling reference instead re-blocks each
    backward operand along that GEMM's own reduction dim (W along the outputs for dL/dx; dL/dy and x
    along the batch for dL/dW), so this emulates the forward GEMM exactly and the backward ones
    approximately. It holds the wrapped layer's own ``weight`` and ``bias`` Parameters
    under the same names, so state_dict keys, checkpoints and optimizers see no change; it stays an
    ``nn.Linear`` so every ``isinstance(m, nn.Linear)`` (FLOP counts, init) still finds it."""

    def __init__(self, linear: nn.Linear, fmt: FormatName, gradients: bool = False, block: int = 32) -> None:
        # meta: allocate nothing; the wrapped layer's Parameters replace these.
        super().__init__(linear.in_features, linear.out_features, linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        self.fmt, self.gradients, self.block = fmt, gradients, block

    def forward(self, x: Tensor) -> Tensor:
        xq = _FakeQuantSTE.apply(x, self.fmt, self.block)
        wq = _FakeQuantSTE.apply(self.weight, self.fmt, self.block)  # (out, in): blocks along in
        y = F.linear(xq, wq, self.bias)
        return _GradQuant.apply(y, self.fmt, self.block) if self.gradients else y

    def flops_per_example(self) -> int:
        return linear_flops(self)

    def to_linear(self) -> nn.Linear:
        """The plain layer again, holding the same Parameters."""
        lin = nn.Linear(self.in_features, self.out_features, self.bias is not None, device="meta")
        lin.weight, lin.bias = self.weight, self.bias
        return lin

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fmt={self.fmt}" + (", gradients=True" if self.gradients else "")


class QuantConfig(Settings):
    """``model.quant``: which linear layers compute in which format.

    A layer named in ``layers`` (its dotted module name in the model, e.g. ``interaction.mlp.0``)
    gets that format; any other ``nn.Linear`` whose name matches a ``where`` pattern (fnmatch) gets
    ``format``. ``recscale precision probe`` writes ``layers``."""

    format: FormatName | None = None
    where: list[str] = ["*"]
    layers: dict[str, FormatName] = {}
    gradients: bool = False  # also fake-quantize each layer's output gradient in backward

    @model_validator(mode="after")
    def _where_needs_format(self) -> QuantConfig:
        # Either way no layer would be lowered by ``where``, and the run would train in fp32 unsaid.
        if self.format is None and self.where != ["*"]:
            raise ValueError(
                f"where {self.where} selects the layers that compute in format, and format is not set; "
                f"give model.quant.format ({', '.join(get_args(FormatName)[:3])}, ...)"
            )
        if self.gradients and self.format is None and not self.layers:
            raise ValueError(
                "gradients quantizes the output gradients of the lowered layers, and neither format nor layers "
                "lowers any; give model.quant.format (or layers) or drop gradients"
            )
        if self.format is not None and not self.where:
            raise ValueError(
                f"where is empty, so no layer would compute in {self.format}; give patterns of layer names "
                "(['*'] for every linear layer)"
            )
        return self


def linear_names(model: nn.Module) -> list[str]:
    """Dotted names of the model's ``nn.Linear`` layers (lowered or not), in module order."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def quantize_model(model: nn.Module, cfg: QuantConfig | None) -> list[str]:
    """Swap the ``nn.Linear`` layers ``cfg`` selects for ``QuantLinear`` in place; their dotted names.

    A name in ``cfg.layers`` that is no linear layer of the model (a plan written for another
    model), or a ``where`` pattern other than "*" that matches none, is a ``ConfigError``. Layers
    already lowered are left as they are."""
    if cfg is None:
        return []
    every = linear_names(model)
    unknown = sorted(set(cfg.layers) - set(every))
    if unknown:
        raise ConfigError(
            f"model.quant.layers: {', '.join(unknown[:4])} is no linear layer of this model; "
            f"its linear layers are {', '.join(every[:8])}{' ...' if len(every) > 8 else ''}"
        )
    idle = [p for p in cfg.where if p != "*" and not any(fnmatch.fnmatchcase(n, p) for n in every)]
    if cfg.format is not None and idle:
        raise ConfigError(
            f"model.quant.where: {', '.join(idle)} matches no linear layer; they are {', '.join(every[:8])}"
        )
    done = []
    for name in (n for n in every if not isinstance(model.get_submodule(n), QuantLinear)):
        fmt = cfg.layers.get(name)
        if fmt is None and cfg.format is not None and any(fnmatch.fnmatchcase(name, p) for p in cfg.where):
            fmt = cfg.format
        if fmt is not None:
            linear = cast(nn.Linear, model.get_submodule(name))  # a name from linear_names()
            model.set_submodule(name, QuantLinear(linear, fmt, cfg.gradients))
            done.append(name)
    return done


def dequantize_model(model: nn.Module) -> list[str]:
    """Swap every ``QuantLinear`` back for a plain ``nn.Linear`` (same Parameters); their names."""
    names = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    for name in names:
        model.set_submodule(name, cast(QuantLinear, model.get_submodule(name)).to_linear())
    return names


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, ...) float -> codes int8 of the same shape, scales (N,) fp32, rows ~= codes * scales: symmetric
    per-row int8, each row's largest magnitude -> 127 (retrieval's int8 index, exported int8 weights)."""
    flat = rows.float().reshape(rows.shape[0], -1)
    scales = flat.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    codes = torch.round(flat / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return codes.reshape(rows.shape), scales
