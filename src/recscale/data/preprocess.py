"""Preprocessing fitted on the training split: vocabularies per sparse field, dense transforms and scales.

The fitted ``Preprocessor`` is saved as a versioned JSON artifact next to the run, so evaluation and
serving map ids exactly as training did. Id 0 of every field is reserved for out-of-vocabulary and
missing values; known ids are numbered 1.. by descending training frequency (ties by value).

Mapping is vectorised with ``pyarrow.compute.index_in`` (a few ids against a large vocabulary, as a scoring
request holds: a binary search in a kept ``VocabIndex``); hashed fields use a stable 64-bit FNV-1a
hash computed with numpy over the Arrow string buffers, so ids do not depend on the Python process.
``recscale.data.materialize`` drives both in one pass over a split.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import ValidationError

from recscale.data.readers.base import ReadStats, as_trained
from recscale.data.schema import WEIGHT_SUFFIX, DenseFeature, Schema
from recscale.errors import CheckpointError, DataError, StaleArtifactError
from recscale.io import atomic_write_text

# Version 2 keeps each vocabulary as a few strings (``_vocab_to_json``), where version 1 listed every id: a
# JSON list of 16M ids parses into 16M Python objects, ~110 bytes an id at its peak (~1.8 GB), in every process
# that loads the artifact (each serving worker, eval, predict). Version 1 still loads.
ARTIFACT_VERSION = 2
_READ_VERSIONS = (1, 2)
_ARTIFACT_KEYS = {"version", "schema", "vocabs"}
# The artifact is mostly vocabularies: Criteo's 26 fields at min_count 1 hold ~33M ids, ~0.4 GB as
# JSON. 1 GiB admits that with room to spare; larger vocabularies call for hash_buckets anyway, and
# the cap keeps a hostile file from exhausting memory (parsing costs several times the file size).
MAX_ARTIFACT_BYTES = 1 << 30
# The statistics each dense scale keeps, as named in the artifact's "scales".
_SCALE_KEYS = {"standard": ("mean", "std"), "minmax": ("min", "max")}
OOV = 0


def values_and_lengths(col: pa.Array | pa.ChunkedArray) -> tuple[pa.Array, np.ndarray]:
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
    prime = np.uint64(0x100000001B3)
    # Longest first: the values at least pos + 1 long are a prefix of ``order``. Positions are hashed across
    # values while many are that long, on contiguous slices of the values in that order; the few longest
    # values' remaining characters one value at a time (a pass per position over every value cost seconds
    # for one 200 KB value among 65k short ones). Lengths that fit 16 bits sort by radix, in linear time.
    key = lengths.astype(np.int16) if len(lengths) and lengths.max() < 1 << 15 else lengths
    order = np.argsort(-key, kind="stable")
    first, size = starts[order], lengths[order]
    ascending = size[::-1]
    h = np.full(len(strings), 0xCBF29CE484222325, dtype=np.uint64)  # in ``order``
    pos = 0
    with np.errstate(over="ignore"):
        while (live := len(order) - int(np.searchsorted(ascending, pos, side="right"))) > _FEW_LONG:
            h[:live] = (h[:live] ^ chars[first[:live] + pos]) * prime
            pos += 1
    for i in range(live):
        value = int(h[i])
        for c in chars[first[i] + pos : first[i] + size[i]].tobytes():
            value = ((value ^ c) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
        h[i] = value
    out = np.empty_like(h)
    out[order] = h
    return out


_FEW_LONG = 16  # values ``stable_hash`` finishes one at a time


def hashed_ids(ids: pa.Array, buckets: int) -> np.ndarray:
    """Ids of a ``hash_buckets`` field: 1 + stable_hash % buckets, null = OOV. (N,) int64.

    Each distinct id is hashed once (dictionary-encoded first): a chunk repeats its ids a lot."""
    enc = pc.dictionary_encode(ids)
    mapped = np.append((stable_hash(enc.dictionary) % np.uint64(buckets)).astype(np.int64) + 1, OOV)
    return mapped[pc.fill_null(enc.indices, len(enc.dictionary)).to_numpy(zero_copy_only=False)]


def dense_matrix(batch: pa.RecordBatch, schema: Schema, pre: Preprocessor | None = None) -> np.ndarray:
    """(N, n_dense) float32: each dense column filled, then transformed, then (``pre`` given) scaled with
    its fitted statistics. Without ``pre`` a ``scale`` is not applied: the training split is written so,
    and scaled in place once its statistics are known (``recscale.data.materialize``)."""
    dense = np.empty((batch.num_rows, len(schema.dense)), dtype=np.float32)
    for j, d in enumerate(schema.dense):
        col = pc.fill_null(batch.column(d.name), d.fill).to_numpy(zero_copy_only=False)
        if d.transform == "log1p":
            # Criteo's integer counts can be negative; clip at 0 as the DLRM reference does.
            col = np.log1p(np.maximum(col, 0.0))
        dense[:, j] = col
    if pre is not None:
        pre.scale_dense(dense)
    if not np.isfinite(dense).all():
        raise DataError(
            "dense features hold NaN or infinite values after preprocessing; check the fill values"
            + (
                " and the scaled features' training statistics (preprocess.json)"
                if pre and pre.scales
                else ""
            )
        )
    return dense


@dataclass(frozen=True)
class DenseMoments:
    """Running statistics of some dense columns, in float64: each (n,) over the columns. Merged batch by
    batch with Chan, Golub and LeVeque's pairwise update, which stays accurate where a sum of squares
    cancels (values ~1e3 with a spread ~1)."""

    count: int
    mean: np.ndarray
    m2: np.ndarray  # sum of squared deviations from the mean
    lo: np.ndarray
    hi: np.ndarray

    @classmethod
    def of(cls, dense: np.ndarray) -> DenseMoments:
        """The statistics of an (N, n) float array's columns."""
        x = dense.astype(np.float64)
        n = x.shape[1]
        if not len(x):
            return cls(0, np.zeros(n), np.zeros(n), np.full(n, np.inf), np.full(n, -np.inf))
        mean = x.mean(axis=0)
        return cls(len(x), mean, ((x - mean) ** 2).sum(axis=0), x.min(axis=0), x.max(axis=0))

    def merge(self, other: DenseMoments) -> DenseMoments:
        """The statistics of both sets of rows together."""
        if not other.count or not self.count:
            return self if other.count == 0 else other
        n = self.count + other.count
        delta = other.mean - self.mean
        return DenseMoments(
            n,
            self.mean + delta * (other.count / n),
            self.m2 + other.m2 + delta**2 * (self.count * other.count / n),
            np.minimum(self.lo, other.lo),
            np.maximum(self.hi, other.hi),
        )


