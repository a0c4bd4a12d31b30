"""Sequence features: reading ordered id lists (truncation, empty and malformed lists), the sequence
encoders (DIN target attention, causal blocks), and the synthetic teacher's skewed histories."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recscale.config import DistributedConfig, load_config
from recscale.data.readers import ReadStats, read_batches
from recscale.data.schema import Schema
from recscale.data.synthetic import SyntheticSpec, synthetic_batches
from recscale.distributed.env import DistEnv, init_distributed, shutdown
from recscale.distributed.sharding import plan_tables
from recscale.errors import ConfigError, DataError, ResourceError
from recscale.models import EmbeddingConfig, FeatureSet, SparseInput, build_model, model_names
from recscale.train.build import build, schema_features

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SCHEMA = Schema.model_validate({"sparse": [{"name": "u"}, {"name": "h", "multi": True, "max_len": 3}]})


def _histories(path: Path, fmt: str, stats: ReadStats | None = None) -> list[list[str]]:
    return [x for b in read_batches(path, fmt, SCHEMA, stats=stats) for x in b.column("h").to_pylist()]


def test_csv_history_keeps_the_most_recent_ids_and_counts_the_cut(tmp_path):
    (tmp_path / "a.csv").write_text("label,u,h\n1,a,1|2|3|4|5\n0,b,\n1,c,7|8\n0,d,1|2|3|4\n")
    stats = ReadStats()
    assert _histories(tmp_path / "a.csv", "csv", stats) == [["3", "4", "5"], [], ["7", "8"], ["2", "3", "4"]]
    assert stats.truncated == {"h": 2}


def test_parquet_list_history_is_read_in_order(tmp_path):
    h = pa.array([[5, 6, 7, 8], [], [9]], pa.list_(pa.int64()))
    pq.write_table(pa.table({"label": [1, 0, 1], "u": ["a", "b", "c"], "h": h}), tmp_path / "a.parquet")
    stats = ReadStats()
    assert _histories(tmp_path / "a.parquet", "parquet", stats) == [["6", "7", "8"], [], ["9"]]
    assert stats.truncated == {"h": 1}


@pytest.mark.parametrize(
    "fmt, where, words",
    [
        ("csv", "line 3", "empty element"),
        ("parquet", "row 2", "null or empty element"),
        ("parquet-strings", "row 2", "null or empty element"),  # "" was read as an id
        ("parquet-bytes", "row 2", "null or empty element"),  # b"" was read as a null id in the history
        ("parquet-dictionary", "row 2", "null or empty element"),
    ],
)
def test_a_malformed_history_is_one_line_naming_file_and_line(tmp_path, fmt, where, words):
    path = tmp_path / f"bad.{fmt.split('-')[0]}"
    if fmt == "csv":
        path.write_text("label,u,h\n1,a,1|2\n0,b,3||4\n")
    else:
        h = pa.array([[1, 2], [3, None]], pa.list_(pa.int64()))
        if fmt == "parquet-strings":
            h = pa.array([["1", "2"], ["3", ""]], pa.list_(pa.string()))
        if fmt == "parquet-bytes":
            h = pa.array([[b"1", b"2"], [b"3", b""]], pa.list_(pa.binary()))
        if fmt == "parquet-dictionary":
            h = pa.array([["1", "2"], ["3", ""]], pa.list_(pa.dictionary(pa.int32(), pa.string())))
        pq.write_table(pa.table({"label": [1, 0], "u": ["a", "b"], "h": h}), path)
        fmt = "parquet"
    with pytest.raises(DataError) as e:
        _histories(path, fmt)
    msg = str(e.value)
    assert "\n" not in msg and f"{path} {where}" in msg and words in msg and "'h'" in msg


def test_a_sequence_encoder_needs_a_sequence_feature():
    """A history declared without max_len trained as a mean-pooled bag, the encoder set for it ignored."""
    from recscale.train.build import check_features

    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    bag = FeatureSet((SparseInput("u", 10), SparseInput("h", 20, "mean")), 1)
    with pytest.raises(ConfigError, match="no sparse feature is a sequence.*max_len") as e:
        check_features(load_config(demo, ["model.embedding.sequence={encoder: causal}"]), bag)
    assert "\n" not in str(e.value)
    check_features(load_config(demo), bag)  # the default, which every run's config.yaml writes out


def test_a_sequence_must_be_a_multi_id_feature():
    with pytest.raises(ValueError, match="multi=true"):
        Schema.model_validate({"sparse": [{"name": "h", "max_len": 3}]})


FEATURES = FeatureSet(
    (SparseInput("u", 10), SparseInput("item", 20), SparseInput("h", 20, "mean", False, 6)), 1
)


def _model(encoder: str, buckets: int | str = 1, softmax: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = EmbeddingConfig(
        dim=8,
        init_std=0.1,
        sequence={"encoder": encoder, "target": "item", "buckets": buckets, "softmax": softmax},
    )
    return build_model("wukong", FEATURES, cfg, {"num_layers": 1})


def _batch(histories: list[list[int]]) -> tuple[torch.Tensor, KeyedJaggedTensor]:
    b = len(histories)
    lengths = torch.tensor([1] * 2 * b + [len(h) for h in histories])
    values = torch.tensor([i % 10 for i in range(b)] * 2 + [x for h in histories for x in h])
    return torch.ones(b, 1), KeyedJaggedTensor(keys=["u", "item", "h"], values=values, lengths=lengths)


HISTORIES = [[1, 2, 3], [], [4, 5, 6, 7, 8, 9], [3], [], [2, 2]]


@pytest.mark.parametrize(
    "encoder, softmax, buckets",
    [
        ("din", False, 3),
        ("din", True, 3),
        ("causal", False, 3),
        ("causal_din", True, 3),
        ("causal_din", False, "pow2"),
    ],
)
def test_length_buckets_change_padding_not_results(encoder, softmax, buckets):
    dense, kjt = _batch(HISTORIES)
    ref = _model(encoder, softmax=softmax)(dense, kjt)
    got = _model(encoder, buckets=buckets, softmax=softmax)(dense, kjt)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("encoder", ["din", "causal", "causal_din"])
def test_the_history_moves_the_logit_and_an_empty_one_is_a_zero_vector(encoder):
    model = _model(encoder)
    dense, kjt = _batch(HISTORIES)
    x0 = model.embedding(dense, kjt)
    assert torch.equal(x0[[1, 4], -1], torch.zeros(2, 8))  # the pooled history of the empty ones
    logits = model(dense, kjt)
    logits.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    other = [[(x + 1) % 20 for x in h] for h in HISTORIES]
    changed = model(*_batch(other)).detach()
    moved = (changed - logits.detach()).abs() > 1e-6
    assert moved[[0, 2, 3, 5]].all() and not moved[[1, 4]].any()


@pytest.mark.parametrize("encoder", ["din", "causal", "causal_din"])
def test_a_sample_does_not_depend_on_the_batch_padding_it_shares(encoder):
    # The first two samples alone pad to 3 positions, in the full batch to 6: same logits.
    model = _model(encoder)
    dense, kjt = _batch(HISTORIES[:2])
    alone = model(dense, kjt)[:2]
    together = model(*_batch(HISTORIES))[:2]
    torch.testing.assert_close(alone, together, rtol=1e-5, atol=1e-6)


def test_synthetic_histories_have_skewed_lengths_within_max_len_and_move_the_label():
    spec = SyntheticSpec(rows={"train": 16384}, num_sparse=2, num_multi=0, num_dense=0, num_history=1,
                         history_max_len=32, logit_scale=3.0)  # fmt: skip
    batch = next(iter(synthetic_batches(spec, "train")))
    lengths = pc.list_value_length(batch.column("h0")).to_numpy()
    assert lengths.min() == 0 and lengths.max() == 32
    assert np.median(lengths) <= 4 < np.percentile(lengths, 90)  # skewed: most short, a few long
    labels = batch.column("label").to_numpy()
    # Rows sharing the single-id features differ by their history alone: the label must follow it.
    s0, s1 = (batch.column(n).to_numpy() for n in ("s0", "s1"))
    top = (s0 == np.bincount(s0).argmax()) & (s1 == np.bincount(s1).argmax())
    empty, long_ = labels[top & (lengths == 0)], labels[top & (lengths >= 8)]
    assert min(len(empty), len(long_)) > 30
    assert abs(empty.mean() - long_.mean()) > 0.05


def test_movielens_histories_hold_only_strictly_earlier_ratings_of_the_user(tmp_path):
    rows = [  # user, item, rating, timestamp; the two ratings of u1 at time 30 must not see each other
        ("u1", "a", 5, 10), ("u2", "x", 1, 15), ("u1", "b", 2, 20), ("u1", "c", 4, 30), ("u1", "d", 5, 30),
        ("u2", "y", 5, 35), ("u1", "e", 3, 40), ("u1", "f", 5, 50),
    ]  # fmt: skip
    lines = ["user_id:token\titem_id:token\trating:float\ttimestamp:float"]
    (tmp_path / "t.inter").write_text("\n".join(lines + ["\t".join(map(str, r)) for r in rows]) + "\n")
    schema = Schema.model_validate({"label": "rating", "sparse": [
        {"name": "item_id"}, {"name": "history", "multi": True, "max_len": 3},
        {"name": "liked_history", "multi": True, "max_len": 3}]})  # fmt: skip
    stats = ReadStats()
    options = {"split": "all"}
    table = pa.Table.from_batches(list(read_batches(tmp_path, "movielens", schema, options, stats=stats)))
    got = {r["item_id"]: (r["history"], r["liked_history"]) for r in table.to_pylist()}
    assert got == {
        "a": ([], []), "x": ([], []), "b": (["a"], ["a"]), "c": (["a", "b"], ["a"]), "d": (["a", "b"], ["a"]),
        "y": (["x"], []), "e": (["b", "c", "d"], ["a", "c", "d"]), "f": (["c", "d", "e"], ["a", "c", "d"]),
    }  # fmt: skip
    assert stats.truncated == {"history": 2}  # e and f had 4 and 5 earlier ratings
    test = list(read_batches(tmp_path, "movielens", schema, {"split": "test", "fractions": [0.75, 0, 0.25]}))
    assert pa.Table.from_batches(test).column("history").to_pylist() == [["b", "c", "d"], ["c", "d", "e"]]


def _sequence_plan(sharding: str, tables: dict | None = None) -> dict:
    env = DistEnv(0, 2, 2, torch.device("cpu"), "gloo")
    cfg = DistributedConfig.model_validate({"sharding": sharding, "tables": tables or {}})
    return plan_tables(_model("causal"), env, cfg).plan


def test_sequence_tables_are_planned_with_the_others_but_not_data_parallel():
    plan = _sequence_plan("row_wise")
    assert set(plan["embedding.ec"]) == {"t_h"} and set(plan["embedding.ebc"]) == {"t_u", "t_item"}
    assert plan["embedding.ec"]["t_h"].sharding_type == "row_wise"
    assert _sequence_plan("data_parallel", {"h": {"type": "table_wise"}})["embedding.ec"]["t_h"].ranks == [0]
    with pytest.raises(
        ConfigError, match=r"sequence table of 'h' cannot be data_parallel.*distributed\.tables\.h"
    ):
        _sequence_plan("data_parallel")


@pytest.mark.parametrize("name", model_names())
def test_every_model_reads_the_pooled_history_in_x0(name):
    cfg = EmbeddingConfig(dim=8, init_std=0.1, sequence={"encoder": "din", "target": "item"})
    torch.manual_seed(0)
    model = build_model(name, FEATURES, cfg, {})
    dense, kjt = _batch(HISTORIES)
    other = [[(x + 1) % 20 for x in h] for h in HISTORIES]
    assert not torch.allclose(model(dense, kjt), model(*_batch(other)))


SHARED = FeatureSet(
    (
        SparseInput("u", 10),
        SparseInput("item", 20),
        SparseInput("h", 20, "mean", False, 6, vocabulary="item"),
        SparseInput("liked", 20, "mean", False, 6, vocabulary="item"),
    ),
    1,
)


def test_histories_with_the_items_vocabulary_share_one_table_with_the_target():
    torch.manual_seed(0)
    cfg = EmbeddingConfig(dim=8, init_std=0.1, sequence={"encoder": "din", "target": "item"})
    model = build_model("wukong", SHARED, cfg, {"num_layers": 1})
    (table,) = model.embedding.ec.embedding_configs()
    assert table.name == "t_item#seq" and table.feature_names == ["h", "liked", "item"]
    b, hist = len(HISTORIES), [x for h in HISTORIES for x in h]
    lengths = torch.tensor([1] * 2 * b + [len(h) for h in HISTORIES] * 2)
    items = [i % 10 for i in range(b)]
    kjt = KeyedJaggedTensor(["u", "item", "h", "liked"], torch.tensor(items * 2 + hist * 2), lengths=lengths)
    model(torch.ones(b, 1), kjt).sum().backward()
    grad = model.embedding.ec.embeddings["t_item#seq"].weight.grad
    # The target rows learn through the attention even where no history names them (item 0's row:
    # sample 0's target; no history holds 0), and rows nobody names stay at zero gradient.
    assert grad[0].abs().sum() > 0 and grad[sorted(set(range(20)) - set(items) - set(hist))].abs().sum() == 0


def test_a_vocabulary_must_name_another_fitted_feature():
    for bad, words in (
        ([{"name": "h", "multi": True, "vocabulary": "nope"}], "vocabulary must name another"),
        (
            [{"name": "i", "hash_buckets": 8}, {"name": "h", "multi": True, "vocabulary": "i"}],
            "no hash_buckets",
        ),
        ([{"name": "i"}, {"name": "h", "multi": True, "vocabulary": "i", "min_count": 2}], "drop its"),
    ):
        with pytest.raises(ValueError, match=words):
            Schema.model_validate({"sparse": bad})


def test_a_history_maps_its_ids_with_the_items_vocabulary(tmp_path):
    from recscale.data.dataset import ArrayDataset
    from recscale.data.materialize import materialize
    from recscale.data.preprocess import Preprocessor

    schema = Schema.model_validate(
        {"sparse": [{"name": "item"}, {"name": "h", "multi": True, "max_len": 4, "vocabulary": "item"}]}
    )
    batch = pa.RecordBatch.from_pydict(
        {
            "label": pa.array([1.0, 0.0, 1.0], pa.float32()),
            "item": ["b", "a", "b"],
            "h": [["a", "zz"], [], ["b", "a"]],  # "zz" is no item: OOV
        }
    )
    pre = materialize([batch], schema, tmp_path / "train")
    ids = ArrayDataset(tmp_path / "train").gather_arrays(np.arange(3))[1]
    item, hist = ids[:3], ids[3:]
    a, b = pre.lookup("item", pa.array(["a"]))[0], pre.lookup("item", pa.array(["b"]))[0]
    assert item.tolist() == [b, a, b] and hist.tolist() == [a, 0, b, a]
    assert pre.num_embeddings("h") == pre.num_embeddings("item") == 3
    saved = pre.to_json()
    assert set(saved["vocabs"]) == {"item"}  # stored once, rebuilt for h on load
    back = Preprocessor.from_json(saved)
    assert back.lookup("h", pa.array(["b", "q"])).tolist() == [b, 0]


@pytest.mark.parametrize("materialize", ["full", "shards"])
def test_a_max_len_too_large_for_the_position_embeddings_names_max_len(materialize):
    """A causal encoder learns max_len x dim position embeddings, dense on every rank: an allocation of
    them that fails named the embedding tables and advised shards or more ranks, neither of which helps."""
    from recscale.config import load_config

    cfg = load_config(
        CONFIGS / "movielens" / "sequences.yaml",
        ["data.schema.sparse.8.max_len=1000000000000", f"distributed.materialize={materialize}",
         "model.embedding.sequence={encoder: causal_din, target: item_id}"],
    )  # fmt: skip
    try:
        with pytest.raises(ResourceError) as e:
            build(cfg, schema_features(cfg.data.schema), init_distributed())
    finally:
        shutdown()
    assert "position embeddings of sequence feature 'history' (max_len 1,000,000,000,000" in str(e.value)
    assert "lower the max_len of 'history'" in str(e.value) and "\n" not in str(e.value)
