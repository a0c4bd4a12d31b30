"""The synthetic dataset: determinism, raw layout, Zipf ids, and a teacher whose floor is real."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from recscale.data.schema import LABEL
from recscale.data.synthetic import (
    DeepTeacher,
    SyntheticSpec,
    bayes_logloss,
    synthetic_batches,
    synthetic_schema,
    teacher_probabilities,
)

SMALL = SyntheticSpec(
    rows={"train": 30_000, "valid": 5_000}, num_sparse=4, vocab_sizes=200, num_multi=1, num_dense=2
)
DEEP = SMALL.model_copy(update={"teacher": DeepTeacher(kind="deep", num_layers=3, width=32)})


def _table(spec: SyntheticSpec, split: str, chunk_rows: int = 65536) -> pa.Table:
    return pa.Table.from_batches(list(synthetic_batches(spec, split, chunk_rows)))


def _probs(spec: SyntheticSpec, split: str, chunk_rows: int = 65536) -> np.ndarray:
    return np.concatenate(list(teacher_probabilities(spec, split, chunk_rows)))


def _entropy(p: np.ndarray) -> np.ndarray:
    return -(p * np.log(p) + (1 - p) * np.log(1 - p))


def _logloss(p: np.ndarray, y: np.ndarray) -> float:
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def test_same_spec_gives_identical_batches() -> None:
    assert _table(SMALL, "valid").equals(_table(SMALL.model_copy(deep=True), "valid"))


def test_seed_and_split_change_the_data() -> None:
    base = _table(SMALL, "valid")
    assert not base.equals(_table(SMALL.model_copy(update={"seed": 1}), "valid"))
    assert not base.equals(_table(SMALL, "train").slice(0, base.num_rows))


def test_chunk_rows_only_cut_the_rows() -> None:
    small = list(synthetic_batches(SMALL, "train", chunk_rows=1000))
    assert [b.num_rows for b in small] == [1000] * 30
    assert pa.Table.from_batches(small).equals(_table(SMALL, "train"))
    odd = list(teacher_probabilities(SMALL, "train", chunk_rows=7000))
    assert [len(p) for p in odd] == [7000] * 4 + [2000]
    np.testing.assert_array_equal(np.concatenate(odd), _probs(SMALL, "train"))


def test_a_split_is_a_prefix_of_a_longer_one() -> None:
    longer = SMALL.model_copy(update={"rows": {"valid": 40_000}})
    assert _table(longer, "valid").slice(0, 5_000).equals(_table(SMALL, "valid"))


def test_columns_match_schema_and_raw_layout() -> None:
    schema = synthetic_schema(SMALL)
    assert schema.sparse_names == ["s0", "s1", "s2", "s3", "m0"]
    assert schema.dense_names == ["d0", "d1"]
    assert [f.multi for f in schema.sparse] == [False] * 4 + [True]
    assert all(f.transform == "none" for f in schema.dense)
    table = _table(SMALL, "valid")
    assert table.column_names == schema.column_names()
    assert table.num_rows == 5_000
    types = dict(zip(table.column_names, table.schema.types, strict=True))
    assert types[LABEL] == pa.float32()
    assert all(types[n] == pa.float32() for n in schema.dense_names)
    assert all(types[f"s{i}"] == pa.int64() for i in range(4))
    assert types["m0"] == pa.list_(pa.int64())
    assert all(table.column(n).null_count == 0 for n in table.column_names)
    assert set(np.unique(table.column(LABEL).to_numpy())) == {0.0, 1.0}
    for name in schema.sparse_names:
        ids = pc.list_flatten(table.column(name)) if name == "m0" else table.column(name)
        assert 0 <= pc.min(ids).as_py() and pc.max(ids).as_py() < 200


def test_multi_id_lists_have_pooling_factor_length() -> None:
    lengths = pc.list_value_length(_table(SMALL, "train").column("m0")).to_numpy()
    assert lengths.min() >= 1
    assert lengths.mean() == pytest.approx(SMALL.pooling_factor, rel=0.03)


def test_ids_are_zipf_like() -> None:
    counts = np.bincount(_table(SMALL, "train").column("s0").to_numpy(), minlength=200)
    assert counts.max() > 50 * np.median(counts)
    # Frequency is not tied to id order: the top id is not simply id 0.
    ranks = np.argsort(-counts)
    assert not np.array_equal(ranks[:5], np.arange(5))


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="vocab_sizes"):
        SyntheticSpec(num_sparse=2, num_multi=1, vocab_sizes=[10, 10])
    with pytest.raises(ValueError, match="extra"):
        SyntheticSpec(unknown=1)
    with pytest.raises(KeyError, match="unknown split"):
        synthetic_batches(SMALL, "nope")
    with pytest.raises(ValueError, match="chunk_rows"):
        teacher_probabilities(SMALL, "valid", chunk_rows=0)


@pytest.mark.parametrize("teacher", [SMALL, DEEP], ids=["interaction", "deep"])
def test_base_ctr_and_bayes_floor(teacher: SyntheticSpec) -> None:
    spec = teacher.model_copy(update={"rows": {"big": 200_000}})
    p = _probs(spec, "big")
    labels = _table(spec, "big").column(LABEL).to_numpy()
    bayes = bayes_logloss(spec, "big")
    assert bayes == pytest.approx(float(_entropy(p).mean()), rel=1e-9)
    assert p.mean() == pytest.approx(spec.base_ctr, abs=0.02)
    assert labels.mean() == pytest.approx(spec.base_ctr, abs=0.02)
    background = float(_entropy(np.array([labels.mean()]))[0])
    assert bayes < background - 0.1
    # Labels are drawn from the teacher: the true probabilities score the floor on them.
    assert _logloss(p, labels) == pytest.approx(bayes, abs=0.005)


def test_logit_scale_zero_makes_labels_noise() -> None:
    spec = SMALL.model_copy(update={"logit_scale": 0.0})
    np.testing.assert_allclose(_probs(spec, "valid"), spec.base_ctr, rtol=1e-9)


def test_interactions_beat_logistic_regression() -> None:
    """A logistic regression on one-hot ids and raw dense stays far from the floor of an order-3 teacher."""
    spec = SyntheticSpec(
        rows={"train": 10_000, "test": 10_000},
        num_sparse=5,
        vocab_sizes=20,
        zipf_alpha=0.5,
        num_multi=0,
        num_dense=1,
        interaction_order=3,
    )

    def features(split: str) -> tuple[np.ndarray, np.ndarray]:
        table = _table(spec, split)
        one_hot = [np.eye(20)[table.column(f"s{i}").to_numpy()] for i in range(5)]
        dense = table.column("d0").to_numpy()[:, None]
        return np.hstack([np.ones_like(dense), *one_hot, dense]), table.column(LABEL).to_numpy()

    # Newton's method on the (slightly ridged: one-hot blocks are collinear) log-likelihood: exact and fast.
    x, y = features("train")
    w = np.zeros(x.shape[1])
    for _ in range(6):  # converges in about 4 steps
        p = 1 / (1 + np.exp(-x @ w))
        hessian = (x * (p * (1 - p))[:, None]).T @ x + 1e-3 * np.eye(len(w))
        w -= np.linalg.solve(hessian, x.T @ (p - y) + 1e-3 * w)
    x_test, y_test = features("test")
    lr_loss = _logloss(1 / (1 + np.exp(-x_test @ w)), y_test)
    assert _logloss(_probs(spec, "test"), y_test) < lr_loss - 0.05


def test_default_spec_dumps_without_a_teacher() -> None:
    """Existing specs serialise as before the deep teacher, so their data fingerprints stay valid."""
    assert "teacher" not in SMALL.model_dump() and '"teacher":' not in SMALL.model_dump_json()
    assert DEEP.model_dump()["teacher"] == {"kind": "deep", "num_layers": 3, "width": 32}
    assert SyntheticSpec.model_validate_json(DEEP.model_dump_json()) == DEEP
    with pytest.raises(ValueError, match="kind"):
        SyntheticSpec(teacher={"kind": "wide"})


def test_deep_teacher_is_deterministic_and_shares_the_features() -> None:
    table = _table(DEEP, "valid")
    assert table.equals(_table(DEEP.model_copy(deep=True), "valid"))
    longer = DEEP.model_copy(update={"rows": {"valid": 40_000}})
    assert _table(longer, "valid").slice(0, 5_000).equals(table)
    # Only the labels depend on the teacher: the features are the interaction teacher's.
    assert table.drop_columns([LABEL]).equals(_table(SMALL, "valid").drop_columns([LABEL]))
    assert not np.allclose(_probs(DEEP, "valid"), _probs(SMALL, "valid"))


def test_every_deep_level_carries_signal() -> None:
    """A deeper teacher keeps the shallower levels' share: its logit differs, and the floor moves little."""
    deeper = DEEP.model_copy(update={"teacher": DeepTeacher(kind="deep", num_layers=4, width=32)})
    a, b = _probs(DEEP, "valid"), _probs(deeper, "valid")
    assert np.corrcoef(a, b)[0, 1] < 0.99
    assert bayes_logloss(deeper, "valid") == pytest.approx(bayes_logloss(DEEP, "valid"), abs=0.05)
