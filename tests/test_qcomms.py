"""Quantized collectives (``distributed.qcomms``): recscale's row-wise FP8 and MXINT8 codecs, unit by unit. The bytes
and training of two ranks with and without qcomms (fbgemm's codecs and this one) are checked in
tests/test_distributed.py, whose 2-rank launch trains them
(``test_quantized_all_to_all_and_all_reduce_send_fewer_bytes_and_train_alike``)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from recscale.distributed.codecs import MXInt8Codec, RowwiseFP8Codec


def _roundtrip(codec: RowwiseFP8Codec | MXInt8Codec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ctx = codec.create_context()
    q = codec.encode(x, ctx)
    assert q.dtype == codec.quantized_dtype == torch.uint8
    assert q.numel() == codec.calc_quantized_size(x.numel(), ctx)  # the size TorchRec allocates
    return q, codec.decode(q, ctx)


def test_layout_is_fp8_bytes_then_the_row_scale():
    """A row whose largest magnitude is E4M3's largest finite value (448) is scaled by 1: its FP8 bytes
    are the plain casts, and the scale field holds 1.0."""
    row = torch.tensor([448.0, -448.0, 1.0, 0.5, 3.0, -2.0, 0.0, 240.0] * 4)
    q, back = _roundtrip(RowwiseFP8Codec(is_fwd=True), row)
    q = q.view(1, 40)
    assert torch.equal(q[0, :32], row.to(torch.float8_e4m3fn).view(torch.uint8))
    assert q[0, 32:36].view(torch.float32).item() == 1.0
    assert torch.equal(back, row)  # every value is exactly representable


def test_rounding_is_to_nearest_even_and_saturates_at_the_row_max():
    # Scale 1 again (448 in the row). Between 16 and 18 (E4M3 step 2 there) 17 is a tie: to even, 16;
    # 17.5 rounds up to 18. 9.5 lies between 9 and 10 (step 1 below 16): a tie, to even 10.
    row = torch.tensor([448.0, 17.0, 17.5, 9.5] + [0.0] * 28)
    _, back = _roundtrip(RowwiseFP8Codec(is_fwd=True), row)
    assert back[:4].tolist() == [448.0, 16.0, 18.0, 10.0]


@pytest.mark.parametrize(("is_fwd", "step"), [(True, 2**-3), (False, 2**-2)])
def test_relative_error_within_half_a_step_of_each_row(is_fwd, step):
    """E4M3 (forward) has 3 mantissa bits, E5M2 (backward) 2: each value is within half a step of its own
    magnitude, whatever the row's scale (rows from 1e-6 to 1e2), values in the normal range."""
    torch.manual_seed(0)
    scales = torch.logspace(-6, 2, 8).repeat_interleave(32)
    x = (torch.rand(256) * 0.9 + 0.1) * torch.where(torch.rand(256) < 0.5, -1.0, 1.0) * scales
    _, back = _roundtrip(RowwiseFP8Codec(is_fwd=is_fwd), x)
    assert ((back - x).abs() <= x.abs() * step / 2 * 1.0001).all()


def test_zero_rows_decode_to_zero():
    _, back = _roundtrip(RowwiseFP8Codec(is_fwd=True), torch.zeros(64))
    assert torch.equal(back, torch.zeros(64))


@pytest.mark.parametrize("is_fwd", [True, False])
def test_rows_too_small_for_a_scale_decode_to_zero_not_nan(is_fwd):
    """A row of subnormal values (a gradient that has all but vanished) has an fp32 scale amax / 448 (or
    / 57344) that underflows to 0: its zeros decoded as 0/0 = NaN, which training then spread."""
    x = torch.zeros(64)
    x[:3] = torch.tensor([1e-43, -5e-44, 0.0])
    x[32] = 1.0
    _, back = _roundtrip(RowwiseFP8Codec(is_fwd=is_fwd), x)
    assert torch.equal(back[:32], torch.zeros(32)) and back[32] == 1.0 and not back.isnan().any()


def test_padding_makes_each_ranks_width_a_whole_number_of_rows():
    codec = RowwiseFP8Codec(is_fwd=True)
    ctx = codec.create_context()
    assert codec.padded_size(torch.zeros(3, 40), [40, 24], 0, ctx) == (64, 24)
    assert ctx.padded_dim_sum_per_rank == [64, 32]
    assert codec.padded_size(torch.zeros(3, 24), [40, 24], 1, ctx) == (32, 8)


def test_mxint8_layout_is_32_int8_codes_then_the_e8m0_scale():
    """OCP MX v1.0 by hand. Row 1: amax 1.0 -> shared scale 2^(floor(log2 1) - 0) = 1, E8M0 byte 127;
    codes are x * 64 rounded half to even: 1 -> 64, -0.5 -> -32, 1/128 -> 0.5 -> 0, 3/128 -> 1.5 -> 2,
    127.9/64 -> 127.9 -> 128, saturated to 127. Row 2: amax 3 -> scale 2^1, byte 128; 3 -> 1.5 * 64 = 96."""
    row1 = torch.tensor([1.0, -0.5, 1 / 128, 3 / 128, 127.9 / 64] + [0.0] * 27)
    row2 = torch.tensor([3.0, -1.0] + [0.0] * 30)
    q, back = _roundtrip(MXInt8Codec(is_fwd=True), torch.cat([row1, row2]))
    q = q.view(2, 33)
    assert q[0, :5].view(torch.int8).tolist() == [64, -32, 0, 2, 127]
    assert q[1, :2].view(torch.int8).tolist() == [96, -32]
    assert q[:, 32].tolist() == [127, 128]
    assert back[:5].tolist() == [1.0, -0.5, 0.0, 2 / 64, 127 / 64]
    assert back[32:34].tolist() == [3.0, -1.0]


