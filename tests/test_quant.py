"""MX / FP8 emulation (recscale.models.quant) against hand-computed OCP MX v1.0 examples, torch's own
FP8 casts and, where it imports, torchao's MX reference; QuantLinear and model.quant."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recscale.config import load_config
from recscale.errors import ConfigError
from recscale.models import EmbeddingConfig, FeatureSet, SparseInput, build_model
from recscale.models.quant import (
    E2M1,
    E2M3,
    E3M2,
    E4M3,
    E5M2,
    FORMATS,
    INT8,
    QuantConfig,
    QuantLinear,
    dequantize_model,
    fake_quant,
    linear_names,
    mx_encode,
    quantize_model,
    round_to_elem,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
nan, inf = math.nan, math.inf


def block(*head: float, fill: float = 0.0, n: int = 32) -> torch.Tensor:
    """One MX block (32,): ``head`` then ``fill``."""
    return torch.tensor([*head, *[fill] * (n - len(head))])


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().view(torch.int32)


# ---------------------------------------------------------------------------------------- elements


@pytest.mark.parametrize(("elem", "dtype"), [(E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)])
def test_minifloat_rounding_is_bit_exact_against_torch_casts(elem, dtype) -> None:
    """round_to_elem == torch's cast (saturated by clamping first) on random values over the whole
    range, every representable value, every midpoint between neighbours (RNE ties), +-0, Inf."""
    gen = torch.Generator().manual_seed(0)
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[torch.isfinite(grid)].unique()  # sorted, -max..max
    mids = (grid[1:] + grid[:-1]) / 2  # exact in fp32: 4 mantissa bits at most
    rand = torch.randn(200_000, generator=gen) * torch.exp2(
        torch.randint(-24, 20, (200_000,), generator=gen).float()
    )
    edges = torch.tensor(
        [0.0, -0.0, 1e-30, -1e-30, 1e30, inf, -inf, elem.max_normal * 1.04, elem.max_normal * 1.07]
    )
    x = torch.cat([rand, grid, mids, mids + mids.abs() * 2**-20, mids - mids.abs() * 2**-20, edges])
    ref = x.clamp(-elem.max_normal, elem.max_normal).to(dtype).float()
    assert torch.equal(bits(round_to_elem(x, elem)), bits(ref))  # -0.0 kept too
    assert round_to_elem(torch.tensor([nan]), elem).isnan().all()


def test_e2m1_ties_round_to_even_mantissa() -> None:
    # E2M1 values: 0 0.5 1 1.5 2 3 4 6; halfway points go to the neighbour with an even mantissa.
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -2.5, -5.0, 7.0, 100.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -2.0, -4.0, 6.0, 6.0])
    assert torch.equal(round_to_elem(x, E2M1), want)
    # the same inside an MX block whose amax 6 gives scale 2^(2 - 2) = 1
    assert torch.equal(fake_quant(block(6.0, *x[:9].tolist()), "mxfp4")[1:10], want[:9])


def test_fp6_grids() -> None:
    # E2M3: quantum 1/8 below 2, 1/4 in [2, 4), 1/2 in [4, 7.5]; E3M2: subnormal quantum 1/16, max 28.
    e2m3 = round_to_elem(torch.tensor([0.0625, 0.1875, 2.125, 4.25, 4.75, 9.0]), E2M3)
    assert e2m3.tolist() == [0.0, 0.25, 2.0, 4.0, 5.0, 7.5]
    e3m2 = round_to_elem(torch.tensor([0.03125, 0.09375, 0.3, 27.0, 30.0]), E3M2)
    assert e3m2.tolist() == [0.0, 0.125, 0.3125, 28.0, 28.0]


def spec_codes(ebits: int, mbits: int, bias: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every non-negative value of an FP element format decoded from its bit fields (exponent field 0:
    subnormal), ascending, and whether its code is odd; ebits=0 is fixed point (MXINT8: m * 2^-mbits)."""
    values, odd = [], []
    for e in range(2**ebits):
        for m in range(2**mbits):
            values.append((m / 2**mbits if e == 0 else 1 + m / 2**mbits) * 2.0 ** (max(e, 1) - bias))
            odd.append(m % 2 == 1)
    return torch.tensor(values, dtype=torch.float64), torch.tensor(odd)


