import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

import recscale.data.materialize as materialize_module
from recscale.data.dataset import ArrayDataset, epoch_batches, iterate, read_meta
from recscale.data.materialize import materialize
from recscale.data.preprocess import OOV, Preprocessor, ascending, stable_hash, vocabulary_order
from recscale.data.readers import read_batches
from recscale.data.schema import DenseFeature, Schema, SparseFeature
from recscale.errors import CheckpointError, DataError

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


# ---------------------------------------------------------------- the reference
# The preprocessing as it was before the one-pass engine (value_counts per chunk merged by group_by,
# index_in per chunk), kept here as the oracle the engine must match exactly.


def reference_fit(batches, schema: Schema) -> dict[str, list]:
    vocabs = {}
    for f in schema.sparse:
        if f.hash_buckets is not None:
            continue
        tables = []
        for b in batches:
            ids = b.column(f.name)
            ids = pc.list_flatten(ids) if pa.types.is_list(ids.type) else ids
            tables.append(pa.Table.from_struct_array(pc.value_counts(ids.drop_null())))
        counts = pa.concat_tables(tables).group_by("values").aggregate([("counts", "sum")])
        counts = counts.rename_columns(["values", "counts"])
        counts = counts.filter(pc.greater_equal(counts["counts"], f.min_count))
        counts = counts.sort_by([("counts", "descending"), ("values", "ascending")])
        if f.max_vocab is not None:
            counts = counts.slice(0, f.max_vocab)
        vocabs[f.name] = counts["values"].to_pylist()
    return vocabs


