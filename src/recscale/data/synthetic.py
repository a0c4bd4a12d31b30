"""The built-in synthetic CTR dataset: Zipf ids, labels drawn from a known teacher, so a known LogLoss floor.

Features (``synthetic_schema``), in the raw layout of ``recscale.data.schema``:

- ``s0 .. s{num_sparse-1}``: one int64 id per row in ``[0, vocab)``, drawn Zipf-like: the id of rank ``r``
  (1-based) has probability ``∝ r^-zipf_alpha``; ranks map to ids by a fixed affine permutation, so id
  order says nothing about frequency;
- ``m0 .. m{num_multi-1}``: a ``list<int64>`` of ``1 + Poisson(pooling_factor - 1)`` Zipf ids;
- ``d0 .. d{num_dense-1}``: float32, standard normal;
- ``h0 .. h{num_history-1}``: sequence features (``max_len = history_max_len``): a ``list<int64>`` of Zipf
  ids, a user history, whose length is itself skewed: ``P(length = k) ∝ (k + 1)^-history_alpha`` for
  ``k`` in ``0..history_max_len`` (most histories short or empty, a few long);
- ``label``: float32, ``Bernoulli(p)`` with ``p = sigmoid(logit)`` from the teacher.

The teacher has one *field* per feature (sparse, multi, dense, F in all) and gives every row a latent
vector ``e_f`` (``teacher_dim``) and a scalar ``b_f`` per field:

- sparse field: a table lookup, ``e_f = V_f[id]``, ``b_f = B_f[id]`` (entries standard normal);
- multi field: the mean of its ids' ``V_f`` rows and ``B_f`` entries;
- history field: the same mean over the history (zero for an empty history), so the label depends on it;
- dense field: ``e_f = x_f * u_f`` (a fixed normal vector ``u_f``), ``b_f = x_f``.

Its terms are grouped by order: order 1 has one term per field, ``b_f``; each order ``k`` in
``2..interaction_order`` has ``num_interactions`` distinct random ``k``-subsets ``S`` of fields (all of them
if there are fewer), with term ``Σ_t Π_{f∈S} e_f[t]`` (a dot product for pairs). Then

    logit = intercept + Σ_k Σ_{S of order k} c_S · term_S

where each term is scaled to unit variance times a random importance weight (exponential), and each order
is scaled to the same standard deviation ``logit_scale / sqrt(interaction_order)``, so every order holds
an equal share of the logit's variance and the effects inside an order range from large to small. The
scales and the ``intercept`` (set so the mean of ``p`` is ``base_ctr``) are measured on a calibration
sample. ``logit_scale`` sets how far the Bayes LogLoss (``bayes_logloss``, the mean binary entropy of
``p``) lies below the background entropy ``H(base_ctr)``: 0 makes labels pure noise. Rare ids keep their
own random vectors, so a model needs many rows (and capacity) to approach the floor, as with real data.

The deep teacher (``teacher: {kind: deep}``) replaces the interaction terms by a fixed random network over
the concatenated field vectors ``h_0 = [e_1, ..., e_F]``: layer ``l`` computes ``u ⊙ v`` with
``u = W_l h_{l-1}``, ``v = W'_l h_{l-1}`` (standard normal weights over ``sqrt(fan_in)``), each row
rescaled to unit RMS so depth does not blow up the tails; its ``width`` units are the terms of level
``l``, a polynomial of order ``2^l`` in the field vectors before the rescaling. Level 0 is the order-1
``b_f`` as above, and each level gets an equal share of the logit's variance as the orders do. With
small vocabularies the tables are learnt early, and what is left to learn is this high-order function:
a target that rewards dense capacity. ``interaction_order`` and ``num_interactions`` are then unused.

Determinism: the teacher depends only on the spec without ``rows`` (seed, field layout, knobs). Rows are
made in blocks of ``BLOCK_ROWS``, block ``i`` of split ``s`` from its own generator
``default_rng([seed, 2, crc32(s), i])``, so any block can be made on its own, a split's first rows do not
depend on its length, and ``chunk_rows`` only changes how rows are cut into record batches.

Memory: the teacher holds ``(teacher_dim + 1)`` float32 per id of every sparse field.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
import pyarrow as pa
from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from recscale.data.chunks import rechunk
from recscale.data.schema import LABEL, DenseFeature, Schema, SparseFeature
from recscale.settings import Settings

# Rows per random stream: the unit of determinism, independent of the output chunk size.
BLOCK_ROWS = 16384
# Rows of the sample that measures the teacher's term scales and intercept.
_CALIBRATION_ROWS = 4 * BLOCK_ROWS
# First words of the seed sequences, keeping the teacher, calibration and split streams apart.
_TEACHER, _CALIBRATION, _SPLIT = 0, 1, 2


class DeepTeacher(Settings):
    """A fixed random network of multiplicative layers in place of the interaction terms."""

    kind: Literal["deep"]
    # Layers of the network: level l is of order 2^l in the field vectors.
    num_layers: int = Field(3, ge=1)
    # Units per layer: the number of terms of each level.
    width: int = Field(64, ge=1)


class SyntheticSpec(Settings):
    """Size, shape and difficulty of the synthetic dataset."""

    seed: int = Field(0, ge=0)
    # Rows per split; any split name works.
    rows: dict[str, Annotated[int, Field(ge=0)]] = {"train": 200_000, "valid": 20_000, "test": 20_000}
    # Single-id categorical fields.
    num_sparse: int = Field(16, ge=0)
    # Vocabulary size per sparse field, single fields first, then multi fields (int = same for all).
    vocab_sizes: int | list[int] = 1000
    # Ids drawn Zipf-like: P(rank r) ∝ r^-zipf_alpha over the vocabulary.
    zipf_alpha: float = Field(1.1, ge=0.0)
    # Multi-id fields (a list of ids per row).
    num_multi: int = Field(2, ge=0)
    # Mean list length of multi-id fields: 1 + Poisson(pooling_factor - 1).
    pooling_factor: float = Field(3.0, ge=1.0)
    num_dense: int = Field(4, ge=0)
    # Latent dimension of the teacher's id vectors.
    teacher_dim: int = Field(8, ge=1)
    # Highest order of feature interactions in the teacher (1 = linear only).
    interaction_order: int = Field(3, ge=1)
    # Interaction terms per order >= 2 (capped by the number of distinct field subsets).
    num_interactions: int = Field(16, ge=1)
    # Standard deviation of the logit around its intercept: how predictable labels are.
    logit_scale: float = Field(2.0, ge=0.0)
    # Mean click probability.
    base_ctr: float = Field(0.25, gt=0.0, lt=1.0)
    # None: the interaction teacher above; {kind: deep, ...}: the deep teacher.
    teacher: DeepTeacher | None = None
    # Sequence fields (user histories) with Zipf-skewed lengths, drawn from vocabularies of history_vocab.
    num_history: int = Field(0, ge=0)
    history_max_len: int = Field(64, ge=1)
    history_alpha: float = Field(1.2, ge=0.0)
    history_vocab: int = Field(1000, ge=2)

    @model_serializer(mode="wrap")
    def _drop_default_teacher(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Specs without a teacher or histories dump as before, so the fingerprints of existing data stay valid.
        data: dict[str, Any] = handler(self)
        if self.teacher is None:
            data.pop("teacher", None)
        if self.num_history == 0:
            for key in ("num_history", "history_max_len", "history_alpha", "history_vocab"):
                data.pop(key, None)
        return data

    @model_validator(mode="after")
    def _check_layout(self) -> SyntheticSpec:
        n_ids = self.num_sparse + self.num_multi
        if isinstance(self.vocab_sizes, list) and len(self.vocab_sizes) != n_ids:
            raise ValueError(
                f"vocab_sizes lists {len(self.vocab_sizes)} sizes for {n_ids} sparse fields "
                "(num_sparse + num_multi)"
            )
        if any(v < 2 for v in self.field_vocab_sizes):
            raise ValueError("every vocab size must be at least 2")
        if self.num_fields == 0:
            raise ValueError("the spec has no features: set num_sparse, num_multi or num_dense above 0")
        # Keys another setting leaves unread: they were dropped without a word. (Compared with the defaults: a
        # run's config.yaml holds every key but the history ones without histories.)
        changed = [k for k in type(self).model_fields if self.changed(k)]
        unread = {
            "num_history=0 (no history field)": [k for k in changed if k.startswith("history_")]
            if self.num_history == 0 else [],
            "the deep teacher": [k for k in changed if k in ("interaction_order", "num_interactions")]
            if self.teacher is not None else [],
            "interaction_order=1 (linear terms only)": ["num_interactions"]
            if self.interaction_order == 1 and "num_interactions" in changed else [],
        }  # fmt: skip
        for why, keys in unread.items():
            if keys:
                raise ValueError(f"{keys[0]} is not read with {why}; drop it")
        if self.interaction_order > self.num_fields:
            raise ValueError(
                f"interaction_order={self.interaction_order} exceeds the number of fields ({self.num_fields})"
            )
        return self

    @property
    def field_vocab_sizes(self) -> list[int]:
        """Vocabulary size of each id field: single fields, then multi fields, then history fields."""
        sizes = (
            [self.vocab_sizes] * (self.num_sparse + self.num_multi)
            if isinstance(self.vocab_sizes, int)
            else list(self.vocab_sizes)
        )
        return sizes + [self.history_vocab] * self.num_history

    @property
    def num_fields(self) -> int:
        """Fields of the teacher: one per sparse, multi, dense and history feature."""
        return self.num_sparse + self.num_multi + self.num_dense + self.num_history


def synthetic_schema(spec: SyntheticSpec) -> Schema:
    """Schema of the synthetic data: ``s*`` single ids, ``m*`` multi ids, ``d*`` dense (no transform)."""
    return Schema(
        dense=[DenseFeature(name=f"d{j}") for j in range(spec.num_dense)],
        sparse=[SparseFeature(name=f"s{i}") for i in range(spec.num_sparse)]
        + [SparseFeature(name=f"m{i}", multi=True) for i in range(spec.num_multi)]
        + [
            SparseFeature(name=f"h{i}", multi=True, max_len=spec.history_max_len)
            for i in range(spec.num_history)
        ],
    )


def synthetic_batches(spec: SyntheticSpec, split: str, chunk_rows: int = 65536) -> Iterator[pa.RecordBatch]:
    """Rows of ``split`` in the raw layout, ``chunk_rows`` per batch (the last one shorter)."""
    schema = synthetic_schema(spec)
    batches = (
        _record_batch(schema, features, labels).slice(0, n)
        for features, _, labels, n in _split_blocks(spec, split)
    )
    return rechunk(batches, chunk_rows, pa.concat_batches)


def teacher_probabilities(spec: SyntheticSpec, split: str, chunk_rows: int = 65536) -> Iterator[np.ndarray]:
    """The teacher's click probability (float64) of each row, chunked as ``synthetic_batches``."""
    probs = (_sigmoid(logits[:n]) for _, logits, _, n in _split_blocks(spec, split))
    return rechunk(probs, chunk_rows, np.concatenate)