def scaled_features(schema: Schema) -> list[DenseFeature]:
    """The dense features with a ``scale``, in schema order."""
    return [d for d in schema.dense if d.scale != "none"]


def fit_scales(schema: Schema, moments: DenseMoments) -> dict[str, tuple[float, float]]:
    """Each scaled feature's statistics, from ``moments`` of ``scaled_features(schema)``' training columns:
    (mean, population std) for ``standard``, (min, max) for ``minmax``. A constant column's mean is its value
    exactly (no rounding can leave its rows off 0 once centred)."""
    scales = {}
    for j, d in enumerate(scaled_features(schema)):
        lo, hi = float(moments.lo[j]), float(moments.hi[j])
        if d.scale == "minmax":
            scales[d.name] = (lo, hi)
        elif lo == hi:
            scales[d.name] = (lo, 0.0)
        else:
            scales[d.name] = (float(moments.mean[j]), math.sqrt(float(moments.m2[j]) / moments.count))
    return scales


def encode(batch: pa.RecordBatch, pre: Preprocessor) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A raw-layout batch (no label or row weight needed) mapped as a materialised split is, in memory:
    (dense (B, n_dense) float32, ids (total,) int64, lengths (n_sparse * B,) int32 in feature-major
    order, weights (total,) float32 when a feature is weighted else empty): ``ArrayDataset.gather_arrays``'
    layout. For online scoring, where rows arrive a few at a time and no split is written."""
    schema = pre.schema
    columns = schema.feature_columns()  # the label and the row weight are not needed
    if missing := [c for c in columns if c not in batch.schema.names]:
        raise DataError(
            f"the rows lack the model's columns {missing}: give every one of {columns} (null for a missing value)"
        )
    # As the readers give rows to training: empty ids dropped, a history cut to its most recent max_len.
    batch = as_trained(batch, schema, ReadStats())
    weighted = any(f.weighted for f in schema.sparse)
    values, lengths, weights = [], [], []
    for f in schema.sparse:
        ids, lens = values_and_lengths(batch.column(f.name))
        values.append(
            hashed_ids(ids, f.hash_buckets) if f.hash_buckets is not None else pre.lookup(f.name, ids)
        )
        lengths.append(lens)
        if f.weighted:
            w, w_lens = values_and_lengths(batch.column(f.name + WEIGHT_SUFFIX))
            if not np.array_equal(w_lens, lens):
                raise DataError(
                    f"feature '{f.name}': its weights ({f.name}{WEIGHT_SUFFIX}) and ids differ in number"
                )
            weights.append(pc.fill_null(w, 1.0).to_numpy(zero_copy_only=False).astype(np.float32))
        elif weighted:
            weights.append(np.ones(int(lens.sum()), np.float32))
    return (
        dense_matrix(batch, schema, pre),
        np.concatenate(values) if values else np.zeros(0, np.int64),
        np.concatenate(lengths) if lengths else np.zeros(0, np.int32),
        np.concatenate(weights) if weights else np.zeros(0, np.float32),
    )


def _text_key(values: pa.Array) -> np.ndarray | None:
    """Each text value's first 8 bytes as a big-endian uint64, zero-padded: ordered as the values are
    (bytewise), though distinct values can share a key. None for other types."""
    if not (pa.types.is_string(values.type) or pa.types.is_binary(values.type)
            or pa.types.is_large_string(values.type) or pa.types.is_large_binary(values.type)):  # fmt: skip
        return None
    wide = pa.types.is_large_string(values.type) or pa.types.is_large_binary(values.type)
    n, buffers = len(values), values.buffers()
    raw = np.frombuffer(buffers[1], np.int64 if wide else np.int32)
    offsets: np.ndarray = raw[values.offset : values.offset + n + 1].astype(np.int64)
    data = np.frombuffer(buffers[2], np.uint8) if buffers[2] is not None else np.zeros(0, np.uint8)
    data = data if len(data) else np.zeros(1, np.uint8)  # something to index; every length is then 0
    pos = offsets[:-1, None] + np.arange(8)
    inside = np.arange(8) < np.diff(offsets)[:, None]
    head = np.where(inside, data[np.minimum(pos, len(data) - 1)], 0).astype(np.uint8)
    return head.view(">u8").ravel().astype(np.uint64)


def ascending(values: pa.Array) -> np.ndarray:
    """Indices sorting distinct ``values`` ascending exactly as ``pc.sort_indices`` does (text bytewise),
    at a fraction of its cost: by an integer key in numpy, pyarrow only for values the key cannot tell
    apart (text sharing its first 8 bytes)."""
    if pa.types.is_integer(values.type):
        return np.argsort(values.to_numpy(), kind="stable")
    key = _text_key(values)
    if key is None:
        return pc.sort_indices(values).to_numpy()
    order = np.argsort(key)
    # Equal keys lie in runs; the key orders as the values do, so sorting the values of all runs
    # together puts each one back inside its own run, in order.
    sorted_key = key[order]
    same = sorted_key[1:] == sorted_key[:-1]
    tied = np.zeros(len(order), bool)
    tied[1:] |= same
    tied[:-1] |= same
    if tied.any():
        sub = order[tied]
        order[tied] = sub[pc.sort_indices(values.take(pa.array(sub))).to_numpy()]
    return order


def vocabulary_order(values: pa.Array, counts: np.ndarray) -> np.ndarray:
    """Indices of distinct ``values`` by descending ``counts``, ties by ascending value: a vocabulary's
    order (``sort_by([("counts", "descending"), ("values", "ascending")])``, computed faster)."""
    by_value = ascending(values)
    return by_value[np.argsort(-counts[by_value], kind="stable")]


# ``lookup`` maps values through a ``VocabIndex`` when the vocabulary holds at least this many times as many ids.
FEW_VALUES = 16


class VocabIndex:
    """A vocabulary kept to look up a few values at a time, a binary search each, where ``pc.index_in`` hashes
    the whole vocabulary on every call (a 16-row request took 4 s against Criteo-shaped vocabularies of 2.5M
    ids). Values match ids as ``lookup`` compares them, as text (an int vocabulary's decimal text, as its string
    ids read). A string vocabulary is kept sorted by the 64-bit ``stable_hash`` of its ids, the text compared
    after the search; an int one sorted by id, with no copy of its text: a value is its id where it is an
    id's decimal text (``7``, not ``007`` or ``+7``)."""

    def __init__(self, vocab: pa.Array) -> None:
        self.size = len(vocab)
        self.text: pa.Array | None = None
        if pa.types.is_integer(vocab.type):
            ids = vocab.to_numpy(zero_copy_only=False).astype(np.int64)
            self.order = np.argsort(ids, kind="stable").astype(np.int32 if len(ids) < 1 << 31 else np.int64)
            self.keys = ids[self.order]
            self.unique = bool((self.keys[1:] != self.keys[:-1]).all())
            return
        self.text = vocab if pa.types.is_string(vocab.type) else pc.cast(vocab, pa.string())
        # stable_hash loops over character positions: a value longer than every id (a request's 8 MB id) is
        # known absent without hashing it.
        self.longest = int(pc.max(pc.binary_length(self.text)).as_py() or 0)
        # Hashed a slice at a time: stable_hash's temporaries (a large_string copy, several int64 arrays) are
        # ~50 bytes an id, and every serving worker builds the index on start.
        step = 1 << 20
        keys = np.concatenate(
            [stable_hash(self.text.slice(i, step)) for i in range(0, len(self.text), step)]
            or [np.zeros(0, np.uint64)]
        )
        # int32 positions where they fit: this index is kept for the life of the process.
        self.order = np.argsort(keys, kind="stable").astype(np.int32 if len(keys) < 1 << 31 else np.int64)
        self.keys = keys[self.order]
        del keys
        # Two ids of one hash (never seen, but possible) would need more than one comparison: ``lookup``
        # then uses index_in.
        self.unique = bool((self.keys[1:] != self.keys[:-1]).all())

    def lookup(self, values: pa.Array) -> np.ndarray:
        """Vocabulary ids (1.., OOV for unknown or null) of ``values``. (N,) int64."""
        ids = np.full(len(values), OOV, np.int64)
        if not self.size:
            return ids
        if self.text is None:
            rows, keys = _int_values(values)
        else:
            text = values if pa.types.is_string(values.type) else pc.cast(values, pa.string())
            short = pc.fill_null(pc.less_equal(pc.binary_length(text), self.longest), False)
            rows = np.flatnonzero(short.to_numpy(zero_copy_only=False))
            text = text.take(pa.array(rows))
            keys = stable_hash(text)
        at = np.minimum(np.searchsorted(self.keys, keys), self.size - 1)
        candidate = self.order[at]
        found = self.keys[at] == keys
        if self.text is not None:
            found &= pc.fill_null(pc.equal(self.text.take(pa.array(candidate)), text), False).to_numpy(
                zero_copy_only=False
            )
        ids[rows[found]] = candidate[found] + 1
        return ids