def test_mxint8_handles_zero_tiny_and_nan_rows():
    """An all-zero row gets the smallest scale 2^-127 (byte 0) and decodes to zeros; a row far below
    fp32's normal range keeps its relative precision; a row with NaN decodes to all NaN (scale byte 0xFF)."""
    x = torch.cat([torch.zeros(32), torch.full((32,), 3e-39), torch.tensor([float("nan")] + [1.0] * 31)])
    q, back = _roundtrip(MXInt8Codec(is_fwd=False), x)
    assert q.view(3, 33)[:, 32].tolist() == [0, 0, 255]
    assert torch.equal(back[:32], torch.zeros(32))
    assert ((back[32:64] - 3e-39).abs() <= 3e-39 / 64).all()
    assert back[64:].isnan().all()


def test_mxint8_matches_the_gemm_emulation_and_sends_33_bytes_per_32_values():
    """The wire format decodes to exactly what ``model.quant``'s MXINT8 fake-quantization gives."""
    from recscale.models.quant import fake_quant

    torch.manual_seed(0)
    x = torch.randn(64 * 32) * torch.logspace(-6, 2, 64).repeat_interleave(32)
    q, back = _roundtrip(MXInt8Codec(is_fwd=True), x)
    assert q.numel() == 64 * 33
    assert torch.equal(back, fake_quant(x.view(64, 32), "mxint8").view(-1))


def test_mxint8_forward_rows_shrink_to_a_block_dividing_every_width_instead_of_padding():
    codec = MXInt8Codec(is_fwd=True)
    ctx = codec.create_context()
    assert codec.padded_size(torch.zeros(3, 80), [80, 48], 0, ctx) == (80, 0)  # d = 16 tables: blocks of 16
    assert ctx.row_dim == 16 and ctx.padded_dim_sum_per_rank == [80, 48]
    assert codec.calc_quantized_size(3 * 80, ctx) == 15 * 17
    ctx = codec.create_context()
    assert codec.padded_size(torch.zeros(3, 36), [36, 64], 0, ctx) == (64, 28)  # gcd 4: pad to 32 instead
    assert ctx.row_dim == 32


@pytest.mark.parametrize(("forward", "backward"), [("int8", "mx4"), ("fp32", "int8"), ("fp8", "fp16")])
def test_row_wise_reduce_scatter_stays_fp16_for_every_row_wise_format(forward, backward):
    """fbgemm's int8 / mx4 codecs were left on the reduce-scatter of row-wise tables, which TorchRec cannot
    run them on: `distributed.sharding=row_wise distributed.qcomms.forward=int8` on 2 ranks stopped with an
    internal AssertionError. The reduce-scatter gets fp16 for every row-wise format; all-to-alls keep theirs."""
    from recscale.config import DistributedConfig
    from recscale.distributed.sharding import qcomm_sharders

    cfg = DistributedConfig.model_validate({"qcomms": {"forward": forward, "backward": backward}})
    sharders = qcomm_sharders(cfg, torch.device("cpu"))
    assert sharders is not None
    codecs = sharders[0].qcomm_codecs_registry
    assert codecs is not None
    dtype = {"fp32": torch.float32, "fp16": torch.float16}
    scatter = codecs["POOLED_EMBEDDINGS_REDUCE_SCATTER"]
    assert (scatter.forward.quantized_dtype, scatter.backward.quantized_dtype) == tuple(
        dtype.get(p, torch.float16) for p in (forward, backward)
    )
    a2a = codecs["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    assert (a2a.forward.quantized_dtype, a2a.backward.quantized_dtype) == tuple(
        dtype.get(p, torch.uint8) for p in (forward, backward)
    )


def test_qcomms_on_replicated_tables_are_refused():
    """data_parallel tables send no embeddings: qcomms.forward=int8 was dropped without a word."""
    from recscale.config import DistributedConfig

    with pytest.raises(ValidationError, match="data_parallel tables do not send"):
        DistributedConfig.model_validate({"sharding": "data_parallel", "qcomms": {"forward": "int8"}})
    # tables: every one planned data_parallel too; one sharded sends them
    replicated = {"sharding": "data_parallel", "tables": {"user": {"type": "data_parallel"}}}
    with pytest.raises(ValidationError, match="data_parallel tables do not send"):
        DistributedConfig.model_validate(replicated | {"qcomms": {"forward": "fp8"}})
    sharded = {"sharding": "data_parallel", "tables": {"user": {"type": "table_wise"}}}
    DistributedConfig.model_validate(sharded | {"qcomms": {"forward": "fp8"}})
    DistributedConfig.model_validate(
        {"sharding": "data_parallel", "qcomms": {"dense": "fp16"}}
    )  # DDP's, kept