def bayes_logloss(spec: SyntheticSpec, split: str) -> float:
    """Mean binary entropy of the teacher's probabilities on ``split``: the LogLoss no model can beat."""
    total, rows = 0.0, 0
    for _, logits, _, n in _split_blocks(spec, split):
        z = logits[:n]
        # H(sigmoid(z)) = softplus(z) - sigmoid(z) * z, stable for any z.
        total += float(np.sum(np.logaddexp(0.0, z) - _sigmoid(z) * z))
        rows += n
    if rows == 0:
        raise ValueError(f"split '{split}' has no rows")
    return total / rows


@dataclass(frozen=True)
class _Structure:
    """The teacher's random tables and interaction subsets: what raw terms are computed from."""

    cdfs: list[np.ndarray]  # per sparse field: Zipf CDF over ranks
    id_maps: list[tuple[int, int]]  # per sparse field: (a, b) with id = (a * rank + b) % vocab
    biases: list[np.ndarray]  # per sparse field: (vocab,) float32
    vectors: list[np.ndarray]  # per sparse field: (teacher_dim, vocab) float32, ids along the last axis
    dense_vectors: np.ndarray  # (num_dense, teacher_dim) float32
    subsets: list[np.ndarray]  # per order 2..interaction_order: (terms, order) field indices
    layers: list[tuple[np.ndarray, np.ndarray]]  # deep teacher, per layer: (W, W') (width, fan_in) float32


