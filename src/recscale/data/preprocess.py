"""Preprocessing fitted on the training split: vocabularies per sparse field, dense transforms.

The fitted ``Preprocessor`` is saved as a versioned JSON artifact next to the run, so evaluation and
serving map ids exactly as training did. Id 0 of every field is reserved for out-of-vocabulary and
missing values; known ids are numbered 1.. by descending training frequency (ties by value).

Mapping is vectorised with ``pyarrow.compute.index_in``; hashed fields use a stable 64-bit FNV-1a
hash computed with numpy over the Arrow string buffers, so ids do not depend on the Python process.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recscale.data.schema import LABEL, WEIGHT_SUFFIX, Schema
from recscale.errors import CheckpointError, DataError
from recscale.io import atomic_write_text

ARTIFACT_VERSION = 1
OOV = 0


@dataclass
class Columns:
    """A preprocessed chunk, ready to be stored or batched.

    label:  (N,) float32
    dense:  (N, n_dense) float32
    sparse: field -> (values int64 (total,), lengths int32 (N,), weights float32 (total,) or None)
    """

    label: np.ndarray
    dense: np.ndarray
    sparse: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]]

    @property
    def rows(self) -> int:
        return int(self.label.shape[0])


def _values_and_lengths(col: pa.Array | pa.ChunkedArray) -> tuple[pa.Array, np.ndarray]:
    """Flatten a single- or multi-id column to (ids, per-row lengths); a null single id has length 1."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int32)
        return pc.list_flatten(col), lengths
    return col, np.ones(len(col), dtype=np.int32)


def stable_hash(values: pa.Array) -> np.ndarray:
    """64-bit FNV-1a of each value's UTF-8 text, vectorised over character positions. (N,) uint64."""
    strings = pc.cast(values, pa.large_string()) if not pa.types.is_large_string(values.type) else values
    strings = pc.fill_null(strings, "")
    offsets = np.frombuffer(strings.buffers()[1], dtype=np.int64)[
        strings.offset : strings.offset + len(strings) + 1
    ]
    data = strings.buffers()[2]
    chars = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
    starts, lengths = offsets[:-1], np.diff(offsets)
    h = np.full(len(strings), 0xCBF29CE484222325, dtype=np.uint64)
    prime = np.uint64(0x100000001B3)
    with np.errstate(over="ignore"):
        for pos in range(int(lengths.max(initial=0))):
            live = lengths > pos
            idx = np.nonzero(live)[0]
            h[idx] = (h[idx] ^ chars[starts[idx] + pos].astype(np.uint64)) * prime
    return h


def _merge_counts(tables: list[pa.Table]) -> pa.Table:
    """Sum per-chunk (values, counts) tables into one."""
    if not tables:
        return pa.table({"values": pa.array([], pa.string()), "counts": pa.array([], pa.int64())})
    merged = pa.concat_tables(tables).group_by("values").aggregate([("counts", "sum")])
    return merged.rename_columns(["values", "counts"])