# E4M3 and E5M2 are checked against torch's casts above. MXINT8 is 7 magnitude bits, k * 2^-7 * 2^(1 - 0) = k/64.
@pytest.mark.parametrize(
    ("elem", "fields"), [(E2M3, (2, 3, 1)), (E3M2, (3, 2, 3)), (E2M1, (2, 1, 1)), (INT8, (0, 7, 0))]
)
def test_fp6_fp4_int8_grids_match_the_spec_encodings(elem, fields) -> None:
    """Every value of the format's spec encoding rounds to itself, every midpoint between neighbours
    to the one with the even code, just off a midpoint to the nearer one; past the top it saturates."""
    values, odd = spec_codes(*fields)
    assert values[-1].item() == elem.max_normal
    lo, hi, mids = values[:-1], values[1:], (values[:-1] + values[1:]) / 2
    nudge = (hi - lo) * 2**-10
    x = torch.cat([values, mids, mids - nudge, mids + nudge, values[-1:] * 1.5])
    want = torch.cat([values, torch.where(odd[:-1], hi, lo), lo, hi, values[-1:]])
    assert torch.equal(round_to_elem(x, elem), want) and torch.equal(round_to_elem(-x, elem), -want)


# -------------------------------------------------------------------------------------- MX blocks


@pytest.mark.parametrize(
    ("fmt", "exp"),
    [("mxfp8_e4m3", -8), ("mxfp8_e5m2", -15), ("mxfp6_e2m3", -2), ("mxfp6_e3m2", -4), ("mxfp4", -2), ("mxint8", 0)],
)  # fmt: skip
def test_shared_scale_is_floor_log2_amax_minus_emax(fmt, exp) -> None:
    elem = FORMATS[fmt].elem
    for amax, shift in [(1.0, 0), (1.99, 0), (0.75, -1), (2.0, 1), (3.0 * 2**-20, -19)]:
        scale, _ = mx_encode(block(-amax, 0.1 * amax), elem)
        assert scale.item() == 2.0 ** (exp + shift), (fmt, amax)


def test_saturation_to_max_normal_times_scale() -> None:
    # amax 1.99: E4M3 scale 2^-8, 1.99 / 2^-8 = 509.4 > 448 -> 448 * 2^-8 = 1.75
    assert fake_quant(block(1.99, -1.99), "mxfp8_e4m3")[:2].tolist() == [1.75, -1.75]
    # amax 7.9: E2M1 scale 1, 7.9 -> 6; E2M3 scale 1 -> 7.5; E5M2 scale 2^-13, 7.9 * 2^13 -> 57344 * 2^-13 = 7
    assert fake_quant(block(7.9), "mxfp4")[0].item() == 6.0
    assert fake_quant(block(7.9), "mxfp6_e2m3")[0].item() == 7.5
    assert fake_quant(block(7.9), "mxfp8_e5m2")[0].item() == 7.0


def test_subnormal_elements() -> None:
    # amax 1 -> E4M3 scale 2^-8; the smallest subnormal element 2^-9 is 2^-17 after scaling.
    # 2^-18 and 3 * 2^-18 are ties (0.5 and 1.5 quanta): to 0 and 2 quanta, the even ones.
    x = block(1.0, 2**-17, 2**-18, 3 * 2**-18, 3 * 2**-19, 2**-19 * 1.01, -(2**-17))
    assert fake_quant(x, "mxfp8_e4m3")[:7].tolist() == [1.0, 2**-17, 0.0, 2**-16, 2**-17, 0.0, -(2**-17)]
    # E2M1 scale 2^-2 (amax 1): its one subnormal 0.5 is 2^-3 here; 2^-4 is a tie -> 0, 3 * 2^-4 -> 2^-2
    assert fake_quant(block(1.0, 2**-3, 2**-4, 3 * 2**-4), "mxfp4")[:4].tolist() == [1.0, 0.125, 0.0, 0.25]


def test_zero_block_and_tiny_blocks() -> None:
    x = torch.stack([block(), block(-0.0), block(1e-40, 3e-39), block(2.0**-140)])
    scale, _ = mx_encode(x, E4M3)
    assert scale[:, 0, 0].tolist() == [2.0**-127] * 4  # zeros, and blocks below E8M0's range, clamp to 2^-127
    y = fake_quant(x, "mxfp8_e4m3")
    assert torch.equal(y[:2], torch.zeros(2, 32)) and torch.equal(bits(y[1, :1]), bits(torch.tensor([-0.0])))
    # 1e-40 / 2^-127 = 0.0170 -> 9 * 2^-9 (E4M3 grid at 2^-6) -> 9 * 2^-136: the fp32 subnormal is kept exactly
    assert y[2, 0].item() == 9 * 2.0**-136
    assert y[3, 0].item() == 0.0  # 2^-140 / 2^-127 = 2^-13 < half E4M3's smallest subnormal 2^-9


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4", "mxint8"])
@pytest.mark.parametrize("bad", [nan, inf, -inf])
def test_nan_or_inf_makes_its_block_nan(fmt, bad) -> None:
    x = torch.stack([block(1.0, bad, 0.5), block(1.0, 0.5)]).reshape(1, 64)
    scale, _ = mx_encode(x, FORMATS[fmt].elem)
    y = fake_quant(x, fmt)
    assert scale[0, 0].isnan().all() and y[0, :32].isnan().all()  # spec: NaN scale, the block reads NaN
    assert torch.equal(y[0, 32:34], torch.tensor([1.0, 0.5]))  # the next block is untouched