@dataclass(frozen=True)
class _Teacher:
    structure: _Structure
    coefs: list[np.ndarray]  # per order (deep: per level): weight of each raw term
    intercept: float


@dataclass(frozen=True)
class _Features:
    singles: list[np.ndarray]  # per single field: (n,) int64 ids
    multis: list[tuple[np.ndarray, np.ndarray]]  # per multi field: (n + 1,) int32 offsets, int64 ids
    dense: np.ndarray  # (n, num_dense) float32
    histories: list[tuple[np.ndarray, np.ndarray]]  # per history field: offsets, ids (lists may be empty)


def _split_blocks(spec: SyntheticSpec, split: str) -> Iterator[tuple[_Features, np.ndarray, np.ndarray, int]]:
    """Full blocks of ``split`` as (features, logits, labels, rows of the block that belong to the split).

    Checks the split and builds the teacher at once, so a bad call fails where it is made.
    """
    if split not in spec.rows:
        raise KeyError(f"unknown split '{split}'; the spec has {sorted(spec.rows)}")
    teacher = _teacher(spec.model_dump_json(exclude={"rows"}))
    n_rows, split_key = spec.rows[split], zlib.crc32(split.encode())
    return (
        (*_block(spec, teacher, [spec.seed, _SPLIT, split_key, i]), min(BLOCK_ROWS, n_rows - i * BLOCK_ROWS))
        for i in range(math.ceil(n_rows / BLOCK_ROWS))
    )