# An int64's decimal text as an int vocabulary's ids read (no sign but a minus, no leading zero), at most 19
# digits; those of 19 are compared with the int64 bounds as text (equal lengths: text order is number order).
_INT_TEXT = r"^(0|-?[1-9][0-9]{0,18})$"
_INT_BOUNDS = ("9223372036854775807", "-9223372036854775808")


def _int_values(values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """The rows of ``values`` (int or text) that are some int64's decimal text, and those int64s."""
    if pa.types.is_integer(values.type):
        valid = pc.is_valid(values).to_numpy(zero_copy_only=False)
        rows = np.flatnonzero(valid)
        return rows, values.take(pa.array(rows)).to_numpy(zero_copy_only=False).astype(np.int64)
    text = values if pa.types.is_string(values.type) else pc.cast(values, pa.string())
    ok = pc.fill_null(pc.match_substring_regex(text, _INT_TEXT), False)
    for bound in _INT_BOUNDS:
        at_length = pc.equal(pc.binary_length(text), len(bound))
        same_sign = pc.equal(pc.starts_with(text, "-"), bound.startswith("-"))
        beyond = pc.and_(pc.and_(at_length, same_sign), pc.greater(text, bound))
        ok = pc.and_(ok, pc.invert(pc.fill_null(beyond, False)))
    rows = np.flatnonzero(ok.to_numpy(zero_copy_only=False))
    return rows, pc.cast(text.take(pa.array(rows)), pa.int64()).to_numpy(zero_copy_only=False)


class Preprocessor:
    """Vocabularies, dense transforms and dense scales for one ``Schema``, fitted on training data only
    (by ``recscale.data.materialize``, which counts the ids and the scaled columns' statistics).

    ``scales`` holds, for each dense feature with a ``scale``, its training statistics: (mean, std) for
    ``standard``, (min, max) for ``minmax`` (see ``fit_scales``)."""

    def __init__(
        self,
        schema: Schema,
        vocabs: dict[str, pa.Array] | None = None,
        fingerprint: str | None = None,
        scales: dict[str, tuple[float, float]] | None = None,
    ) -> None:
        self.schema = schema
        self.vocabs: dict[str, pa.Array] = dict(vocabs or {})
        for f in schema.sparse:  # a field with another's vocabulary maps with that one
            if f.vocabulary is not None and f.vocabulary in self.vocabs:
                self.vocabs[f.name] = self.vocabs[f.vocabulary]
        self.fingerprint = fingerprint  # of the inputs it was fitted from, as saved (None: not recorded)
        self._indexes: dict[int, VocabIndex] = {}  # by id() of the vocabulary (fields may share one)
        self.scales: dict[str, tuple[float, float]] = dict(scales or {})
        if self.scales.keys() != {d.name for d in scaled_features(schema)}:
            raise ValueError(
                f"scales given for {sorted(self.scales)}, the schema scales {[d.name for d in scaled_features(schema)]}"
            )

    def scale_dense(self, dense: np.ndarray) -> np.ndarray:
        """Scale the filled and transformed (N, n_dense) float32 ``dense`` in place with the fitted statistics
        (in float64, then rounded to float32); returns it. A column constant in training is only shifted."""
        for j, d in enumerate(self.schema.dense):
            if d.scale == "none":
                continue
            a, b = self.scales[d.name]
            shift, spread = (a, b) if d.scale == "standard" else (a, b - a)
            col = dense[:, j].astype(np.float64) - shift
            dense[:, j] = col / spread if spread > 0 else col
        return dense

    def num_embeddings(self, name: str) -> int:
        """Table size of a sparse field, including the OOV id 0."""
        f = next(f for f in self.schema.sparse if f.name == name)
        return (f.hash_buckets if f.hash_buckets is not None else len(self.vocabs[name])) + 1

    def lookup(self, name: str, values: pa.Array) -> np.ndarray:
        """Vocabulary ids (1.., OOV for unknown or null) of field ``name``'s ``values``. (N,) int64.

        Many values (a block of a split) are mapped with one ``index_in``, which builds the vocabulary's hash
        set on each call; a few against a large vocabulary (a scoring request) through the field's
        ``VocabIndex``, built on first use and kept: a request's cost no longer grows with the vocabulary."""
        vocab = self.vocabs[name]
        # No ids at all (a multi-id field whose rows are all empty): index_in would still demand equal types.
        if not len(values):
            return np.empty(0, np.int64)
        if len(values) * FEW_VALUES <= len(vocab) and (index := self.vocab_index(name)).unique:
            return index.lookup(values)
        if vocab.type != values.type:
            # A vocabulary fitted on int ids mapped against string ids (or back): compare as text.
            vocab, values = pc.cast(vocab, pa.string()), pc.cast(values, pa.string())
        idx = pc.index_in(values, value_set=vocab)
        return pc.fill_null(pc.add(idx, 1), OOV).to_numpy(zero_copy_only=False).astype(np.int64)

    def vocab_index(self, name: str) -> VocabIndex:
        """Field ``name``'s vocabulary indexed for ``lookup`` of a few values, built on first use and kept."""
        vocab = self.vocabs[name]
        if (index := self._indexes.get(id(vocab))) is None:
            index = self._indexes[id(vocab)] = VocabIndex(vocab)
        return index

    def index_vocabularies(self) -> None:
        """Build every vocabulary's ``VocabIndex`` now (seconds for millions of ids), as a server does before it
        takes requests, then hand Arrow's freed temporaries back to the system: its allocator keeps them, and
        each serving worker would hold them for its whole life."""
        for f in self.schema.sparse:
            if f.hash_buckets is None:
                self.vocab_index(f.name)
        pa.default_memory_pool().release_unused()

    def digest(self) -> str:
        """sha256 of the schema and every vocabulary, far cheaper than serialising them: identifies
        the mapping, e.g. in a materialised split's fingerprint."""
        h = hashlib.sha256(json.dumps(self.schema.model_dump(mode="json"), sort_keys=True).encode())
        for name in sorted(self.vocabs):
            v = self.vocabs[name]
            kind = "int" if pa.types.is_integer(v.type) else "str"
            h.update(f"\0{name}\0{kind}\0{len(v)}\0".encode())
            if kind == "int":
                h.update(v.to_numpy(zero_copy_only=False).astype("<i8").tobytes())
                continue
            s = pc.cast(v, pa.large_string())
            offsets = np.frombuffer(s.buffers()[1], dtype=np.int64)[s.offset : s.offset + len(s) + 1]
            h.update((offsets - offsets[0]).astype("<i8").tobytes())
            if s.buffers()[2] is not None:
                h.update(memoryview(s.buffers()[2])[offsets[0] : offsets[-1]])
        for name in sorted(self.scales):  # none without a scaled feature: such a digest is as it always was
            h.update(f"\0scale\0{name}\0".encode() + np.array(self.scales[name], "<f8").tobytes())
        return h.hexdigest()

    # ---------------------------------------------------------------- artifact
    def to_json(self) -> dict:
        vocabs = {}
        shared = {f.name for f in self.schema.sparse if f.vocabulary is not None}
        for name, v in self.vocabs.items():
            if name in shared:  # rebuilt from its source's on load
                continue
            vocabs[name] = _vocab_to_json(v)
        obj = {"version": ARTIFACT_VERSION, "schema": self.schema.model_dump(), "vocabs": vocabs}
        if self.scales:  # absent without a scaled feature, so such an artifact is as it always was
            obj["scales"] = {
                d.name: dict(zip(_SCALE_KEYS[d.scale], self.scales[d.name], strict=True))
                for d in scaled_features(self.schema)
            }
        return obj

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
        if type(obj.get("version")) is not int or obj["version"] not in _READ_VERSIONS:
            raise bad(
                f"has version {_short(repr(obj.get('version')))}, this recscale reads versions "
                f"{' and '.join(map(str, _READ_VERSIONS))}"
            )
        if not _ARTIFACT_KEYS <= obj.keys() <= _ARTIFACT_KEYS | {"fingerprint", "scales"}:
            raise bad(
                f"has keys {_short(sorted(obj))}, expected {sorted(_ARTIFACT_KEYS)} and optional fingerprint and scales"
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
        wanted = {f.name for f in schema.sparse if f.hash_buckets is None and f.vocabulary is None}
        if obj["vocabs"].keys() != wanted:
            raise bad(f"has vocabularies {_short(sorted(obj['vocabs']))} for fields {_short(sorted(wanted))}")
        read = _vocab_from_json if obj["version"] >= 2 else _vocab_from_json_v1
        vocabs = {name: read(name, v, bad) for name, v in obj["vocabs"].items()}
        return cls(
            schema, vocabs, fingerprint=fingerprint, scales=_scales_from_json(obj.get("scales"), schema, bad)
        )

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
                # The size it has (+1: it may have grown, then up to the cap): read(cap) alone reserves 1 GiB.
                data = b"" if too_big else f.read(st.st_size + 1)
                if len(data) > st.st_size:
                    data += f.read(MAX_ARTIFACT_BYTES + 1 - len(data))
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
            # Each copy let go as soon as the next is made: the bytes, their text, then the parsed object.
            text = data.decode("utf-8")
            del data
            obj = json.loads(text)
            del text
            pre = cls.from_json(obj)
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


def _vocab_to_json(vocab: pa.Array) -> dict[str, str | list[str]]:
    """A vocabulary as version 2 stores it, in a few strings, never a Python object per id: an int vocabulary
    as ``{"type": "int", "ids": base64 of the little-endian int64 ids}``, a string one as ``{"type": "str",
    "offsets": base64 of the little-endian int32 offsets of each id in the text (N + 1, from 0), "text": the
    ids run together, in a list of pieces}``. Loading them is a base64 decode and an Arrow array over the bytes."""
    if pa.types.is_integer(vocab.type):
        ids = vocab.to_numpy(zero_copy_only=False).astype("<i8")
        return {"type": "int", "ids": base64.b64encode(ids.tobytes()).decode("ascii")}
    text = pc.cast(vocab, pa.large_string())
    offsets = np.frombuffer(text.buffers()[1], np.int64)[text.offset : text.offset + len(text) + 1]
    data = text.buffers()[2]
    body = memoryview(b"" if data is None else data)
    # The text in pieces of _TEXT_IDS ids: one non-Latin-1 character makes a Python string 2 or 4 bytes a
    # character as it is parsed, so only its own piece widens.
    ends = offsets[::_TEXT_IDS].tolist() + ([int(offsets[-1])] if len(text) % _TEXT_IDS else [])
    pieces = [bytes(body[a:b]).decode("utf-8") for a, b in zip(ends, ends[1:], strict=False)]
    return {
        "type": "str",
        # int32: the artifact is capped at 1 GiB, so its text is too.
        "offsets": base64.b64encode((offsets - offsets[0]).astype("<i4").tobytes()).decode("ascii"),
        "text": pieces,
    }


_TEXT_IDS = 1 << 16  # ids per piece of a string vocabulary's text


def _vocab_from_json(name: str, v: Any, bad: Callable[[str], CheckpointError]) -> pa.Array:
    """A vocabulary as ``_vocab_to_json`` wrote it, checked: int64 or string, as version 1's."""
    forms = {"int": {"type", "ids"}, "str": {"type", "offsets", "text"}}
    if type(v) is not dict or v.get("type") not in forms or v.keys() != forms[v["type"]]:
        raise bad(
            f'has vocabulary {_short(repr(name))} not of the form {{"type": "int", "ids": "..."}} '
            'or {"type": "str", "offsets": "...", "text": ["...", ...]}'
        )
    text = v.get("text", [])
    if (
        not all(type(x) is str for k, x in v.items() if k != "text")
        or type(text) is not list
        or not all(type(x) is str for x in text)
    ):
        raise bad(f"has vocabulary {_short(repr(name))} whose entries are not strings (text: a list of them)")
    try:
        if v["type"] == "int":
            ids = base64.b64decode(v["ids"], validate=True)
            if len(ids) % 8:
                raise ValueError(f"{len(ids)} bytes of ids, not a multiple of 8")
            return pa.array(np.frombuffer(ids, "<i8").astype(np.int64, copy=False), pa.int64())
        offsets = base64.b64decode(v["offsets"], validate=True)
        data = b"".join(piece.encode("utf-8") for piece in text)
        ends = np.frombuffer(offsets, "<i4")[[0, -1]] if len(offsets) >= 4 and not len(offsets) % 4 else None
        if ends is None or ends.tolist() != [0, len(data)]:
            raise ValueError(f"offsets that do not span its text of {len(data)} bytes")
        n = len(offsets) // 4 - 1
        text = pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data))
        text.validate(full=True)  # offsets in order, each id valid UTF-8
        return text
    except (ValueError, pa.ArrowException, UnicodeError) as e:  # bad base64, lone surrogates, split UTF-8
        raise bad(f"has vocabulary {_short(repr(name))} with unusable values ({_short(e)})") from None