def test_mxint8_values() -> None:
    # amax in [1, 2): scale 1, elements k/64 with k in [-127, 127], RNE on k.
    x = block(1.0, 0.3, -1.0, 1 / 128, 3 / 128, -0.3, 1e-3)
    assert fake_quant(x, "mxint8")[:7].tolist() == [1.0, 19 / 64, -1.0, 0.0, 2 / 64, -19 / 64, 0.0]
    assert fake_quant(block(1.99), "mxint8")[0].item() == 127 / 64  # 127.36 -> 127
    assert fake_quant(block(-1.999), "mxint8")[0].item() == -127 / 64  # -127.94 -> -128, saturated symmetric
    assert round_to_elem(torch.tensor([5.0, -5.0]), INT8).tolist() == [127 / 64, -127 / 64]
    x = block(3.0, 0.02)  # amax 3 -> scale 2, quantum 2/64
    assert fake_quant(x, "mxint8")[:2].tolist() == [3.0, 1 / 32]


def test_blocks_of_32_with_a_last_partial_block() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 77, generator=gen)
    x[:, 64:] *= 1e-3  # the partial block (13 elements) has its own, much smaller scale
    y = fake_quant(x, "mxfp4")
    assert y.shape == x.shape and y.dtype == x.dtype
    for lo, hi in [(0, 32), (32, 64), (64, 77)]:
        assert torch.equal(y[:, lo:hi], fake_quant(x[:, lo:hi], "mxfp4"))
    assert (y[:, 64:] != 0).any()  # one shared scale for 77 values would flush these to zero
    scale, q = mx_encode(x, E2M1)
    assert (
        scale.shape == (3, 3, 1) and q.shape == (3, 3, 32) and torch.equal(q[:, 2, 13:], torch.zeros(3, 19))
    )
    assert torch.equal(fake_quant(x, "mxfp4", block=16)[:, :16], fake_quant(x[:, :16], "mxfp4"))


def test_per_tensor_fp8_and_casts() -> None:
    x = torch.tensor([[3.0, -1.5], [0.01, 0.0]])
    scale = 3.0 / 448  # amax / max_normal
    want = round_to_elem(x / scale, E4M3) * scale
    assert torch.equal(fake_quant(x, "fp8_e4m3"), want) and fake_quant(x, "fp8_e4m3")[0, 0].item() == 3.0
    assert torch.equal(fake_quant(torch.zeros(4), "fp8_e5m2"), torch.zeros(4))
    assert fake_quant(torch.tensor([1.0, inf]), "fp8_e4m3").isnan().all()
    assert torch.equal(fake_quant(x, "bf16"), x.bfloat16().float())
    assert fake_quant(torch.tensor([1e5]), "fp16").isinf().all()  # a plain cast overflows
    assert fake_quant(x.bfloat16(), "mxfp8_e4m3").dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_per_tensor_fp8_of_tiny_and_empty_tensors(fmt) -> None:
    """A tensor of subnormal values has a scale amax / max_normal that underflows to 0 in fp32: its zeros
    came back NaN (0/0). An empty tensor (which MX formats and casts take) raised in amax()."""
    tiny = fake_quant(torch.tensor([1e-44, 0.0, -3e-45]), fmt)
    assert not tiny.isnan().any() and torch.equal(tiny.abs(), torch.zeros(3))
    assert fake_quant(torch.zeros(0, 16), fmt).shape == (0, 16)