def _block(
    spec: SyntheticSpec, teacher: _Teacher, seed: list[int]
) -> tuple[_Features, np.ndarray, np.ndarray]:
    """``BLOCK_ROWS`` rows from the generator seeded with ``seed``: features, logits, labels."""
    rng = np.random.default_rng(seed)
    features = _draw_features(spec, teacher.structure, rng, BLOCK_ROWS)
    logits = _logits(teacher, _raw_terms(teacher.structure, features))
    # Labels are drawn after the features, so specs that differ only in teacher knobs share the features.
    labels = (rng.random(BLOCK_ROWS) < _sigmoid(logits)).astype(np.float32)
    return features, logits, labels


# One teacher is kept: with large vocabularies it holds a lot of memory.
@functools.lru_cache(maxsize=1)
def _teacher(spec_json: str) -> _Teacher:
    """Build and calibrate the teacher of a spec (given as JSON so it can be cached)."""
    spec = SyntheticSpec.model_validate_json(spec_json)
    rng = np.random.default_rng([spec.seed, _TEACHER])
    d = spec.teacher_dim
    cdfs: dict[int, np.ndarray] = {}
    id_maps, biases, vectors = [], [], []
    for vocab in spec.field_vocab_sizes:
        if vocab not in cdfs:
            cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -spec.zipf_alpha)
            cdfs[vocab] = cdf / cdf[-1]
            cdfs[vocab][-1] = 1.0  # uniforms in [0, 1) then always land on a valid rank
        a = int(rng.integers(1, vocab))
        while math.gcd(a, vocab) != 1:  # a coprime multiplier makes the affine map a permutation
            a = int(rng.integers(1, vocab))
        id_maps.append((a, int(rng.integers(0, vocab))))
        biases.append(rng.standard_normal(vocab, dtype=np.float32))
        vectors.append(rng.standard_normal((d, vocab), dtype=np.float32))
    dense_vectors = rng.standard_normal((spec.num_dense, d), dtype=np.float32)
    deep = spec.teacher
    subsets = (
        []
        if deep
        else [
            _random_subsets(rng, spec.num_fields, k, spec.num_interactions)
            for k in range(2, spec.interaction_order + 1)
        ]
    )
    layers = []
    if deep:
        fan_in = spec.num_fields * d
        for _ in range(deep.num_layers):
            w = rng.standard_normal((2, deep.width, fan_in), dtype=np.float32) / np.float32(math.sqrt(fan_in))
            layers.append((w[0], w[1]))
            fan_in = deep.width
    structure = _Structure(
        cdfs=[cdfs[v] for v in spec.field_vocab_sizes],
        id_maps=id_maps,
        biases=biases,
        vectors=vectors,
        dense_vectors=dense_vectors,
        subsets=subsets,
        layers=layers,
    )

    # Calibrate on a sample from its own stream: unit-variance terms times importance weights, each order
    # scaled to the same share of the logit's standard deviation.
    cal_rng = np.random.default_rng([spec.seed, _CALIBRATION])
    raw = _raw_terms(structure, _draw_features(spec, structure, cal_rng, _CALIBRATION_ROWS))
    order_std = spec.logit_scale / math.sqrt(len(raw))
    coefs = []
    for terms in raw:
        importance = rng.exponential(size=terms.shape[0])
        std = terms.std(axis=1, dtype=np.float64)
        c = np.divide(importance, std, out=np.zeros_like(importance), where=std > 0)
        current = (c @ terms).std()
        coefs.append(c * (order_std / current) if current > 0 else c)
    intercept = _solve_intercept(_logits(_Teacher(structure, coefs, 0.0), raw), spec.base_ctr)
    return _Teacher(structure, coefs, intercept)