def _vocab_from_json_v1(name: str, v: Any, bad: Callable[[str], CheckpointError]) -> pa.Array:
    """A vocabulary as version 1 wrote it (a JSON list of the ids), checked."""
    if type(v) is not dict or v.keys() != {"type", "values"} or v["type"] not in ("int", "str"):
        raise bad(
            f'has vocabulary {_short(repr(name))} not of the form {{"type": "int" or "str", "values": [...]}}'
        )
    kind = int if v["type"] == "int" else str
    if type(v["values"]) is not list or not all(type(x) is kind for x in v["values"]):
        raise bad(f"has vocabulary {_short(repr(name))} whose values are not all of type {v['type']}")
    try:
        return pa.array(v["values"], type=pa.int64() if kind is int else pa.string())
    except (pa.ArrowException, OverflowError, UnicodeError) as e:  # ids beyond int64, lone surrogates
        raise bad(f"has vocabulary {_short(repr(name))} with unusable values ({_short(e)})") from None


def _scales_from_json(
    obj: Any, schema: Schema, bad: Callable[[str], CheckpointError]
) -> dict[str, tuple[float, float]]:
    """The ``scales`` of an artifact (absent: none), checked against its schema's scaled features."""
    wanted = {d.name: d.scale for d in scaled_features(schema)}
    if obj is None and not wanted:
        return {}
    if type(obj) is not dict or obj.keys() != wanted.keys():
        got = sorted(obj) if type(obj) is dict else "none" if obj is None else f"none ({type(obj).__name__})"
        raise bad(f"has scales for {_short(got)}, its schema scales {_short(sorted(wanted))}")
    scales = {}
    for name, kind in wanted.items():
        keys, v = _SCALE_KEYS[kind], obj[name]
        if type(v) is not dict or v.keys() != set(keys):
            raise bad(
                f"has scale {_short(repr(name))} not of the form {{{', '.join(map(repr, keys))}: number}}"
            )
        a, b = (v[k] for k in keys)
        # An int beyond float64's range (JSON allows any) would overflow float(): compared exactly instead.
        numbers = all(
            type(x) is float and math.isfinite(x) or type(x) is int and abs(x) < 2**1023 for x in (a, b)
        )
        if not numbers or not (b >= 0 if kind == "standard" else b >= a):
            raise bad(f"has scale {_short(repr(name))} with unusable statistics {_short(v)}")
        scales[name] = (float(a), float(b))
    return scales


def _short(x: object, limit: int = 120) -> str:
    """``x`` as text fit for a one-line message (artifact contents can hold newlines or be huge)."""
    text = " ".join(str(x).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