def test_error_ordering_on_gaussian_data() -> None:
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    err = {f: ((fake_quant(x, f) - x).norm() / x.norm()).item() for f in FORMATS}
    assert err["bf16"] < err["mxint8"] < err["mxfp8_e4m3"] < err["mxfp8_e5m2"] < err["mxfp4"] < 0.2
    assert err["mxint8"] < err["mxfp6_e2m3"] < err["mxfp6_e3m2"] < err["mxfp4"]
    # The spec's floor scale puts a block's amax in [2^emax, 2^(emax+1)), and E4M3 saturates that binade
    # at 448 = 0.875 * 2^9 where E2M3 saturates at 7.5 = 0.9375 * 2^3: E4M3 clips block maxima more often,
    # so with the same 3 mantissa bits MXFP8 E4M3 is NOT more accurate than MXFP6 E2M3 on Gaussian blocks
    # (torchao's to_mx gives the same 0.0292 vs 0.0283); away from the block maxima its wider exponent wins.
    assert abs(err["mxfp8_e4m3"] / err["mxfp6_e2m3"] - 1) < 0.1
    xb = x.reshape(-1, 32)
    rest = xb.abs() < xb.abs().amax(-1, keepdim=True)
    err_rest = {f: ((fake_quant(xb, f) - xb)[rest].norm() / xb[rest].norm()).item() for f in FORMATS}
    assert err_rest["mxfp8_e4m3"] < err_rest["mxfp6_e2m3"] < err_rest["mxfp4"]


def test_against_torchao_mx_reference() -> None:
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    gen = torch.Generator().manual_seed(2)
    # Blocks of very different magnitudes; none so small that the scale reaches 2^-126, where torchao
    # clamps it (for Triton) to fp32's smallest normal instead of E8M0's 2^-127.
    x = torch.randn(64, 16, 32, generator=gen) * torch.exp2(
        torch.randint(-60, 60, (64, 16, 1), generator=gen).float()
    )
    x[0, 0] = 0.0
    grid = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6])
    x[1, :, :7] = (grid[1:] + grid[:-1]) / 2  # E2M1 ties at scale 1 (amax 6 in the block)
    x[1, :, 7] = 6.0
    x = x.reshape(64, 512)
    dtypes = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2, "mxfp6_e2m3": "fp6_e2m3",
              "mxfp6_e3m2": "fp6_e3m2", "mxfp4": torch.float4_e2m1fn_x2}  # fmt: skip
    for fmt, dtype in dtypes.items():
        scale, data = mx.to_mx(x, dtype, 32)
        assert torch.equal(fake_quant(x, fmt), mx.to_dtype(data, scale, dtype, 32, torch.float32)), fmt


# -------------------------------------------------------------------------------------- QuantLinear


def test_quant_linear_straight_through_gradients() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(40, 8)
    q = QuantLinear(lin, "mxfp4")
    x = torch.randn(5, 40, requires_grad=True)
    g = torch.randn(5, 8)
    q(x).backward(g)
    xq, wq = fake_quant(x.detach(), "mxfp4"), fake_quant(lin.weight.detach(), "mxfp4")
    assert torch.equal(q(x), F.linear(xq, wq, lin.bias))
    assert torch.allclose(x.grad, g @ wq)  # the fp32 input gradient, computed with the quantized weight
    assert torch.allclose(lin.weight.grad, g.T @ xq) and torch.allclose(lin.bias.grad, g.sum(0))
    # gradients=True: the output gradient is quantized (along the output features) before both GEMMs
    x.grad = None
    QuantLinear(lin, "mxfp4", gradients=True)(x).backward(g)
    assert torch.allclose(x.grad, fake_quant(g, "mxfp4") @ wq) and not torch.allclose(x.grad, g @ wq)


def test_quant_linear_keeps_parameters_and_flops() -> None:
    lin = nn.Linear(16, 4, bias=False)
    q = QuantLinear(lin, "mxfp8_e4m3")
    assert q.weight is lin.weight and q.bias is None and list(q.state_dict()) == ["weight"]
    assert q.flops_per_example() == 2 * 16 * 4 and isinstance(q, nn.Linear)
    q.load_state_dict(nn.Linear(16, 4, bias=False).state_dict())  # checkpoints of the plain layer load
    assert q.to_linear().weight is q.weight and "fmt=mxfp8_e4m3" in repr(q)


FEATURES = FeatureSet(sparse=(SparseInput("user", 50), SparseInput("item", 40)), num_dense=3)


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return build_model("dlrm", FEATURES, EmbeddingConfig(dim=8, dense_hidden=[8]), {"top_mlp": [16, 8]})


