"""recscale's own codecs for TorchRec's embedding collectives, in plain torch, where fbgemm 1.8 has none
that runs on CPU or none this compact.

Both cut the flat input into rows of ``row_dim`` (32) floats; each rank's embedding width is padded to a
whole number of rows (``padded_size``), so any batch size cuts into whole rows. MXINT8 first shortens the
forward rows to a block that divides every rank's width (``forward_row_dim``), so d = 16 tables need no
padding.

``RowwiseFP8Codec`` (``fp8``; fbgemm's FP8 codec is CUDA-only): fbgemm's row-wise layout, so TorchRec
sizes the buffers as it does for fbgemm's codecs: each row becomes ``row_dim`` FP8 bytes (padded to a
multiple of 4) followed by 8 bytes, the first 4 the row's fp32 scale. A row is scaled so its largest
magnitude is the format's largest finite value, cast with round-to-nearest-even, and multiplied back by
the scale on decode. Forward (pooled embeddings) uses E4M3 (more mantissa); backward (their gradients)
E5M2 (more range). 40 bytes per 32 floats: ÷3.2.

``MXInt8Codec`` (``mxint8``): OCP MX v1.0's MXINT8 with the row as the block: ``row_dim`` int8 elements
k (value k/64, k in [-127, 127]) then one E8M0 byte, the shared power-of-two scale (bias 127; 0xFF is NaN),
chosen and rounded as ``models.quant.mx_encode`` does. 33 bytes per 32 floats: ÷3.88 (17 per 16: ÷3.76),
where fbgemm's int8 rows (8 bytes of fp32 scale and bias each) give ÷3.2. A 16-float block is smaller
than the spec's 32: finer scales, same element format. One scale per row costs at most one bit against
int8 with an exact scale.

A sum cannot be taken over encoded bytes, and TorchRec's reduce-scatter backward takes no row-wise codec:
row-wise tables' collectives stay fp16 (``sharding.qcomm_sharders``).
"""

from __future__ import annotations

import math

import torch
from fbgemm_gpu.quantize_comm import QuantizationContext, QuantizedCommCodec
from fbgemm_gpu.split_embedding_configs import SparseType

from recscale.models.quant import INT8, mx_encode

ROW_DIM = 32
_E8M0_BIAS, _E8M0_NAN = 127, 255


class _RowwiseCodec(QuantizedCommCodec):
    """Rows of ``row_dim`` floats, each encoded into ``row_bytes(row_dim)`` uint8s (subclasses say how)."""

    def row_bytes(self, row_dim: int) -> int:
        raise NotImplementedError

    def encode_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """(n, row_dim) float32 -> (n, row_bytes) uint8."""
        raise NotImplementedError

    def decode_rows(self, rows: torch.Tensor, row_dim: int) -> torch.Tensor:
        """(n, row_bytes) uint8 -> (n, row_dim) float32."""
        raise NotImplementedError

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.uint8

    def create_context(self) -> QuantizationContext:
        return QuantizationContext(self._row_dim)

    def calc_quantized_size(self, input_len: int, ctx: QuantizationContext | None = None) -> int:
        row_dim = (ctx or self.create_context()).row_dim
        assert input_len % row_dim == 0, f"input length {input_len} is not a multiple of row_dim {row_dim}"
        return input_len // row_dim * self.row_bytes(row_dim)

    def encode(self, input_tensor: torch.Tensor, ctx: QuantizationContext | None = None) -> torch.Tensor:
        ctx = ctx or self.create_context()
        out = self.encode_rows(input_tensor.float().reshape(-1, ctx.row_dim))
        ctx.row_dim_quant = out.shape[1]
        return out.view(-1)

    def decode(self, input_tensor: torch.Tensor, ctx: QuantizationContext | None = None) -> torch.Tensor:
        ctx = ctx or self.create_context()
        rows = input_tensor.view(-1, self.row_bytes(ctx.row_dim))
        return self.decode_rows(rows, ctx.row_dim).view(-1)

    def forward_row_dim(self, dim_per_rank: list[int], row_dim: int) -> int:
        """The row length of a pooled all-to-all whose ranks' embedding widths are ``dim_per_rank``
        (every rank computes the same, so senders and receivers agree): ``row_dim``, padding included."""
        return row_dim

    def padded_size(
        self,
        input_tensor: torch.Tensor,
        dim_per_rank: list[int],
        my_rank: int,
        qcomm_ctx: QuantizationContext,
    ) -> tuple[int, int]:
        """Pad each rank's embedding width to a multiple of ``row_dim`` (fbgemm does it only behind an
        environment variable), so any batch size cuts into whole rows."""
        if input_tensor.ndim == 1:
            return input_tensor.shape[0], 0
        row_dim = qcomm_ctx.row_dim = self.forward_row_dim(dim_per_rank, qcomm_ctx.row_dim)
        pads = [(row_dim - d % row_dim) % row_dim for d in dim_per_rank]
        qcomm_ctx.padded_dim_sum_per_rank = [d + p for d, p in zip(dim_per_rank, pads, strict=True)]
        return dim_per_rank[my_rank] + pads[my_rank], pads[my_rank]