class Preprocessor:
    """Vocabularies and dense transforms for one ``Schema``; fit on training data only."""

    def __init__(self, schema: Schema, vocabs: dict[str, pa.Array] | None = None) -> None:
        self.schema = schema
        self.vocabs: dict[str, pa.Array] = vocabs or {}

    # ---------------------------------------------------------------- fit
    @classmethod
    def fit(cls, batches: Iterable[pa.RecordBatch], schema: Schema) -> Preprocessor:
        """Count ids per vocabulary field over all batches, then keep those with count >= min_count."""
        fields = [f for f in schema.sparse if f.hash_buckets is None]
        partial: dict[str, list[pa.Table]] = {f.name: [] for f in fields}
        for batch in batches:
            for f in fields:
                ids, _ = _values_and_lengths(batch.column(f.name))
                partial[f.name].append(pa.Table.from_struct_array(pc.value_counts(ids.drop_null())))
                if len(partial[f.name]) >= 16:  # bound memory: merge the per-chunk counts as we go
                    partial[f.name] = [_merge_counts(partial[f.name])]
        vocabs = {}
        for f in fields:
            counts = _merge_counts(partial[f.name])
            counts = counts.filter(pc.greater_equal(counts["counts"], f.min_count))
            counts = counts.sort_by([("counts", "descending"), ("values", "ascending")])
            if f.max_vocab is not None:
                counts = counts.slice(0, f.max_vocab)
            vocabs[f.name] = counts["values"].combine_chunks()
        return cls(schema, vocabs)

    def num_embeddings(self, name: str) -> int:
        """Table size of a sparse field, including the OOV id 0."""
        f = next(f for f in self.schema.sparse if f.name == name)
        return (f.hash_buckets if f.hash_buckets is not None else len(self.vocabs[name])) + 1

    # ---------------------------------------------------------------- transform
    def _map_ids(self, name: str, ids: pa.Array) -> np.ndarray:
        f = next(f for f in self.schema.sparse if f.name == name)
        if f.hash_buckets is not None:
            mapped = (stable_hash(ids) % np.uint64(f.hash_buckets)).astype(np.int64) + 1
            nulls = ids.is_null().to_numpy(zero_copy_only=False)
            mapped[nulls] = OOV
            return mapped
        vocab = self.vocabs[name]
        if len(ids) and vocab.type != ids.type:
            # A vocabulary fitted on int ids mapped against string ids (or back): compare as text.
            vocab, ids = pc.cast(vocab, pa.string()), pc.cast(ids, pa.string())
        idx = pc.index_in(ids, value_set=vocab)
        return pc.fill_null(pc.add(idx, 1), OOV).to_numpy(zero_copy_only=False).astype(np.int64)

    def transform(self, batch: pa.RecordBatch) -> Columns:
        """Raw record batch (schema.py layout) -> Columns with integer ids and transformed floats."""
        n = batch.num_rows
        label = batch.column(LABEL).to_numpy(zero_copy_only=False).astype(np.float32)
        dense = np.empty((n, len(self.schema.dense)), dtype=np.float32)
        for j, f in enumerate(self.schema.dense):
            col = pc.fill_null(batch.column(f.name), f.fill).to_numpy(zero_copy_only=False)
            if f.transform == "log1p":
                # Criteo's integer counts can be negative; clip at 0 as the DLRM reference does.
                col = np.log1p(np.maximum(col, 0.0))
            dense[:, j] = col
        if not np.isfinite(dense).all():
            raise DataError(
                "dense features hold NaN or infinite values after preprocessing; check the fill values"
            )
        sparse = {}
        for f in self.schema.sparse:
            ids, lengths = _values_and_lengths(batch.column(f.name))
            weights = None
            if f.weighted:
                w, _ = _values_and_lengths(batch.column(f.name + WEIGHT_SUFFIX))
                weights = pc.fill_null(w, 1.0).to_numpy(zero_copy_only=False).astype(np.float32)
            sparse[f.name] = (self._map_ids(f.name, ids), lengths, weights)
        return Columns(label=label, dense=dense, sparse=sparse)

    # ---------------------------------------------------------------- artifact
    def to_json(self) -> dict:
        vocabs = {}
        for name, v in self.vocabs.items():
            kind = "int" if pa.types.is_integer(v.type) else "str"
            vocabs[name] = {"type": kind, "values": v.to_pylist()}
        return {"version": ARTIFACT_VERSION, "schema": self.schema.model_dump(), "vocabs": vocabs}

    @classmethod
    def from_json(cls, obj: dict) -> Preprocessor:
        if obj.get("version") != ARTIFACT_VERSION:
            raise CheckpointError(
                f"preprocessing artifact has version {obj.get('version')!r}, this recscale reads "
                f"version {ARTIFACT_VERSION}; re-run training to rebuild it"
            )
        schema = Schema.model_validate(obj["schema"])
        vocabs = {}
        for name, v in obj["vocabs"].items():
            vocabs[name] = pa.array(v["values"], type=pa.int64() if v["type"] == "int" else pa.string())
        return cls(schema, vocabs)

    def save(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: Path) -> Preprocessor:
        try:
            obj = json.loads(Path(path).read_text())
            return cls.from_json(obj)
        except FileNotFoundError:
            raise CheckpointError(
                f"{path}: preprocessing artifact not found; is this a recscale run directory?"
            ) from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: preprocessing artifact is truncated or corrupt ({e})") from None