def reference_columns(batches, schema: Schema, vocabs: dict[str, list]) -> dict[str, np.ndarray]:
    """The split's files as the old per-chunk transform wrote them: name -> array."""
    out: dict[str, list[np.ndarray]] = {"label": [], "dense": []}
    for b in batches:
        out["label"].append(b.column("label").to_numpy(zero_copy_only=False).astype(np.float32))
        dense = np.empty((b.num_rows, len(schema.dense)), np.float32)
        for j, d in enumerate(schema.dense):
            col = pc.fill_null(b.column(d.name), d.fill).to_numpy(zero_copy_only=False)
            dense[:, j] = np.log1p(np.maximum(col, 0.0)) if d.transform == "log1p" else col
        out["dense"].append(dense)
        for f in schema.sparse:
            col = b.column(f.name)
            ids = pc.list_flatten(col) if f.multi else col
            if f.hash_buckets is not None:
                v = (stable_hash(ids) % np.uint64(f.hash_buckets)).astype(np.int64) + 1
                v[ids.is_null().to_numpy(zero_copy_only=False)] = OOV
            else:
                idx = pc.index_in(ids, value_set=pa.array(vocabs[f.name], ids.type))
                v = pc.fill_null(pc.add(idx, 1), OOV).to_numpy(zero_copy_only=False).astype(np.int64)
            out.setdefault(f"{f.name}.values", []).append(v)
            if f.multi:
                out.setdefault(f"{f.name}.lengths", []).append(
                    pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False)
                )
            if f.weighted:
                w = pc.fill_null(pc.list_flatten(b.column(f.name + "__w")), 1.0)
                out.setdefault(f"{f.name}.weights", []).append(w.to_numpy(zero_copy_only=False))
    cols = {k: np.concatenate(v) for k, v in out.items()}
    for f in schema.sparse:
        if f.multi:
            lengths = cols.pop(f"{f.name}.lengths")
            cols[f"{f.name}.offsets"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return cols


def assert_matches_reference(split, batches, schema: Schema, pre: Preprocessor) -> None:
    vocabs = reference_fit(batches, schema)
    assert {k: v.to_pylist() for k, v in pre.vocabs.items()} == vocabs
    ds = ArrayDataset(split)
    arrays = ds._open()
    expected = reference_columns(batches, schema, vocabs)
    assert sorted(expected) == sorted(arrays)
    for name, want in expected.items():
        np.testing.assert_array_equal(np.asarray(arrays[name]), want.astype(arrays[name].dtype), err_msg=name)
    # The /dev/shm check's size of a batch, from the files alone, is what gathering builds (over every row: exact).
    built = sum(a.nbytes for a in ds.gather_arrays(np.arange(len(ds))))
    assert abs(ds.batch_bytes(len(ds)) - built) <= 1, (ds.batch_bytes(len(ds)), built)


def fit(batches, tmp_path, schema: Schema = SCHEMA, name: str = "split") -> Preprocessor:
    return materialize(batches, schema, tmp_path / name)


# ---------------------------------------------------------------- tests


def test_fit_counts_across_chunks_and_min_count(tmp_path):
    pre = fit(TRAIN, tmp_path)
    # "u" is seen 3 times, "v" and "w" once: only "u" passes min_count=2.
    assert pre.vocabs["a"].to_pylist() == ["u"]
    # q: 4, p: 2, r: 1 -> ordered by frequency.
    assert pre.vocabs["g"].to_pylist() == ["q", "p", "r"]
    assert pre.num_embeddings("a") == 2 and pre.num_embeddings("g") == 4 and pre.num_embeddings("h") == 9


def test_an_empty_vocabulary_warns(tmp_path):
    """Every id under min_count (or every value missing) fits an empty vocabulary: every row is OOV and the
    feature a constant, which trained without a word (degenerate-data hunt: min_count above every count)."""
    schema = Schema(sparse=[SparseFeature(name="a", min_count=4), SparseFeature(name="g", multi=True)])
    batch = pa.record_batch(
        {
            "label": pa.array([1, 0, 1], pa.float32()),
            "a": pa.array(["u", "u", "v"]),
            "g": pa.array([[], None, []], pa.list_(pa.string())),
        }  # fmt: skip
    )
    with pytest.warns(UserWarning) as caught:
        pre = fit([batch], tmp_path, schema)
    said = [str(w.message) for w in caught]
    assert pre.num_embeddings("a") == 1 and pre.num_embeddings("g") == 1
    assert said == [
        "sparse feature 'a': in the training split none of its 2 distinct ids occurs min_count=4 times (the most "
        "frequent: 2), so its vocabulary is empty and every row maps to the out-of-vocabulary id: the feature "
        "carries no information; lower its min_count",
        "sparse feature 'g': in the training split every value is missing, so its vocabulary is empty and every "
        "row maps to the out-of-vocabulary id: the feature carries no information; check the column",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit(TRAIN, tmp_path, name="kept")  # "a" keeps "u" at min_count=2


def test_a_dense_feature_missing_on_every_row_warns(tmp_path):
    """A dense column empty on every training row is its fill everywhere: a constant the run trained with
    without a word (degenerate-data hunt: a CSV column left empty, a Parquet column of nulls)."""
    schema = Schema(
        dense=[DenseFeature(name="x", fill=-1.0), DenseFeature(name="y")], sparse=[SparseFeature(name="a")]
    )
    batch = pa.record_batch(
        {
            "label": pa.array([1, 0], pa.float32()),
            "x": pa.array([None, None], pa.float32()),
            "y": pa.array([None, 2.0], pa.float32()),
            "a": pa.array(["u", "v"]),
        }
    )
    with pytest.warns(UserWarning) as caught:
        fit([batch, batch], tmp_path, schema)
    assert [str(w.message) for w in caught] == [
        "dense feature 'x': in the training split every value is missing, so every row holds its fill (-1) and "
        "the feature carries no information; check the column"
    ]


def test_one_pass_matches_the_reference_on_mixed_fields(tmp_path):
    assert_matches_reference(tmp_path / "split", TRAIN, SCHEMA, fit(TRAIN, tmp_path))


def test_mapping_ids_dense_and_weights(tmp_path):
    fit(TRAIN, tmp_path)
    b = ArrayDataset(tmp_path / "split").gather(np.arange(3))
    np.testing.assert_allclose(b.dense[:, 0].numpy(), np.log1p([0.0, 0.0, 3.0]), rtol=1e-6)
    assert b.sparse["a"].values().tolist() == [1, 1, OOV]
    g = b.sparse["g"]
    assert g.values().tolist() == [2, 1, 1] and g.lengths().tolist() == [2, 0, 1]
    assert g.weights().tolist() == [1.0, 2.0, 0.5]
    hv = b.sparse["h"].values().tolist()
    assert hv[1] == OOV and 1 <= hv[0] <= 8 and 1 <= hv[2] <= 8


def test_negative_counts_are_clipped_before_log1p(tmp_path):
    fit(TRAIN, tmp_path)
    assert ArrayDataset(tmp_path / "split").gather(np.array([4])).dense[0, 0] == 0.0


def _criteo_text(rows: int, seed: int) -> str:
    """Criteo TSV with odd rows: missing cells, negative counts, repeated and unique ids, blank lines."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(rows):
        label = str(int(rng.random() < 0.3))
        ints = ["" if rng.random() < 0.2 else str(int(rng.integers(-3, 50))) for _ in range(13)]
        cats = []
        for j in range(26):
            r = rng.random()
            cats.append(
                "" if r < 0.1 else f"{int(rng.zipf(1.3)) % (5 + 40 * j):08x}" if r < 0.9 else f"u{i}x{j}"
            )
        lines.append("\t".join([label, *ints, *cats]))
        if i % 97 == 0:
            lines.append("")  # a blank line is skipped
    return "\n".join(lines) + "\n"


CRITEO = Schema(
    dense=[DenseFeature(name=f"I{i}", transform="log1p") for i in range(1, 14)],
    sparse=[
        SparseFeature(
            name=f"C{j}",
            min_count=(1, 2, 5)[j % 3],
            max_vocab=7 if j == 4 else None,
            hash_buckets=1000 if j % 9 == 0 else None,
        )
        for j in range(1, 27)
    ],
)


@pytest.mark.parametrize("chunk_rows", [1000, 37])
def test_one_pass_matches_the_reference_on_multi_chunk_criteo_files(tmp_path, monkeypatch, chunk_rows):
    path = tmp_path / "day.tsv"
    path.write_text(_criteo_text(3000, seed=chunk_rows))
    # Small text blocks and id blocks: many parsed pieces, many mapping blocks (with remainders).
    monkeypatch.setattr("recscale.data.readers.text.BLOCK_BYTES", 50_000)
    monkeypatch.setattr(materialize_module, "BLOCK_IDS", 2500)
    pre = materialize(read_batches(path, "criteo", CRITEO, chunk_rows=chunk_rows), CRITEO, tmp_path / "split")
    batches = list(read_batches(path, "criteo", CRITEO, chunk_rows=chunk_rows))
    assert len(batches) > 2
    assert_matches_reference(tmp_path / "split", batches, CRITEO, pre)
    # valid/test: the fitted vocabularies map another file exactly as the reference does
    other = tmp_path / "valid.tsv"
    other.write_text(_criteo_text(700, seed=99))
    materialize(
        read_batches(other, "criteo", CRITEO, chunk_rows=chunk_rows), CRITEO, tmp_path / "valid", pre=pre
    )
    valid = list(read_batches(other, "criteo", CRITEO, chunk_rows=chunk_rows))
    expected = reference_columns(valid, CRITEO, reference_fit(batches, CRITEO))
    arrays = ArrayDataset(tmp_path / "valid")._open()
    for name, want in expected.items():
        np.testing.assert_array_equal(np.asarray(arrays[name]), want.astype(arrays[name].dtype), err_msg=name)


# Text the numpy sort must order exactly as pyarrow does: bytes above 0x7f, NUL bytes, the empty
# string, prefixes of one another, and long ids sharing their first 8 bytes (the key's ties).
TRICKY = ["", "a", "a\0", "a\0\0", "ab", "abcdefgh", "abcdefgh\0", "abcdefghi", "abcdefghh", "abcdefgh\xff",
          "\xe9t\xe9", "\u00ff", "\u0100", "Z", "user_00000017", "user_00000003", "user_0000001", "\U0001f600"]  # fmt: skip


@pytest.mark.parametrize("kind", [pa.string(), pa.large_string(), pa.binary(), pa.large_binary(), pa.int64()])
def test_numpy_vocabulary_order_is_pyarrows(kind):
    rng = np.random.default_rng(0)
    if kind == pa.int64():
        values = pa.array(np.unique(rng.integers(-(2**62), 2**62, 500)))
    else:
        words = TRICKY + [f"{x:x}" * int(rng.integers(1, 4)) for x in rng.integers(0, 5000, 500)]
        values = pa.array(list(dict.fromkeys(words)), pa.string()).cast(kind)
    values = values.take(pa.array(rng.permutation(len(values)))).slice(3)  # an offset into its buffers
    assert ascending(values).tolist() == pc.sort_indices(values).to_numpy().tolist()
    counts = rng.integers(1, 4, len(values))  # many ties
    table = pa.table({"values": values, "counts": counts, "i": np.arange(len(values))})
    want = table.sort_by([("counts", "descending"), ("values", "ascending")])["i"].to_numpy()
    assert vocabulary_order(values, counts).tolist() == want.tolist()


def test_tricky_ids_over_many_blocks_match_the_reference(tmp_path, monkeypatch):
    """Fitting numbers ids block by block (each block after every id seen so far): with tiny blocks,
    min_count, max_vocab, nulls, empty lists and text the numpy sort must tie-break like pyarrow."""
    monkeypatch.setattr(materialize_module, "BLOCK_IDS", 7)
    schema = Schema(
        sparse=[
            SparseFeature(name="a", min_count=2),
            SparseFeature(name="b", max_vocab=5),
            SparseFeature(name="m", multi=True),
            SparseFeature(name="h", hash_buckets=4),
        ]
    )
    rng = np.random.default_rng(1)

    def ids(n: int) -> list:
        return [None if r < 0.1 else TRICKY[int(r * 100) % len(TRICKY)] for r in rng.random(n)]

    batches = [
        pa.record_batch(
            {
                "label": pa.array(rng.integers(0, 2, n).astype(np.float32)),
                "a": pa.array(ids(n), pa.string()),
                "b": pa.array(ids(n), pa.string()),
                "m": pa.array(
                    [[x for x in ids(int(k)) if x is not None] for k in rng.integers(0, 4, n)],
                    pa.list_(pa.string()),
                ),
                "h": pa.array(ids(n), pa.string()),
            }
        )
        for n in (1, 40, 13, 0, 55, 9)
    ]
    pre = fit(batches, tmp_path, schema)
    assert_matches_reference(tmp_path / "split", batches, schema, pre)
    materialize(batches[::-1], schema, tmp_path / "mapped", pre=pre)
    expected = reference_columns(batches[::-1], schema, reference_fit(batches, schema))
    arrays = ArrayDataset(tmp_path / "mapped")._open()
    for name, want in expected.items():
        np.testing.assert_array_equal(np.asarray(arrays[name]), want.astype(arrays[name].dtype), err_msg=name)


def test_a_failed_pass_leaves_no_split(tmp_path):
    def batches():
        yield TRAIN[0]
        raise DataError("bad row")

    with pytest.raises(DataError, match="bad row"):
        materialize(batches(), SCHEMA, tmp_path / "split")
    assert list(tmp_path.iterdir()) == []


def test_a_split_replaces_only_a_split(tmp_path):
    """`data prepare --out DIR` (or train --out) deleted whatever DIR/data/train held, e.g. the user's data."""
    theirs = tmp_path / "data" / "train"
    theirs.mkdir(parents=True)
    (theirs / "part-0.parquet").write_text("precious")
    with pytest.raises(
        DataError, match=r"data/train exists and is not a preprocessed split \(no meta\.json\)"
    ):
        materialize(TRAIN, SCHEMA, theirs)
    assert [p.name for p in theirs.iterdir()] == ["part-0.parquet"]
    (tmp_path / "file").write_text("precious")
    with pytest.raises(DataError, match="is not a preprocessed split"):
        materialize(TRAIN, SCHEMA, tmp_path / "file")
    split = tmp_path / "split"
    split.mkdir()  # empty: taken
    materialize(TRAIN, SCHEMA, split)
    materialize(TRAIN[:1], SCHEMA, split)  # a split: replaced
    assert len(ArrayDataset(split)) == TRAIN[0].num_rows


def test_artifact_round_trip_maps_identically(tmp_path):
    pre = fit(TRAIN, tmp_path)
    pre.save(tmp_path / "pre.json")
    back = Preprocessor.load(tmp_path / "pre.json")
    assert back.digest() == pre.digest()
    materialize(TRAIN, SCHEMA, tmp_path / "again", pre=back)
    a, b = ArrayDataset(tmp_path / "split")._open(), ArrayDataset(tmp_path / "again")._open()
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))


