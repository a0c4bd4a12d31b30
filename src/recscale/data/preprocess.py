"""Preprocessing fitted on the training split: vocabularies per sparse field, dense transforms.

The fitted ``Preprocessor`` is saved as a versioned JSON artifact next to the run, so evaluation and
serving map ids exactly as training did. Id 0 of every field is reserved for out-of-vocabulary and
missing values; known ids are numbered 1.. by descending training frequency (ties by value).

Mapping is vectorised with ``pyarrow.compute.index_in``; hashed fields use a stable 64-bit FNV-1a
hash computed with numpy over the Arrow string buffers, so ids do not depend on the Python process.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import ValidationError

from recscale.data.schema import LABEL, WEIGHT_SUFFIX, Schema
from recscale.errors import CheckpointError, DataError, StaleArtifactError
from recscale.io import atomic_write_text

ARTIFACT_VERSION = 1
_ARTIFACT_KEYS = {"version", "schema", "vocabs"}
# The artifact is mostly vocabularies: Criteo's 26 fields at min_count 1 hold ~33M ids, ~0.4 GB as
# JSON. 1 GiB admits that with room to spare; larger vocabularies call for hash_buckets anyway, and
# the cap keeps a hostile file from exhausting memory (parsing costs several times the file size).
MAX_ARTIFACT_BYTES = 1 << 30
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

    def __init__(
        self, schema: Schema, vocabs: dict[str, pa.Array] | None = None, fingerprint: str | None = None
    ) -> None:
        self.schema = schema
        self.vocabs: dict[str, pa.Array] = vocabs or {}
        self.fingerprint = fingerprint  # of the inputs it was fitted from, as saved (None: not recorded)

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
        for j, d in enumerate(self.schema.dense):
            col = pc.fill_null(batch.column(d.name), d.fill).to_numpy(zero_copy_only=False)
            if d.transform == "log1p":
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
    def from_json(cls, obj: Any) -> Preprocessor:
        """Inverse of ``to_json`` (plus the optional ``fingerprint``). The artifact is untrusted
        input (runs get copied around): every key and type is checked, anything else is a
        one-line ``CheckpointError``."""

        def bad(what: str) -> CheckpointError:
            return CheckpointError(
                f"preprocessing artifact {what}; delete it and re-run training to rebuild it"
            )

        if type(obj) is not dict:
            json_type = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
            raise bad(f"is a JSON {json_type.get(type(obj), 'null')}, not an object")
        if type(obj.get("version")) is not int or obj["version"] != ARTIFACT_VERSION:
            raise bad(
                f"has version {_short(repr(obj.get('version')))}, this recscale reads version {ARTIFACT_VERSION}"
            )
        if not _ARTIFACT_KEYS <= obj.keys() <= _ARTIFACT_KEYS | {"fingerprint"}:
            raise bad(
                f"has keys {_short(sorted(obj))}, expected {sorted(_ARTIFACT_KEYS)} and an optional fingerprint"
            )
        fingerprint = obj.get("fingerprint")
        if fingerprint is not None and type(fingerprint) is not str:
            raise bad("has a fingerprint that is not a string")
        try:
            schema = Schema.model_validate(obj["schema"])
        except ValidationError as e:  # pydantic's text spans lines: keep the first error, on one line
            err = e.errors()[0]
            raise bad(
                f"has an invalid schema ({_short('.'.join(map(str, err['loc'])) or 'schema')}: {_short(err['msg'])})"
            ) from None
        if type(obj["vocabs"]) is not dict:
            raise bad("has vocabs that are not an object")
        wanted = {f.name for f in schema.sparse if f.hash_buckets is None}
        if obj["vocabs"].keys() != wanted:
            raise bad(f"has vocabularies {_short(sorted(obj['vocabs']))} for fields {_short(sorted(wanted))}")
        vocabs = {}
        for name, v in obj["vocabs"].items():
            if type(v) is not dict or v.keys() != {"type", "values"} or v["type"] not in ("int", "str"):
                raise bad(
                    f'has vocabulary {_short(repr(name))} not of the form {{"type": "int" or "str", "values": [...]}}'
                )
            kind = int if v["type"] == "int" else str
            if type(v["values"]) is not list or not all(type(x) is kind for x in v["values"]):
                raise bad(f"has vocabulary {_short(repr(name))} whose values are not all of type {v['type']}")
            try:
                vocabs[name] = pa.array(v["values"], type=pa.int64() if kind is int else pa.string())
            except (pa.ArrowException, OverflowError, UnicodeError) as e:  # ids beyond int64, lone surrogates
                raise bad(f"has vocabulary {_short(repr(name))} with unusable values ({_short(e)})") from None
        return cls(schema, vocabs, fingerprint=fingerprint)

    def save(self, path: Path, fingerprint: str | None = None) -> None:
        """Write atomically; ``fingerprint`` (stored when given) identifies the inputs it was fitted from."""
        obj = self.to_json() | ({"fingerprint": fingerprint} if fingerprint is not None else {})
        atomic_write_text(path, json.dumps(obj))

    @classmethod
    def load(cls, path: Path, expect_fingerprint: str | None = None) -> Preprocessor:
        """Read an artifact written by ``save``. With ``expect_fingerprint``, one fitted from other
        inputs (or with no fingerprint) is a ``StaleArtifactError``; every other fault (missing,
        not a file, oversized, not UTF-8, not JSON, wrong structure) a one-line ``CheckpointError``."""
        path = Path(path)
        try:
            # O_NONBLOCK: a FIFO in place of the file fails the regular-file check instead of hanging.
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise CheckpointError(f"{path}: preprocessing artifact is not a regular file; "
                                          "delete it and re-run training to rebuild it")  # fmt: skip
                too_big = st.st_size > MAX_ARTIFACT_BYTES
                data = b"" if too_big else f.read(MAX_ARTIFACT_BYTES + 1)  # +1: it may have grown
        except FileNotFoundError:
            raise CheckpointError(
                f"{path}: preprocessing artifact not found; is this a recscale run directory?"
            ) from None
        except OSError as e:
            raise CheckpointError(
                f"{path}: preprocessing artifact cannot be read ({e.strerror or e}); check that it is a readable file"
            ) from None
        if too_big or len(data) > MAX_ARTIFACT_BYTES:
            raise CheckpointError(f"{path}: preprocessing artifact is larger than {MAX_ARTIFACT_BYTES >> 30} GiB; "
                                  "cap the vocabularies (max_vocab, min_count or hash_buckets)")  # fmt: skip
        try:
            pre = cls.from_json(json.loads(data.decode("utf-8")))
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        except Exception as e:  # UnicodeDecodeError, JSONDecodeError, RecursionError, MemoryError, ...
            raise CheckpointError(
                f"{path}: preprocessing artifact is truncated or corrupt ({type(e).__name__}: {_short(e)}); "
                "delete it and re-run training to rebuild it"
            ) from None
        if expect_fingerprint is not None and pre.fingerprint != expect_fingerprint:
            raise StaleArtifactError(f"{path}: fitted from other data or settings")
        return pre


def _short(x: object, limit: int = 120) -> str:
    """``x`` as text fit for a one-line message (artifact contents can hold newlines or be huge)."""
    text = " ".join(str(x).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