def _random_subsets(rng: np.random.Generator, n_fields: int, order: int, count: int) -> np.ndarray:
    """``count`` distinct sorted ``order``-subsets of fields (all of them if there are fewer)."""
    count = min(count, math.comb(n_fields, order))
    chosen: dict[tuple[int, ...], None] = {}  # a dict keeps the draw order, so the result is deterministic
    while len(chosen) < count:
        chosen[tuple(sorted(rng.choice(n_fields, order, replace=False).tolist()))] = None
    return np.array(list(chosen), dtype=np.int64).reshape(count, order)


def _solve_intercept(logits: np.ndarray, base_ctr: float) -> float:
    """The shift ``b`` with mean(sigmoid(logits + b)) = base_ctr, by bisection (the mean is monotone in b)."""
    lo, hi = -60.0, 60.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if _sigmoid(logits + mid).mean() < base_ctr:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _draw_features(spec: SyntheticSpec, structure: _Structure, rng: np.random.Generator, n: int) -> _Features:
    """``n`` rows of features; the draw order is fixed, so the bytes depend only on ``rng``'s seed."""

    def zipf_ids(field: int, size: int) -> np.ndarray:
        ranks = np.searchsorted(structure.cdfs[field], rng.random(size), side="right")
        a, b = structure.id_maps[field]
        return (a * ranks + b) % len(structure.cdfs[field])

    singles = [zipf_ids(f, n) for f in range(spec.num_sparse)]
    multis = []
    for f in range(spec.num_sparse, spec.num_sparse + spec.num_multi):
        lengths = 1 + rng.poisson(spec.pooling_factor - 1.0, n)
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        multis.append((offsets, zipf_ids(f, int(offsets[-1]))))
    dense = rng.standard_normal((n, spec.num_dense), dtype=np.float32)
    histories = []  # drawn last: specs without histories keep their streams
    if spec.num_history:
        pmf = np.arange(1, spec.history_max_len + 2, dtype=np.float64) ** -spec.history_alpha
        length_cdf = np.cumsum(pmf / pmf.sum())
        length_cdf[-1] = 1.0
    for f in range(spec.num_sparse + spec.num_multi, spec.num_sparse + spec.num_multi + spec.num_history):
        lengths = np.searchsorted(length_cdf, rng.random(n), side="right")
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        histories.append((offsets, zipf_ids(f, int(offsets[-1]))))
    return _Features(singles, multis, dense, histories)