def test_digest_tells_vocabularies_apart(tmp_path):
    pre = fit(TRAIN, tmp_path)
    other = Preprocessor(SCHEMA, {**pre.vocabs, "a": pa.array(["v"])})
    assert other.digest() != pre.digest()
    # a sliced array digests as its values, whatever its buffers hold
    sliced = Preprocessor(SCHEMA, {**pre.vocabs, "g": pa.array(["x", "q", "p", "r"]).slice(1)})
    assert sliced.digest() == pre.digest()


def test_int_vocabulary_round_trips(tmp_path):
    schema = Schema(sparse=[SparseFeature(name="a")])
    batch = pa.record_batch({"label": pa.array([0.0, 1.0], pa.float32()), "a": pa.array([5, 7], pa.int64())})
    pre = fit([batch], tmp_path, schema)
    pre.save(tmp_path / "p.json")
    back = Preprocessor.load(tmp_path / "p.json")
    materialize([batch], schema, tmp_path / "again", pre=back)
    for split in ("split", "again"):
        assert ArrayDataset(tmp_path / split).gather(np.arange(2)).sparse["a"].values().tolist() == [1, 2]


def test_corrupt_artifact_is_a_clear_error(tmp_path):
    pre = fit(TRAIN, tmp_path)
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
    # Many values, a few far longer than the rest (whose tails are hashed one value at a time), in any order,
    # from a slice of a larger array; a null hashes as "".
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(0, 12, 300), rng.integers(200, 3000, 20), [5000]])
    rng.shuffle(lengths)
    many = ["".join(rng.choice(list("ab日z9"), n)) for n in lengths]
    sliced = pa.array(["x", *many, None, "y"]).slice(1)
    assert stable_hash(sliced).tolist() == [fnv(w) for w in [*many, "", "y"]]