class RowwiseFP8Codec(_RowwiseCodec):
    """fp32 (N,) -> uint8 (N / row_dim * (ceil4(row_dim) + 8),) and back."""

    def __init__(self, is_fwd: bool, row_dim: int = ROW_DIM) -> None:
        super().__init__(SparseType.FP8, is_fwd=is_fwd, row_dim=row_dim)
        self.format = torch.float8_e4m3fn if is_fwd else torch.float8_e5m2
        self.max = torch.finfo(self.format).max

    def row_bytes(self, row_dim: int) -> int:
        return (row_dim + 3) // 4 * 4 + 8

    def encode_rows(self, rows: torch.Tensor) -> torch.Tensor:
        amax = rows.abs().amax(dim=1, keepdim=True)
        # A product, not amax / max: torch's CPU kernel divides by a scalar through its reciprocal and CUDA
        # does not, so the quotient's last bit differed between devices (seen on an H200).
        scale = amax * (1.0 / self.max)
        # A row of values so tiny (subnormal) that its scale underflows to 0 would decode its zeros as
        # 0/0 = NaN: scale 1 instead flushes it to zero, as it does an all-zero row. (n, 1) float32.
        scale = torch.where(scale > 0, scale, torch.ones_like(amax))
        row_dim = rows.shape[1]
        width = self.row_bytes(row_dim) - 8
        out = torch.zeros(rows.shape[0], width + 8, dtype=torch.uint8, device=rows.device)
        out[:, :row_dim] = (rows / scale).clamp(-self.max, self.max).to(self.format).view(torch.uint8)
        out[:, width : width + 4] = scale.view(torch.uint8)
        return out

    def decode_rows(self, rows: torch.Tensor, row_dim: int) -> torch.Tensor:
        width = self.row_bytes(row_dim) - 8
        values = rows[:, :row_dim].contiguous().view(self.format).float()
        scale = rows[:, width : width + 4].contiguous().view(torch.float32)
        return values * scale


class MXInt8Codec(_RowwiseCodec):
    """fp32 (N,) -> uint8 (N / row_dim * (row_dim + 1),) and back: MXINT8 blocks of one row each."""

    def __init__(self, is_fwd: bool, row_dim: int = ROW_DIM) -> None:
        super().__init__(SparseType.INT8, is_fwd=is_fwd, row_dim=row_dim)

    def row_bytes(self, row_dim: int) -> int:
        return row_dim + 1

    def forward_row_dim(self, dim_per_rank: list[int], row_dim: int) -> int:
        """The largest block, up to ``row_dim``, that divides every rank's width (16 for d = 16 tables,
        17 bytes per 16 floats, ÷3.76) rather than padding each rank to 32; below 8, padding costs less."""
        block = math.gcd(row_dim, *dim_per_rank)
        return block if block >= 8 else row_dim

    def encode_rows(self, rows: torch.Tensor) -> torch.Tensor:
        scale, q = mx_encode(rows, INT8, block=rows.shape[1])  # (n, 1, 1), (n, 1, row_dim) float64
        out = torch.empty(rows.shape[0], rows.shape[1] + 1, dtype=torch.uint8, device=rows.device)
        codes = torch.nan_to_num(q.squeeze(1) * 64, nan=0.0)
        out[:, :-1] = codes.to(torch.int8).view(torch.uint8)
        exponent = torch.frexp(scale.view(-1, 1)).exponent - 1 + _E8M0_BIAS
        out[:, -1:] = torch.where(scale.view(-1, 1).isnan(), _E8M0_NAN, exponent).to(torch.uint8)
        return out

    def decode_rows(self, rows: torch.Tensor, row_dim: int) -> torch.Tensor:
        codes = rows[:, :row_dim].contiguous().view(torch.int8).double()
        byte = rows[:, row_dim:].long()
        scale = torch.ldexp(torch.ones_like(codes[:, :1]), byte - _E8M0_BIAS - 6)  # k/64 * 2^(e - 127)
        return (codes * torch.where(byte == _E8M0_NAN, torch.nan, scale)).float()