def _raw_terms(structure: _Structure, features: _Features) -> list[np.ndarray]:
    """Unscaled teacher terms, one (terms, n) array per order 1..interaction_order (deep: per level)."""
    # Rows run along the last axis throughout, so products and sums over teacher_dim are long vector ops.
    linear, latent = _field_vectors(structure, features)
    terms = [np.stack(linear)]
    for subsets in structure.subsets:
        # One term at a time: its (teacher_dim, n) temporaries stay in cache, unlike a gather of all terms.
        order_terms = np.empty((len(subsets), len(linear[0])), dtype=np.float32)
        for m, (first, second, *rest) in enumerate(subsets):
            prod = latent[first] * latent[second]
            for f in rest:
                prod *= latent[f]
            prod.sum(axis=0, out=order_terms[m])
        terms.append(order_terms)
    if structure.layers:
        terms += _deep_levels(structure.layers, np.concatenate(latent))
    return terms


def _deep_levels(layers: list[tuple[np.ndarray, np.ndarray]], h: np.ndarray) -> list[np.ndarray]:
    """The deep teacher's units, one (width, n) array per layer, from the field vectors ``h`` (F·d, n)."""
    levels = []
    for w, w2 in layers:
        h = (w @ h) * (w2 @ h)
        h /= np.sqrt(np.mean(np.square(h), axis=0)) + np.float32(1e-6)  # unit RMS per row
        levels.append(h)
    return levels


def _field_vectors(structure: _Structure, features: _Features) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per field, its scalar ``b_f`` (n,) and latent vector ``e_f`` (teacher_dim, n) of each row."""
    linear, latent = [], []
    for f, ids in enumerate(features.singles):
        linear.append(structure.biases[f][ids])
        latent.append(np.take(structure.vectors[f], ids, axis=1))
    for i, (offsets, ids) in enumerate(features.multis):
        f = len(features.singles) + i
        # Lists are never empty, so reduceat's segments are exactly the rows' lists: mean pooling.
        lengths = np.diff(offsets).astype(np.float32)
        linear.append(np.add.reduceat(structure.biases[f][ids], offsets[:-1]) / lengths)
        latent.append(
            np.add.reduceat(np.take(structure.vectors[f], ids, axis=1), offsets[:-1], axis=1) / lengths
        )
    for j in range(features.dense.shape[1]):
        x = features.dense[:, j]
        linear.append(x)
        latent.append(structure.dense_vectors[j][:, None] * x)
    for i, (offsets, ids) in enumerate(features.histories):
        f = len(features.singles) + len(features.multis) + i
        # Histories may be empty: mean by bincount (0 for an empty one), not reduceat.
        sizes = np.diff(offsets)
        owner, n = np.repeat(np.arange(len(sizes)), sizes), len(sizes)
        scale = 1.0 / np.maximum(sizes, 1).astype(np.float32)
        linear.append((np.bincount(owner, structure.biases[f][ids], n) * scale).astype(np.float32))
        vectors = np.take(structure.vectors[f], ids, axis=1)
        latent.append(np.stack([np.bincount(owner, v, n) for v in vectors]).astype(np.float32) * scale)
    return linear, latent


def _logits(teacher: _Teacher, raw: list[np.ndarray]) -> np.ndarray:
    """The teacher's logit (float64) of each row from its raw terms."""
    return teacher.intercept + sum(c @ terms for terms, c in zip(raw, teacher.coefs, strict=True))


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # tanh form: no overflow warning for large |z|


def _record_batch(schema: Schema, features: _Features, labels: np.ndarray) -> pa.RecordBatch:
    """Features and labels as one record batch in the raw layout, columns in ``schema.column_names()``."""
    columns = {LABEL: pa.array(labels)}
    for j, name in enumerate(schema.dense_names):
        columns[name] = pa.array(features.dense[:, j])
    n_singles = len(features.singles)
    for ids, name in zip(features.singles, schema.sparse_names[:n_singles], strict=True):
        columns[name] = pa.array(ids)
    lists = features.multis + features.histories
    for (offsets, ids), name in zip(lists, schema.sparse_names[n_singles:], strict=True):
        columns[name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids, pa.int64()))
    return pa.RecordBatch.from_pydict(columns)