def test_materialized_batches(tmp_path):
    fit(TRAIN, tmp_path)
    ds = ArrayDataset(tmp_path / "split")
    assert len(ds) == 5
    b = ds.gather(np.array([0, 4]))
    assert b.labels.tolist() == [1.0, 0.0]
    g = b.sparse["g"]
    assert g.lengths().tolist() == [2, 3]
    assert g.values().tolist() == [2, 1, 3, 1, 2]  # p q | r q p
    assert g.weights().tolist() == [1.0, 2.0, 1.0, 1.0, 3.0]
    assert b.sparse["a"].values().tolist() == [1, OOV]


@pytest.mark.parametrize(
    "name, size",
    [
        ("label.bin", 8),
        ("a.values.bin", 0),
        ("g.offsets.bin", 16),
        ("g.weights.bin", 4),
        ("h.values.bin", None),
    ],
)
def test_a_damaged_split_is_one_line_naming_its_file(tmp_path, name, size):
    """A column file cut short (a copy of a prepared directory, a disk fault) or missing was an internal error
    in a DataLoader worker (ValueError: mmap length, IndexError), or a batch of other rows' ids."""
    fit(TRAIN, tmp_path)
    path = tmp_path / "split" / name
    if size is None:
        path.unlink()
    else:
        os.truncate(path, size)
    with pytest.raises(
        DataError, match=rf"split/{name}: .* where the split's meta\.json needs \d+: the split is damaged"
    ):
        ArrayDataset(tmp_path / "split")


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text.replace('"version"', '"\xff"', 1).encode("latin-1"),  # a byte that is not UTF-8
        lambda text: text.replace('"rows"', '"rowz"', 1).encode(),  # a key the split needs, changed
        lambda text: b"[1, 2]",  # JSON of another shape
    ],
    ids=["not utf-8", "a key changed", "a list"],
)
def test_a_damaged_meta_json_is_an_incomplete_split(tmp_path, damage):
    """A meta.json damaged on disk was an internal error (UnicodeDecodeError, KeyError, AttributeError) of
    every command that read the split; it is an incomplete split now: a run's own is written again, a
    prepared directory's is refused with its one line, ArrayDataset says so."""
    fit(TRAIN, tmp_path)
    meta = tmp_path / "split" / "meta.json"
    meta.write_bytes(damage(meta.read_text()))
    assert read_meta(tmp_path / "split") is None
    with pytest.raises(DataError, match=r"split: not a complete preprocessed split"):
        ArrayDataset(tmp_path / "split")


@pytest.mark.parametrize("label", [float("nan"), 7.0])
def test_a_damaged_label_is_named_not_scored(tmp_path, label):
    """A label.bin damaged on disk (a flipped byte: NaN, 7) scored as 'the model scored NaN (a diverged model)'
    or as numbers from the damage; the readers write no label but 0 and 1, and the split is named damaged."""
    from recscale.train.evaluate import scored

    fit(TRAIN, tmp_path)
    path = tmp_path / "split" / "label.bin"
    labels = np.fromfile(path, np.float32)
    labels[3] = label
    labels.tofile(path)
    ds = ArrayDataset(tmp_path / "split")
    with pytest.raises(
        DataError, match=r"split/label\.bin: the label of row 3 is .*, not 0 or 1: the split is damaged"
    ):
        scored(torch.zeros(len(ds)), ds)


@pytest.mark.parametrize(
    ("vocab", "values"),
    [
        (pa.array([f"id{i}" for i in range(400)]), pa.array(["id7", None, "nope", "id399", "id0", "id7"])),
        (pa.array(range(1000, 1400), pa.int64()), pa.array(["1007", None, "01007", "1399", "7"])),
        (pa.array(range(1000, 1400), pa.int64()), pa.array([1007, None, 7, 1399], pa.int64())),
        (pa.array([str(i) for i in range(400)]), pa.array([7, None, 400, 0], pa.int64())),
        (  # int64's extremes, and text that is no id's decimal text (a sign, zeros, spaces, past int64)
            pa.array([*range(-200, 200), 2**63 - 1, -(2**63)], pa.int64()),
            pa.array(
                [
                    "-7",
                    "+7",
                    "-0",
                    "0",
                    "007",
                    " 7",
                    "7.0",
                    "",
                    "9223372036854775807",
                    "9223372036854775808",
                    "-9223372036854775808",
                    "-9223372036854775809",
                    "9999999999999999999",
                    "1" * 25,
                    "-",
                ]
            ),
        ),  # fmt: skip
    ],
)
def test_a_few_ids_are_looked_up_without_hashing_the_whole_vocabulary(monkeypatch, vocab, values):
    """A scoring request's few ids are mapped through the field's kept VocabIndex, exactly as index_in maps
    them (text against an int vocabulary too): index_in built a hash set of the whole vocabulary for every
    request, 4 s a 16-row request against Criteo-shaped vocabularies of 2.5M ids (4 ms with 1000 ids)."""
    pre = Preprocessor(Schema(sparse=[SparseFeature(name="a")]), {"a": vocab})
    text_vocab = pc.cast(vocab, pa.string())
    want = pc.fill_null(pc.add(pc.index_in(pc.cast(values, pa.string()), value_set=text_vocab), 1), OOV)
    calls = []
    index_in = pc.index_in
    monkeypatch.setattr(pc, "index_in", lambda *a, **k: calls.append(1) or index_in(*a, **k))
    for _ in range(3):  # the index is built once and kept
        assert pre.lookup("a", values).tolist() == want.to_pylist()
    assert calls == []
    assert pre.lookup("a", pa.array(["id1"] * len(vocab))).shape == (len(vocab),)  # many values: index_in
    assert calls == [1]


