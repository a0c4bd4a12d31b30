"""Analytic ``flops_per_example()`` against torch's FlopCounterMode, for every model and variant."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_models import EMBEDDING, FEATURES, SMALL, VARIANT_IDS, VARIANTS, random_batch, single_thread  # noqa: F401
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from recscale.models import EmbeddingConfig, FeatureSet, SparseInput, build_model, model_names
from recscale.models.blocks import OptimizedFM
from recscale.models.blocks.sequence import SequenceConfig, SequenceEncoder

# A Frappe-sized input: 10 single-id fields with a few thousand ids in all, no dense features.
FRAPPE = FeatureSet(sparse=tuple(SparseInput(f"f{i}", 500) for i in range(10)), num_dense=0)


def check(model: torch.nn.Module, features: FeatureSet, batch_size: int = 16) -> None:
    """The analytic count is exactly the counted one's per-example part: measured at B and 2B examples,
    a + c/B and a + c/2B FLOPs per example, c being what a batch computes once (FinalMLP's shared gate)."""
    model.eval()
    measured = []
    for b in (batch_size, 2 * batch_size):
        dense, sparse = random_batch(features, b, torch.Generator().manual_seed(0))
        with torch.no_grad():
            measured.append(counted(lambda x, s=sparse: model(x, s), dense))
    analytic = model.flops_per_example()
    assert analytic == pytest.approx(2 * measured[1] - measured[0]), (analytic, measured)


@pytest.mark.parametrize(("name", "params"), VARIANTS, ids=VARIANT_IDS)
def test_small_models(name: str, params: dict[str, Any]) -> None:
    check(build_model(name, FEATURES, EMBEDDING, params), FEATURES)


@pytest.mark.parametrize("name", sorted(SMALL))
@pytest.mark.parametrize("dim", [16, 64])
def test_default_models(name: str, dim: int) -> None:
    check(build_model(name, FRAPPE, EmbeddingConfig(dim=dim), {}), FRAPPE)


def test_all_models_covered() -> None:
    assert {name for name, _ in VARIANTS} == set(model_names())


def counted(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    """FLOPs per example of ``fn(x)`` as ``FlopCounterMode`` counts them (``x``: the batch)."""
    with FlopCounterMode(display=False) as counter:
        fn(x)
    return counter.get_total_flops() / x.shape[0]


def test_optimized_fm_is_linear_in_n() -> None:
    k, d = 4, 16
    cost = {}
    for n in (32, 64):
        x = torch.randn(2, n, d)
        fm = OptimizedFM(n, k, d)
        cost[n] = counted(fm, x)
        assert cost[n] == fm.flops_per_example() == 4 * n * k * d
        # The same product taken as (X Xᵀ) Y is quadratic in n.
        naive = counted(lambda x, y=fm.y: torch.bmm(x, x.transpose(1, 2)) @ y, x)
        assert naive == 2 * n * n * (d + k)
    assert cost[64] == 2 * cost[32]


@pytest.mark.parametrize("encoder", ["causal", "din", "causal_din"])
def test_sequence_encoder_cost_is_linear_plus_quadratic_in_the_history_length(encoder: str) -> None:
    """What ``distributed.balance=flops`` predicts: a history of L ids costs a L + b L² FLOPs."""
    d = 16
    enc = SequenceEncoder(SequenceConfig(encoder=encoder, layers=2, heads=2), d, max_len=64).eval()
    a, b = enc.length_flops()
    assert (b > 0) == (encoder != "din")
    for length in (8, 32):
        lengths = torch.full((4,), length)
        values, target = torch.randn(4 * length, d), torch.randn(4, d)
        # The math backend: FlopCounterMode does not count the CPU's fused attention kernel.
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            enc(values, lengths, target)
        # Exact: DIN's weighted sum, element-wise, was once counted as 2d FLOPs a position.
        assert counter.get_total_flops() / 4 == a * length + b * length**2


def test_small_counts_keep_three_significant_digits():
    """LR and FM rows of the quality tables read 0.000 MFLOP/ex."""
    from recscale.models.flops import mflop_number

    assert [mflop_number(x) for x in (0.00032, 0.0041, 0.24, 21.64, 0.0)] == [
        "0.000320",
        "0.00410",
        "0.240",
        "21.640",
        "0.000",
    ]
