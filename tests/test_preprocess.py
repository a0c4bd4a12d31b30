import json

import numpy as np
import pyarrow as pa
import pytest

from recscale.data.dataset import ArrayDataset, epoch_batches, iterate, materialize
from recscale.data.preprocess import OOV, Preprocessor, stable_hash
from recscale.data.schema import DenseFeature, Schema, SparseFeature
from recscale.errors import CheckpointError

SCHEMA = Schema(
    dense=[DenseFeature(name="x", transform="log1p", fill=0.0)],
    sparse=[
        SparseFeature(name="a", min_count=2),
        SparseFeature(name="g", multi=True, weighted=True),
        SparseFeature(name="h", hash_buckets=8),
    ],
)


def raw(labels, x, a, g, w, h) -> pa.RecordBatch:
    return pa.record_batch(
        {
            "label": pa.array(labels, pa.float32()),
            "x": pa.array(x, pa.float32()),
            "a": pa.array(a, pa.string()),
            "g": pa.array(g, pa.list_(pa.string())),
            "g__w": pa.array(w, pa.list_(pa.float32())),
            "h": pa.array(h, pa.string()),
        }
    )


TRAIN = [
    raw(
        [1, 0, 1],
        [0.0, None, 3.0],
        ["u", "u", "v"],
        [["p", "q"], [], ["q"]],
        [[1, 2], [], [0.5]],
        ["k1", None, "k2"],
    ),
    raw([0, 0], [7.0, -2.0], ["u", "w"], [["q"], ["r", "q", "p"]], [[1], [1, 1, 3]], ["k1", "k3"]),
]


def test_fit_counts_across_chunks_and_min_count():
    pre = Preprocessor.fit(TRAIN, SCHEMA)
    # "u" is seen 3 times, "v" and "w" once: only "u" passes min_count=2.
    assert pre.vocabs["a"].to_pylist() == ["u"]
    # q: 4, p: 2, r: 1 -> ordered by frequency.
    assert pre.vocabs["g"].to_pylist() == ["q", "p", "r"]
    assert pre.num_embeddings("a") == 2 and pre.num_embeddings("g") == 4 and pre.num_embeddings("h") == 9


def test_transform_maps_ids_dense_and_weights():
    pre = Preprocessor.fit(TRAIN, SCHEMA)
    cols = pre.transform(TRAIN[0])
    np.testing.assert_allclose(cols.dense[:, 0], np.log1p([0.0, 0.0, 3.0]), rtol=1e-6)
    values, lengths, weights = cols.sparse["a"]
    assert values.tolist() == [1, 1, OOV] and lengths.tolist() == [1, 1, 1]
    values, lengths, weights = cols.sparse["g"]
    assert values.tolist() == [2, 1, 1] and lengths.tolist() == [2, 0, 1]
    assert weights.tolist() == [1.0, 2.0, 0.5]
    hv = cols.sparse["h"][0]
    assert hv[1] == OOV and 1 <= hv[0] <= 8 and 1 <= hv[2] <= 8


def test_negative_counts_are_clipped_before_log1p():
    pre = Preprocessor.fit(TRAIN, SCHEMA)
    assert pre.transform(TRAIN[1]).dense[1, 0] == 0.0


def test_artifact_round_trip_maps_identically(tmp_path):
    pre = Preprocessor.fit(TRAIN, SCHEMA)
    pre.save(tmp_path / "pre.json")
    back = Preprocessor.load(tmp_path / "pre.json")
    for batch in TRAIN:
        a, b = pre.transform(batch), back.transform(batch)
        for name in ("a", "g", "h"):
            np.testing.assert_array_equal(a.sparse[name][0], b.sparse[name][0])
        np.testing.assert_array_equal(a.dense, b.dense)


def test_int_vocabulary_round_trips(tmp_path):
    schema = Schema(sparse=[SparseFeature(name="a")])
    batch = pa.record_batch({"label": pa.array([0.0, 1.0], pa.float32()), "a": pa.array([5, 7], pa.int64())})
    pre = Preprocessor.fit([batch], schema)
    pre.save(tmp_path / "p.json")
    back = Preprocessor.load(tmp_path / "p.json")
    assert (
        back.transform(batch).sparse["a"][0].tolist()
        == pre.transform(batch).sparse["a"][0].tolist()
        == [1, 2]
    )


def test_corrupt_artifact_is_a_clear_error(tmp_path):
    pre = Preprocessor.fit(TRAIN, SCHEMA)
    pre.save(tmp_path / "pre.json")
    text = (tmp_path / "pre.json").read_text()
    (tmp_path / "pre.json").write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        Preprocessor.load(tmp_path / "pre.json")
    obj = json.loads(text)
    obj["version"] = 99
    (tmp_path / "pre.json").write_text(json.dumps(obj))
    with pytest.raises(CheckpointError, match="version"):
        Preprocessor.load(tmp_path / "pre.json")


def test_stable_hash_is_fnv1a():
    def fnv(s: str) -> int:
        h = 0xCBF29CE484222325
        for c in s.encode():
            h = ((h ^ c) * 0x100000001B3) % 2**64
        return h

    words = ["", "a", "criteo", "0b153874", "日本"]
    assert stable_hash(pa.array(words)).tolist() == [fnv(w) for w in words]


def test_materialized_batches_match_transform(tmp_path):
    pre = Preprocessor.fit(TRAIN, SCHEMA)
    ds = ArrayDataset(materialize(TRAIN, pre, tmp_path / "split"))
    assert len(ds) == 5
    b = ds.gather(np.array([0, 4]))
    assert b.labels.tolist() == [1.0, 0.0]
    g = b.sparse["g"]
    assert g.lengths().tolist() == [2, 3]
    assert g.values().tolist() == [2, 1, 3, 1, 2]  # p q | r q p
    assert g.weights().tolist() == [1.0, 2.0, 1.0, 1.0, 3.0]
    assert b.sparse["a"].values().tolist() == [1, OOV]


def test_epoch_batches_shard_a_global_batch_across_ranks():
    one = epoch_batches(103, 10, shuffle=True, seed=3, epoch=1, drop_last=True)
    parts = [
        epoch_batches(103, 10, shuffle=True, seed=3, epoch=1, drop_last=True, rank=r, world_size=2)
        for r in (0, 1)
    ]
    assert len(one) == 10
    for i, b in enumerate(one):
        assert sorted(np.concatenate([parts[0][i], parts[1][i]]).tolist()) == sorted(b.tolist())
    other = epoch_batches(103, 10, shuffle=True, seed=3, epoch=2, drop_last=True)
    assert not all(np.array_equal(a, b) for a, b in zip(one, other, strict=True))


def test_worker_processes_yield_the_same_batches(tmp_path):
    pre = Preprocessor.fit(TRAIN, SCHEMA)
    ds = ArrayDataset(materialize(TRAIN, pre, tmp_path / "split"))
    batches = epoch_batches(5, 2, shuffle=True, seed=0, epoch=0, drop_last=False)
    a = [b.sparse["g"].values().tolist() for b in iterate(ds, batches, num_workers=0)]
    b = [b.sparse["g"].values().tolist() for b in iterate(ds, batches, num_workers=2)]
    assert a == b