def test_an_id_longer_than_every_vocabulary_id_is_oov_without_being_hashed(monkeypatch):
    """stable_hash loops over character positions: the VocabIndex hashed a request's 8 MB id 8M times over.
    One longer than every id of the vocabulary is OOV, known without hashing it."""
    import recscale.data.preprocess as preprocess

    pre = Preprocessor(
        Schema(sparse=[SparseFeature(name="a")]), {"a": pa.array([f"id{i}" for i in range(400)])}
    )
    hashed: list[int] = []
    stable_hash = preprocess.stable_hash
    monkeypatch.setattr(
        preprocess,
        "stable_hash",
        lambda v: hashed.append(pc.max(pc.binary_length(v)).as_py() or 0) or stable_hash(v),
    )
    pre.vocab_index("a")
    assert pre.lookup("a", pa.array(["id3", "x" * 100_000, None, "id399", "id3" + "0" * 50])).tolist() == [
        4,
        OOV,
        OOV,
        400,
        OOV,
    ]
    assert max(hashed) == len("id399")


def test_predict_holds_no_batch_of_scores_until_the_end(tmp_path, monkeypatch):
    """predict copies each batch's scores into one tensor as it goes. It kept every batch's output tensor to
    concatenate them at the end, which pinned the allocator's heap between each batch's freed temporaries:
    `recscale eval` of 3M Criteo rows held ~3.5 GB for 12 MB of scores, growing with the rows."""
    import weakref

    import torch.distributed as dist

    from recscale.train.evaluate import predict

    fit(TRAIN, tmp_path)
    ds = ArrayDataset(tmp_path / "split")
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    outputs: list[weakref.ref] = []
    held = []  # each call's count of earlier outputs still alive

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.full((1,), 2.0))

        def forward(self, dense: torch.Tensor, sparse: object) -> torch.Tensor:
            held.append(sum(r() is not None for r in outputs))
            out = dense[:, 0] * self.w
            outputs.append(weakref.ref(out))
            return out

    logits = predict(Model(), ds, 1, 0)
    assert logits.tolist() == pytest.approx((2 * ds.gather(np.arange(len(ds))).dense[:, 0]).tolist())
    assert len(held) == len(ds) and max(held) <= 1


def test_epoch_batches_shard_a_global_batch_across_ranks():
    one = epoch_batches(103, 10, seed=3, epoch=1, drop_last=True)
    parts = [epoch_batches(103, 10, seed=3, epoch=1, drop_last=True, rank=r, world_size=2) for r in (0, 1)]
    assert len(one) == 10
    for i, b in enumerate(one):
        assert sorted(np.concatenate([parts[0][i], parts[1][i]]).tolist()) == sorted(b.tolist())
    other = epoch_batches(103, 10, seed=3, epoch=2, drop_last=True)
    assert not all(np.array_equal(a, b) for a, b in zip(one, other, strict=True))


def test_worker_processes_yield_the_same_batches(tmp_path):
    fit(TRAIN, tmp_path)
    ds = ArrayDataset(tmp_path / "split")
    batches = epoch_batches(5, 2, seed=0, epoch=0, drop_last=False)
    a = [b.sparse["g"].values().tolist() for b in iterate(ds, batches, num_workers=0)]
    b = [b.sparse["g"].values().tolist() for b in iterate(ds, batches, num_workers=2)]
    assert a == b