def tiny_batch(n: int = 64) -> tuple[torch.Tensor, KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.randint(0, 40, (n,), generator=gen), torch.randint(0, 40, (n,), generator=gen)])
    kjt = KeyedJaggedTensor.from_lengths_sync(["user", "item"], ids, torch.ones(2 * n, dtype=torch.long))
    return torch.randn(n, 3, generator=gen), kjt


def test_quantize_model_swaps_in_place() -> None:
    model = tiny_model()
    batch = tiny_batch()
    keys, flops, ref = list(model.state_dict()), model.flops_per_example(), model(*batch)
    names = linear_names(model)
    assert names == ["embedding.dense_mlp.0", "embedding.dense_mlp.2", "top_mlp.0", "top_mlp.2", "top_mlp.4"]
    cfg = QuantConfig(format="mxfp8_e4m3", where=["top_mlp.*"], layers={"embedding.dense_mlp.0": "mxfp4"})
    assert quantize_model(model, cfg) == ["embedding.dense_mlp.0", "top_mlp.0", "top_mlp.2", "top_mlp.4"]
    assert model.get_submodule("embedding.dense_mlp.0").fmt == "mxfp4"  # layers take precedence
    assert model.get_submodule("top_mlp.2").fmt == "mxfp8_e4m3"
    assert type(model.get_submodule("embedding.dense_mlp.2")) is nn.Linear
    assert list(model.state_dict()) == keys and model.flops_per_example() == flops
    low = model(*batch)
    assert not torch.equal(low, ref) and torch.allclose(low, ref, atol=0.2)
    low.sum().backward()  # trains through the swapped layers
    assert quantize_model(model, cfg) == []  # already lowered
    assert dequantize_model(model) == ["embedding.dense_mlp.0", "top_mlp.0", "top_mlp.2", "top_mlp.4"]
    assert torch.equal(model(*batch), ref)
    assert quantize_model(model, None) == [] and quantize_model(model, QuantConfig()) == []


def test_quantize_model_refuses_names_it_cannot_find() -> None:
    with pytest.raises(ConfigError, match=r"model.quant.layers: mlp.9 is no linear layer.*top_mlp.0"):
        quantize_model(tiny_model(), QuantConfig(layers={"mlp.9": "mxfp4"}))
    with pytest.raises(ConfigError, match=r"model.quant.where: cross.\* matches no linear layer"):
        quantize_model(tiny_model(), QuantConfig(format="mxfp4", where=["cross.*"]))


def test_model_quant_in_the_run_config() -> None:
    demo = CONFIGS / "demo.yaml"
    cfg = load_config(demo, ["model.quant={format: mxfp8_e4m3, gradients: true}"])
    assert cfg.model.quant == QuantConfig(format="mxfp8_e4m3", gradients=True)
    assert "quant" not in cfg.model.params.model_dump()  # not one of the model's own parameters
    layers = '{"interaction.0.mlp.0": mxfp4, "final.2": fp8_e5m2}'
    want = {"interaction.0.mlp.0": "mxfp4", "final.2": "fp8_e5m2"}
    assert load_config(demo, [f"model.quant.layers={layers}"]).model.quant.layers == want
    assert load_config(demo).model.quant is None
    for override, key in [("model.quant={format: nope}", "model.quant.format"),
                          ("model.quant.layers={a: mxfp5}", "model.quant.layers.a"),
                          ("model.quant.wher=[x]", "model.quant.wher")]:  # fmt: skip
        with pytest.raises(ConfigError) as e:
            load_config(demo, [override])
        assert key in str(e.value) and len(str(e.value).splitlines()) == 1, str(e.value)


def test_model_quant_where_without_a_format_is_refused() -> None:
    """model.quant={where: [...]} without a format, or a format with an empty where, lowered no layer and
    trained in fp32 without a word."""
    demo = CONFIGS / "demo.yaml"
    for override, says in [
        ('model.quant={where: ["head.*"]}', "model.quant: where ['head.*'] selects the layers that compute in "
                                            "format, and format is not set; give model.quant.format"),
        ("model.quant={format: mxfp4, where: []}", "model.quant: where is empty, so no layer would compute in "
                                                   "mxfp4"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError) as e:
            load_config(demo, [override])
        assert says in str(e.value) and len(str(e.value).splitlines()) == 1, str(e.value)
    # A probe's plan (layers, no format) and a format over every layer still load.
    assert load_config(demo, ['model.quant.layers={"head.0": mxfp4}']).model.quant.layers == {
        "head.0": "mxfp4"
    }
    assert load_config(demo, ["model.quant.format=mxfp4"]).model.quant.where == ["*"]
