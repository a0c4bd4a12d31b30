"""Row-wise FP8 for TorchRec's embedding collectives, in plain torch: fbgemm 1.8's FP8 codec runs on CUDA only.

Layout (fbgemm's row-wise one, so TorchRec sizes the buffers as it does for fbgemm's codecs): the flat
input is cut into rows of ``row_dim`` floats; each row becomes ``row_dim`` FP8 bytes (padded to a multiple
of 4) followed by 8 bytes, the first 4 the row's fp32 scale. A row is scaled so its largest magnitude is
the format's largest finite value, cast with round-to-nearest-even, and multiplied back by the scale on
decode. Forward (pooled embeddings) uses E4M3 (more mantissa); backward (their gradients) E5M2 (more
range). A sum cannot be taken over FP8 bytes, and TorchRec's reduce-scatter backward takes no row-wise
codec: row-wise tables' collectives stay fp16 (``sharding.qcomm_sharders``).
"""

from __future__ import annotations

import torch
from fbgemm_gpu.quantize_comm import QuantizationContext, QuantizedCommCodec
from fbgemm_gpu.split_embedding_configs import SparseType

ROW_DIM = 32


class RowwiseFP8Codec(QuantizedCommCodec):
    """TorchRec ``QuantizedCommCodec``: fp32 (N,) -> uint8 (N / row_dim * (ceil4(row_dim) + 8),) and back."""

    def __init__(self, is_fwd: bool, row_dim: int = ROW_DIM) -> None:
        super().__init__(SparseType.FP8, row_dim=row_dim, is_fwd=is_fwd)
        self.format = torch.float8_e4m3fn if is_fwd else torch.float8_e5m2
        self.max = torch.finfo(self.format).max

    @staticmethod
    def _width(row_dim: int) -> int:
        return (row_dim + 3) // 4 * 4

    def encode(self, input_tensor: torch.Tensor, ctx: QuantizationContext | None = None) -> torch.Tensor:
        ctx = ctx or self.create_context()
        assert ctx is not None
        rows = input_tensor.float().reshape(-1, ctx.row_dim)
        amax = rows.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax / self.max, torch.ones_like(amax))  # (n, 1) float32
        width = self._width(ctx.row_dim)
        out = torch.zeros(rows.shape[0], width + 8, dtype=torch.uint8, device=rows.device)
        out[:, : ctx.row_dim] = (rows / scale).clamp(-self.max, self.max).to(self.format).view(torch.uint8)
        out[:, width : width + 4] = scale.view(torch.uint8)
        ctx.row_dim_quant = width + 8
        return out.view(-1)

    def decode(self, input_tensor: torch.Tensor, ctx: QuantizationContext | None = None) -> torch.Tensor:
        ctx = ctx or self.create_context()
        assert ctx is not None
        width = self._width(ctx.row_dim)
        rows = input_tensor.view(-1, width + 8)
        values = rows[:, : ctx.row_dim].contiguous().view(self.format).float()
        scale = rows[:, width : width + 4].contiguous().view(torch.float32)
        return (values * scale).view(-1)

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
        row_dim = qcomm_ctx.row_dim
        pads = [(row_dim - d % row_dim) % row_dim for d in dim_per_rank]
        qcomm_ctx.padded_dim_sum_per_rank = [d + p for d, p in zip(dim_per_rank, pads, strict=True)]
        return dim_per_rank[my_rank] + pads[my_rank], pads[my_rank]