def test_a_worker_that_sends_no_batch_is_one_line_not_a_hang(tmp_path, monkeypatch):
    """A worker whose batch does not fit in /dev/shm drops it; /dev/shm filling during a run (the check
    before it passed) left the loader waiting for it forever. The reader gives up after a time and says why."""
    import time

    from recscale.data import dataset
    from recscale.errors import ResourceError

    fit(TRAIN, tmp_path)
    ds = ArrayDataset(tmp_path / "split")
    gather = ArrayDataset.gather_arrays

    def dropped_third(self, idx):  # in the worker: the batch of row 4 never arrives
        if 4 in idx:
            time.sleep(30)
        return gather(self, idx)

    monkeypatch.setattr(ArrayDataset, "gather_arrays", dropped_third)
    monkeypatch.setattr(dataset, "WORKER_TIMEOUT_S", 1.0)
    got = []
    with pytest.raises(ResourceError, match=r"the data workers sent no batch for 1 s; a worker whose batch did "
                                            r"not fit in shared memory \(/dev/shm, .* MiB free now\) drops it"):  # fmt: skip
        got += iterate(ds, [np.array([0, 1]), np.array([2, 3]), np.array([4])], num_workers=1)
    assert len(got) == 2


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_worker_processes_leave_the_global_rng_alone(tmp_path, num_workers):
    """The loader's worker seed came from the global torch RNG (dropout's): data.num_workers=0 vs 1
    trained another model, and an evaluation in workers moved the masks of the steps after it."""
    fit(TRAIN, tmp_path)
    ds = ArrayDataset(tmp_path / "split")
    torch.manual_seed(0)
    before = torch.get_rng_state()
    list(iterate(ds, epoch_batches(5, 2, seed=0, epoch=0, drop_last=False), num_workers=num_workers))
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("rows, world", [(5, 4), (2001, 2), (7, 3), (4, 4)])
def test_a_batch_that_does_not_split_evenly_gives_every_rank_rows(rows, world):
    """The one batch of a split smaller than the global batch: slices one row apart, every row once
    (ceil-sized slices left the last ranks none: 5 rows over 4 ranks crashed the last rank)."""
    parts = [epoch_batches(rows, 4096, seed=0, epoch=0, drop_last=False, rank=r, world_size=world)
             for r in range(world)]  # fmt: skip
    sizes = [len(p[0]) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert sorted(np.concatenate([p[0] for p in parts]).tolist()) == list(range(rows))


_FORK_WITH_A_LOCK_HELD = """
import gc, sys, threading
from recscale.data.dataset import ArrayDataset, epoch_batches, iterate

lock, held, release = threading.Lock(), threading.Event(), threading.Event()

def hold():
    with lock:
        held.set()
        release.wait()

class Cycle:  # garbage whose finalizer takes the lock, as objects of TensorBoard's writer or a pool may
    def __del__(self):
        with lock:
            pass

gc.disable()  # so that the parent keeps the cycle uncollected until the workers have forked
c = Cycle()
c.me = c
del c
threading.Thread(target=hold, daemon=True).start()
held.wait()
gather = ArrayDataset.gather_arrays
ArrayDataset.gather_arrays = lambda self, idx: (gc.collect(), gather(self, idx))[1]  # a worker's GC runs
ds = ArrayDataset(sys.argv[1])
n = sum(1 for _ in iterate(ds, epoch_batches(5, 2, seed=0, epoch=0, drop_last=False), 1))
release.set()
print(n)
"""


def test_a_loader_worker_never_collects_the_parents_garbage(tmp_path):
    """A worker forked while another thread held a lock, collecting garbage it inherited whose finalizer
    takes that lock, waited forever: a loader worker hung in tests/test_cli.py under load."""
    fit(TRAIN, tmp_path)
    script = [sys.executable, "-c", _FORK_WITH_A_LOCK_HELD, str(tmp_path / "split")]
    with subprocess.Popen(script, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as p:  # fmt: skip
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the hung worker too
            pytest.fail("the loader's worker hung collecting the parent's garbage")
    assert p.returncode == 0 and out.split() == ["3"], err[-2000:]


# ---------------------------------------------------------------- dense scales
SCALED = Schema(
    dense=[
        DenseFeature(name="x", transform="log1p", fill=2.0, scale="standard"),
        DenseFeature(name="y", scale="minmax"),
        DenseFeature(name="z"),  # unscaled beside them: kept as read
    ],
    sparse=[SparseFeature(name="a")],
)


def _dense_batches(seed: int, shift: float, sizes: tuple[int, ...] = (50, 1, 80)) -> list[pa.RecordBatch]:
    """Batches of raw rows with x ~ 1e3 (some missing), y ~ 1e3 wide, z ~ 1e4: statistics a sum of squares
    in float32 would get wrong. ``shift`` moves every value (another split's own statistics)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        x = (1000 + shift + rng.normal(0, 3, n)).astype(np.float32)
        out.append(
            pa.record_batch(
                {
                    "label": pa.array(rng.integers(0, 2, n).astype(np.float32)),
                    "x": pa.array(x, pa.float32(), mask=rng.random(n) < 0.2),
                    "y": pa.array((shift + rng.uniform(-500, 2500, n)).astype(np.float32)),
                    "z": pa.array((shift + 1e4 * rng.random(n)).astype(np.float32)),
                    "a": pa.array(rng.integers(0, 5, n).astype(str)),
                }
            )
        )
    return out


def _filled(batches: list[pa.RecordBatch]) -> np.ndarray:
    """(N, 3) float32 columns x, y, z after fill and transform, as numpy computes them."""
    x = np.concatenate([pc.fill_null(b.column("x"), 2.0).to_numpy() for b in batches])
    y = np.concatenate([b.column("y").to_numpy() for b in batches])
    z = np.concatenate([b.column("z").to_numpy() for b in batches])
    return np.stack([np.log1p(x), y, z], axis=1).astype(np.float32)


def _dense(split) -> np.ndarray:
    return np.fromfile(split / "dense.bin", np.float32).reshape(-1, 3)


def test_scales_are_numpys_statistics_of_the_training_rows_and_map_every_split(tmp_path):
    train, valid = _dense_batches(0, 0.0), _dense_batches(1, 700.0, (40,))
    pre = fit(train, tmp_path, SCALED)
    raw = _filled(train).astype(np.float64)
    x, y = raw[:, 0], raw[:, 1]
    assert pre.scales.keys() == {"x", "y"}
    np.testing.assert_allclose(pre.scales["x"], (x.mean(), x.std()), rtol=1e-12)
    assert pre.scales["y"] == (y.min(), y.max())
    scaled = _dense(tmp_path / "split")
    np.testing.assert_allclose(scaled[:, 0], (x - x.mean()) / x.std(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(scaled[:, 1], (y - y.min()) / (y.max() - y.min()), rtol=0, atol=1e-6)
    assert np.array_equal(scaled[:, 2], _filled(train)[:, 2])  # z: no scale, as read
    assert abs(scaled[:, 0].mean()) < 1e-5 and scaled[:, 1].min() == 0 and scaled[:, 1].max() == 1
    # valid is scaled with the training statistics, not its own (its values sit 700 higher)
    materialize(iter(valid), SCALED, tmp_path / "valid", pre=pre)
    v = _filled(valid).astype(np.float64)
    got = _dense(tmp_path / "valid")
    np.testing.assert_allclose(got[:, 0], (v[:, 0] - x.mean()) / x.std(), rtol=1e-6)
    np.testing.assert_allclose(got[:, 1], (v[:, 1] - y.min()) / (y.max() - y.min()), rtol=1e-6)
    own = (v[:, 0] - v[:, 0].mean()) / v[:, 0].std()
    assert np.abs(got[:, 0] - own).min() > 0.1 and got[:, 1].max() > 1
    # the training rows mapped again (as eval and serving map rows) are the written split, bit for bit
    materialize(iter(train), SCALED, tmp_path / "again", pre=pre)
    assert np.array_equal(_dense(tmp_path / "again"), scaled)


def test_scales_round_trip_through_preprocess_json_and_change_the_digest(tmp_path):
    pre = fit(_dense_batches(0, 0.0), tmp_path, SCALED)
    pre.save(tmp_path / "preprocess.json", fingerprint="fp")
    saved = json.loads((tmp_path / "preprocess.json").read_text())
    assert saved["scales"].keys() == {"x", "y"} and saved["scales"]["y"].keys() == {"min", "max"}
    back = Preprocessor.load(tmp_path / "preprocess.json")
    assert back.scales == pre.scales and back.digest() == pre.digest()
    mean, std = pre.scales["x"]
    other = Preprocessor(SCALED, pre.vocabs, scales={**pre.scales, "x": (mean, std * (1 + 1e-12))})
    assert other.digest() != pre.digest()  # a statistic is part of the mapping: split fingerprints change


@pytest.mark.parametrize(
    "scales, words",
    [
        (None, "has scales for none, its schema scales ['x', 'y']"),
        ({"x": {"mean": 1.0, "std": 1.0}}, "has scales for ['x'], its schema scales ['x', 'y']"),
        ({"x": {"mean": 1.0, "std": -1.0}, "y": {"min": 0.0, "max": 1.0}}, "unusable statistics"),
        ({"x": {"mean": 1.0, "std": 1.0}, "y": {"min": 2.0, "max": 1.0}}, "unusable statistics"),
        ({"x": {"mean": "1", "std": 1.0}, "y": {"min": 0.0, "max": 1.0}}, "unusable statistics"),
        ({"x": {"mean": 10**400, "std": 1.0}, "y": {"min": 0.0, "max": 1.0}}, "unusable statistics"),
        ([1.0], "has scales for none (list)"),
        ({"x": {"min": 1.0, "max": 1.0}, "y": {"min": 0.0, "max": 1.0}}, "not of the form {'mean', 'std'"),
    ],
)
def test_an_artifact_with_bad_scales_is_one_line(tmp_path, scales, words):
    obj = Preprocessor(SCALED, {"a": pa.array(["1"])}, scales={"x": (0.0, 1.0), "y": (0.0, 1.0)}).to_json()
    obj = {k: v for k, v in obj.items() if k != "scales"} | ({"scales": scales} if scales is not None else {})
    (tmp_path / "p.json").write_text(json.dumps(obj))
    with pytest.raises(CheckpointError) as e:
        Preprocessor.load(tmp_path / "p.json")
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("scale", ["standard", "minmax"])
def test_a_constant_scaled_column_warns_and_is_zero(tmp_path, scale):
    schema = Schema(dense=[DenseFeature(name="c", scale=scale, fill=0.1)], sparse=[SparseFeature(name="a")])
    batches = [pa.record_batch({"label": pa.array([0.0, 1.0, 0.0], pa.float32()),
                                "c": pa.array([0.1, None, 0.1], pa.float32()), "a": pa.array(["u", "v", "u"])})]  # fmt: skip
    with pytest.warns(
        UserWarning, match=rf"dense feature 'c': in the training split every value is 0.1 .*{scale}"
    ):
        pre = fit(batches, tmp_path, schema)
    assert pre.scales["c"][0] == np.float32(0.1)  # exactly the value: its rows are exactly 0
    assert np.array_equal(np.fromfile(tmp_path / "split" / "dense.bin", np.float32), np.zeros(3, np.float32))


# sha256 of what the code before dense scales wrote for SCHEMA and TRAIN (golden: scale none is unchanged).
_BEFORE_SCALES = {
    "digest": "07ae1fd0e6445f790abef7b279e0749238074a35d7c8aaf7def22bb29e9c2752",
    "preprocess.json": "871cd02037e847bb1eedc12045eb303de1c3f161720a707fee02b4aed1b9295f",
    "dense.bin": "6e70dacd8740b23396e5491b12f8e5a88609f8af6ef23ebdfd243f89036f7bbd",
    "meta.json": "82852e560eadaada13da88e100033b139ffb5bc0293b2c0590be17ad52cb11e9",
}


def test_without_a_scale_the_artifact_digest_and_split_are_as_before(tmp_path):
    import hashlib

    def sha(path):
        return hashlib.sha256(path.read_bytes()).hexdigest()

    pre = materialize(iter(TRAIN), SCHEMA, tmp_path / "train", fingerprint=lambda p: p.digest())
    pre.save(tmp_path / "preprocess.json", fingerprint="fp")
    assert "scale" not in json.dumps(SCHEMA.model_dump(mode="json")) and not pre.scales
    # The artifact holds what it held: written in version 1's layout (every id listed), its bytes are as they were.
    obj = json.loads((tmp_path / "preprocess.json").read_text())
    loaded = Preprocessor.load(tmp_path / "preprocess.json")
    obj["version"] = 1
    obj["vocabs"] = {
        n: {"type": v["type"], "values": loaded.vocabs[n].to_pylist()} for n, v in obj["vocabs"].items()
    }
    (tmp_path / "v1.json").write_text(json.dumps(obj))
    got = {"digest": pre.digest(), "preprocess.json": sha(tmp_path / "v1.json")}
    got |= {name: sha(tmp_path / "train" / name) for name in ("dense.bin", "meta.json")}
    assert got == _BEFORE_SCALES


def test_standard_scaling_trains_fm_on_values_near_1e3(tmp_path):
    """FM on raw values ~1e3 took LogLoss into the hundreds in one step; standardised, it stays near ln 2."""
    from recscale.cli import main

    rng = np.random.default_rng(0)
    for name, rows in (("train", 200), ("valid", 80)):
        lines = ["label,u,i,x,y,c"] + [
            f"{rng.integers(2)},{rng.integers(20)},{rng.integers(20)},{1000 + 50 * rng.random():.3f},"
            f"{3000 * rng.random():.1f},7"
            for _ in range(rows)
        ]
        (tmp_path / f"{name}.csv").write_text("\n".join(lines) + "\n")
    loss = {}
    for scale in ("none", "standard"):
        out = tmp_path / f"run-{scale}"
        argv = ["train", str(Path(__file__).resolve().parents[1] / "configs" / "frappe.yaml"), "--out", str(out),
                f"data.train={tmp_path / 'train.csv'}", f"data.valid={tmp_path / 'valid.csv'}",
                f"data.schema={{label: label, dense: [{{name: x, scale: {scale}}}, {{name: y, scale: {scale}}}, "
                f"{{name: c, scale: {scale}}}], sparse: [{{name: u}}, {{name: i}}]}}",
                "model.name=fm", "train.max_steps=1", "train.epochs=1", "train.batch_size=64",
                "train.progress=false", "data.num_workers=0"]  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert main(argv) == 0
        constant = [w for w in caught if "dense feature 'c'" in str(w.message)]
        assert bool(constant) == (scale != "none")  # the constant column warns, and trains
        loss[scale] = json.loads((out / "report.json").read_text())["valid"]["logloss"]
    assert np.isfinite(loss["standard"]) and loss["standard"] < 1.0 and loss["none"] > 10 * loss["standard"]


def _vocab_pre(n: int) -> Preprocessor:
    """A string field and an int field of ``n`` distinct ids each (and a field sharing the string one's)."""
    rng = np.random.default_rng(0)
    ints = rng.choice(1 << 40, size=n, replace=False)
    strs = pa.array([f"{x:010x}" for x in ints.tolist()] + ["é😀", ""], pa.string())
    schema = Schema(
        sparse=[SparseFeature(name="s"), SparseFeature(name="i"), SparseFeature(name="t", vocabulary="s")]
    )
    return Preprocessor(schema, {"s": strs, "i": pa.array(np.append(ints, -3), pa.int64())})


def _v1(pre: Preprocessor) -> dict:
    """``pre`` as version 1 of the artifact wrote it: every id a JSON list element."""
    vocabs = {
        name: {
            "type": "int" if pa.types.is_integer(pre.vocabs[name].type) else "str",
            "values": pre.vocabs[name].to_pylist(),
        }
        for name in ("s", "i")
    }
    return {"version": 1, "schema": pre.schema.model_dump(), "vocabs": vocabs}


def test_a_saved_vocabulary_loads_without_a_python_object_per_id(tmp_path):
    """Version 1 listed every id in the JSON: 16M ids parsed into 16M Python objects (~1.8 GB at the peak) in
    each serving worker, eval and predict. Version 2 keeps a vocabulary in a few strings: loading it allocates
    a few bytes an id on Python's heap (tracemalloc), the same arrays come back, and ids map alike."""
    import tracemalloc

    n = 100_000
    pre = _vocab_pre(n)
    path = tmp_path / "preprocess.json"
    pre.save(path)
    saved = json.loads(path.read_text())
    assert saved["version"] == 2
    assert saved["vocabs"]["i"].keys() == {"type", "ids"}  # no list of ids
    assert saved["vocabs"]["s"].keys() == {"type", "offsets", "text"}
    assert len(saved["vocabs"]["s"]["text"]) == 2  # in pieces of 2^16 ids
    tracemalloc.start()
    try:
        loaded = Preprocessor.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 45 * 2 * n, f"{peak / (2 * n):.0f} bytes an id"  # version 1: ~70 here
    for name in ("s", "i", "t"):
        assert loaded.vocabs[name].type == pre.vocabs[name].type
        assert loaded.vocabs[name].equals(pre.vocabs[name])
    assert loaded.digest() == pre.digest()
    probe = pa.array(
        ["é😀", "", "-3", "nope", None, *pre.vocabs["s"][:50].to_pylist(), str(pre.vocabs["i"][7])]
    )
    for name in ("s", "i", "t"):
        assert loaded.lookup(name, probe).tolist() == pre.lookup(name, probe).tolist()


def test_a_version_1_artifact_still_loads_as_it_did(tmp_path):
    pre = _vocab_pre(1000)
    path = tmp_path / "preprocess.json"
    path.write_text(json.dumps(_v1(pre)))
    loaded = Preprocessor.load(path)
    assert loaded.digest() == pre.digest()
    for name in ("s", "i", "t"):
        assert loaded.vocabs[name].equals(pre.vocabs[name])
    loaded.save(path)  # and is written back as version 2
    assert json.loads(path.read_text())["version"] == 2
    assert Preprocessor.load(path).digest() == pre.digest()


def test_an_int_vocabularys_index_keeps_no_text_of_its_ids():
    """The index of an int vocabulary kept every id's decimal text beside its hashes (~17 bytes an id, for the
    life of each serving worker): it searches the sorted ids themselves, 12 bytes an id."""
    pre = Preprocessor(
        Schema(sparse=[SparseFeature(name="a")]), {"a": pa.array(range(10**6, 0, -1), pa.int64())}
    )
    index = pre.vocab_index("a")
    held = index.keys.nbytes + index.order.nbytes + (index.text.nbytes if index.text is not None else 0)
    assert held <= 12 * 10**6, held
    assert pre.lookup("a", pa.array(["1", "1000000", "1000001", "01"])).tolist() == [10**6, 1, OOV, OOV]
