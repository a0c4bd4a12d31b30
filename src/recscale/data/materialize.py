"""Materialising a split: raw record batches -> the column files ``ArrayDataset`` reads, in one pass
over the source, fitting the vocabularies on the way for the training split.

Whatever does not depend on a vocabulary (label, row weight, dense values, offsets, weights, hashed ids) is
written to its file as each batch arrives. A vocabulary field's ids are dictionary-encoded per batch
(in worker threads): the codes go to a scratch file, the batch's distinct ids are kept until a block
of them is pending. A block is then numbered in one hash pass: when fitting, against every id seen so
far (``dictionary_encode`` of them followed by the block, so earlier ids keep their numbers), the
counts summed with a bincount; when mapping, looked up in the vocabulary with one ``index_in``. That
number of each batch's distinct ids goes to a second scratch file. Once the source is read, the
vocabulary is sorted in numpy from the counts, and each field's codes become vocabulary ids with
two numpy takes: no id is hashed again; fields are fitted and mapped side by side in threads. Memory
holds a few batches, up to one block of pending ids per sparse field (``BLOCK_IDS``; a wide schema's
fields together can hold ~80 MB each at once) and (when fitting) the distinct ids with their counts,
whatever the file's size.

A scaled dense feature's statistics are likewise known only once the training split is read: its column is
written filled and transformed, its moments summed per batch, and ``dense.bin`` is scaled in place at the end.
Other splits are scaled as they are written, with the fitted statistics.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recscale.data.chunks import ordered_map
from recscale.data.dataset import FORMAT_VERSION
from recscale.data.preprocess import (
    OOV,
    DenseMoments,
    Preprocessor,
    dense_matrix,
    fit_scales,
    hashed_ids,
    scaled_features,
    values_and_lengths,
    vocabulary_order,
)
from recscale.data.readers import ReadStats
from recscale.data.schema import LABEL, WEIGHT, WEIGHT_SUFFIX, Schema, SparseFeature
from recscale.errors import DataError
from recscale.io import atomic_dir

# Distinct ids numbered per block: big enough to amortise a block's fixed costs (when mapping, building
# the vocabulary's hash set), small enough to bound memory (~80 MB of ids and numbers).
BLOCK_IDS = 1 << 22
# Rows of dense.bin scaled at a time once a training split's statistics are known.
SCALE_ROWS = 1 << 16


def progress_bar(
    enabled: bool,
    desc: str,
    unit: str = " rows",
    total: int | None = None,
    initial: int = 0,
    leave: bool = False,
) -> Any:
    """A tqdm bar on the terminal, or None (a disabled tqdm bar still starts tqdm's monitor thread)."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(desc=desc, unit=unit, unit_scale=unit == " rows", total=total, initial=initial, leave=leave)


def _warn_empty_vocabulary(f: SparseFeature, spill: _Spill) -> None:
    """A vocabulary fitted empty maps every row to the OOV id: the feature's one embedding is a constant,
    which trained without a word (all ids under min_count, or a column of missing values)."""
    seen = 0 if spill.seen is None else len(spill.seen)
    why, fix = (
        (f"none of its {seen} distinct id{'s' * (seen != 1)} occurs min_count={f.min_count} times (the most "
         f"frequent: {int(spill.counts.max())})", "lower its min_count")
        if seen
        else ("every value is missing", "check the column")
    )  # fmt: skip
    warnings.warn(
        f"sparse feature '{f.name}': in the training split {why}, so its vocabulary is empty and every row maps "
        f"to the out-of-vocabulary id: the feature carries no information; {fix}",
        stacklevel=2,
    )


class _Spill:
    """One vocabulary field's per-batch codes and the numbers of each batch's distinct ids, on disk
    until its vocabulary is known.

    A null id has the code ``len(distinct)``: one past the batch's distinct ids, which maps to OOV.
    Fitting (``pre`` None), a distinct id is numbered by its first appearance in the split
    (``seen[number]``), its sightings summed in ``counts``; mapping, it is numbered by its
    vocabulary id."""

    def __init__(self, scratch: Path, name: str, stack: ExitStack, pre: Preprocessor | None) -> None:
        self.name, self.pre = name, pre
        self.codes_path, self.numbers_path = scratch / f"{name}.codes", scratch / f"{name}.numbers"
        self.codes = stack.enter_context(open(self.codes_path, "wb"))
        self.numbers = stack.enter_context(open(self.numbers_path, "wb"))
        self.sizes: list[int] = []  # ids per batch
        self.lens: list[int] = []  # distinct ids per batch
        self.pending: list[tuple[pa.Array, np.ndarray]] = []  # (distinct, counts) not yet numbered
        self.pending_ids = 0
        self.seen: pa.Array | None = None
        self.counts = np.zeros(0, np.int64)

    def add(self, codes: np.ndarray, distinct: pa.Array, counts: np.ndarray) -> None:
        self.codes.write(np.ascontiguousarray(codes).data)
        self.sizes.append(len(codes))
        self.lens.append(len(distinct))
        if self.seen is None:
            self.seen = distinct.slice(0, 0)  # its type is the vocabulary's
        self.pending.append((distinct, counts))
        self.pending_ids += len(distinct)
        # Fitting renumbers ``seen`` with each block: blocks at least its size keep that linear overall.
        if self.pending_ids >= max(BLOCK_IDS, len(self.seen) if self.pre is None else 0):
            self.flush()

    def flush(self) -> None:
        """Number the pending distinct ids."""
        if not self.pending:
            return
        block = pa.concat_arrays([d for d, _ in self.pending])
        if self.pre is not None:
            numbers = self.pre.lookup(self.name, block)
        else:
            assert self.seen is not None
            known = len(self.seen)
            enc = pc.dictionary_encode(pa.concat_arrays([self.seen, block]))
            numbers = enc.indices.to_numpy()[known:].astype(np.int64)
            self.seen = enc.dictionary
            # Float weights are exact: a count stays far below 2**53.
            added = np.bincount(numbers, np.concatenate([c for _, c in self.pending]), len(self.seen))
            self.counts = added.astype(np.int64) + np.pad(self.counts, (0, len(self.seen) - known))
        self.numbers.write(np.ascontiguousarray(numbers).data)
        self.pending, self.pending_ids = [], 0

    def fit(self, f: SparseFeature) -> tuple[pa.Array, np.ndarray]:
        """The field's vocabulary, and the vocabulary id (OOV if not kept) of each number."""
        self.flush()
        assert self.seen is not None
        kept = np.flatnonzero(self.counts >= f.min_count)
        order = kept[vocabulary_order(self.seen.take(pa.array(kept)), self.counts[kept])]
        if f.max_vocab is not None:
            order = order[: f.max_vocab]
        ids = np.full(len(self.seen), OOV, np.int64)
        ids[order] = np.arange(1, len(order) + 1)
        return self.seen.take(pa.array(order)), ids

    def lookup_seen(self, pre: Preprocessor) -> np.ndarray:
        """Fitting a field that takes another's vocabulary: the vocabulary id of each number."""
        self.flush()
        return np.zeros(0, np.int64) if self.seen is None else pre.lookup(self.name, self.seen)

    def map_to(self, out: IO[bytes], ids: np.ndarray | None = None) -> None:
        """Write the field's vocabulary ids (int64), in row order, to ``out``; ``ids`` (fitting) maps
        numbers to them."""
        self.flush()
        self.codes.close()
        self.numbers.close()
        if not self.sizes:
            return
        codes = np.memmap(self.codes_path, np.int32, "r") if sum(self.sizes) else np.zeros(0, np.int32)
        numbers = np.memmap(self.numbers_path, np.int64, "r") if sum(self.lens) else np.zeros(0, np.int64)
        first, start, at = 0, 0, 0
        while first < len(self.sizes):
            last, n = first + 1, self.sizes[first]
            while last < len(self.sizes) and n + self.sizes[last] <= BLOCK_IDS:
                n += self.sizes[last]
                last += 1
            lens = np.array(self.lens[first:last], dtype=np.int64)
            ends = np.cumsum(lens)
            block = numbers[at : at + int(ends[-1])]
            # Each batch's vocabulary ids followed by its null slot (OOV).
            table = np.insert(block if ids is None else ids[block], ends, OOV)
            base = np.repeat(ends - lens + np.arange(len(lens)), self.sizes[first:last])
            out.write(table[codes[start : start + n] + base].data)
            first, start, at = last, start + n, at + int(ends[-1])


@dataclass
class _Encoded:
    """One batch, preprocessed as far as it can be without the vocabularies: file name -> array."""

    rows: int
    arrays: dict[str, np.ndarray]
    codes: dict[str, tuple[np.ndarray, pa.Array, np.ndarray]]  # field -> (codes, distinct ids, counts)
    dense_given: np.ndarray  # (n_dense,) the rows whose dense value is not missing, per feature
    moments: DenseMoments | None  # fitting: the scaled features' columns, filled and transformed


def _encode(batch: pa.RecordBatch, schema: Schema, pre: Preprocessor | None) -> _Encoded:
    """The per-batch work, run in worker threads (pyarrow and numpy release the GIL). Fitting (``pre``
    None), dense values are left unscaled and the scaled columns' moments are taken."""
    label = batch.column(LABEL).to_numpy(zero_copy_only=False).astype(np.float32)
    dense = dense_matrix(batch, schema, pre)
    arrays = {"label": label, "dense": dense}
    if schema.weight is not None:
        arrays["weight"] = batch.column(WEIGHT).to_numpy(zero_copy_only=False).astype(np.float32)
    scaled = [j for j, d in enumerate(schema.dense) if d.scale != "none"]
    moments = DenseMoments.of(dense[:, scaled]) if pre is None and scaled else None
    codes = {}
    for f in schema.sparse:
        ids, lengths = values_and_lengths(batch.column(f.name))
        if not f.multi and not (lengths == 1).all():
            raise DataError(f"feature '{f.name}' has several ids in a row; declare it with multi: true")
        if f.multi:
            arrays[f"{f.name}.offsets"] = np.cumsum(lengths, dtype=np.int64)  # made absolute when written
        if f.weighted:
            w, _ = values_and_lengths(batch.column(f.name + WEIGHT_SUFFIX))
            arrays[f"{f.name}.weights"] = (
                pc.fill_null(w, 1.0).to_numpy(zero_copy_only=False).astype(np.float32)
            )
        if f.hash_buckets is not None:
            arrays[f"{f.name}.values"] = hashed_ids(ids, f.hash_buckets)
        else:  # one hash pass: the codes are mapped once the vocabulary is known, the counts fit it
            enc = pc.dictionary_encode(ids)
            distinct = enc.dictionary
            c = pc.fill_null(enc.indices, len(distinct)).to_numpy(zero_copy_only=False).astype(np.int32)
            codes[f.name] = (c, distinct, np.bincount(c, minlength=len(distinct) + 1)[:-1])
    given = np.array([batch.num_rows - batch.column(d.name).null_count for d in schema.dense], np.int64)
    return _Encoded(batch.num_rows, arrays, codes, given, moments)


def _fit_scales(
    schema: Schema, moments: DenseMoments | None, dense_given: np.ndarray
) -> dict[str, tuple[float, float]]:
    """The scaled features' statistics from the training split's ``moments``, warning of a column that is
    constant there (all its rows are then 0 once scaled; one wholly missing is warned of already)."""
    if moments is None:
        return {}
    scales = fit_scales(schema, moments)
    given = dict(zip(schema.dense_names, dense_given.tolist(), strict=True))
    for j, d in enumerate(scaled_features(schema)):
        if moments.lo[j] == moments.hi[j] and given[d.name]:
            warnings.warn(
                f"dense feature '{d.name}': in the training split every value is {moments.lo[j]:g} after fill and "
                f"transform, so scale: {d.scale} has no spread to divide by and only shifts it (to 0); the feature "
                "carries no information: check the column, or drop the feature",
                stacklevel=3,
            )
    return scales


def _scale_in_place(path: Path, rows: int, pre: Preprocessor) -> None:
    """Scale a written dense.bin ((rows, n_dense) float32) with ``pre``'s statistics, a block of rows at a
    time: the training split's values exactly as ``dense_matrix`` maps any other rows."""
    width = len(pre.schema.dense)
    dense = np.memmap(path, np.float32, "r+", shape=(rows, width))
    for start in range(0, rows, SCALE_ROWS):
        # Finite: a training value is within sqrt(rows) standard deviations of its mean, in [0, 1] for minmax.
        dense[start : start + SCALE_ROWS] = pre.scale_dense(np.array(dense[start : start + SCALE_ROWS]))
    dense.flush()
    del dense


def _check_replaceable(out_dir: Path) -> None:
    """The split replaces ``out_dir`` whole: a DataError unless that is a split written before (its
    meta.json), an empty directory or nothing, so that files of anyone else's there are never deleted."""
    if out_dir.exists() and (
        not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / "meta.json").is_file())
    ):
        raise DataError(
            f"{out_dir} exists and is not a preprocessed split (no meta.json), which writing the split there "
            "would delete; move it away, or give another --out"
        )


def materialize(
    batches: Iterable[pa.RecordBatch],
    schema: Schema,
    out_dir: Path,
    *,
    pre: Preprocessor | None = None,
    fingerprint: Callable[[Preprocessor], str] = lambda _: "",
    progress: bool = False,
    stats: ReadStats | None = None,
    source: dict[str, list[int]] | None = None,
) -> Preprocessor:
    """Preprocess ``batches`` into a split directory at ``out_dir`` (written atomically: a failure
    leaves no directory that looks complete; a directory there other than a split is refused). With
    ``pre`` None the vocabularies are fitted on these batches (the training split) and the fitted
    ``Preprocessor`` is returned; else ``pre`` maps them.
    ``fingerprint(pre)`` is stored in meta.json, and so are what the read of ``batches`` counted in ``stats``
    (bad rows dropped, sequences cut) and the ``source`` files' sizes and times, so that a later use of the
    split can report and check them."""
    vocab_fields = [f for f in schema.sparse if f.hash_buckets is None]
    fitting = pre is None
    rows = 0
    _check_replaceable(out_dir)
    with atomic_dir(out_dir) as tmp:
        scratch = tmp / ".scratch"
        scratch.mkdir()
        with ExitStack() as stack:
            files = {
                name: stack.enter_context(open(tmp / f"{name}.bin", "wb"))
                for f in schema.sparse
                for name, wanted in (
                    (f"{f.name}.values", f.hash_buckets is not None),
                    (f"{f.name}.offsets", f.multi),
                    (f"{f.name}.weights", f.weighted),
                )
                if wanted
            }
            whole = ("label", "dense", *(["weight"] if schema.weight is not None else []))
            files |= {k: stack.enter_context(open(tmp / f"{k}.bin", "wb")) for k in whole}
            spills = {f.name: _Spill(scratch, f.name, stack, pre) for f in vocab_fields}
            offsets_end = {f.name: 0 for f in schema.sparse if f.multi}
            dense_given = np.zeros(len(schema.dense), np.int64)
            moments: DenseMoments | None = None
            for f in schema.sparse:
                if f.multi:
                    files[f"{f.name}.offsets"].write(np.zeros(1, np.int64).tobytes())
            bar = progress_bar(progress, f"reading {out_dir.name}")
            if bar is not None:
                stack.callback(bar.close)
            mapping = pre  # fixed for the pass (``pre`` is the fitted one after it)
            for enc in ordered_map(lambda batch: _encode(batch, schema, mapping), batches):
                for name, array in enc.arrays.items():
                    if name.endswith(".offsets"):
                        field = name.removesuffix(".offsets")
                        array = array + offsets_end[field]
                        offsets_end[field] = int(array[-1]) if len(array) else offsets_end[field]
                    files[name].write(np.ascontiguousarray(array).data)
                for name, (codes, distinct, counts) in enc.codes.items():
                    spills[name].add(codes, distinct, counts)
                rows += enc.rows
                dense_given += enc.dense_given
                if enc.moments is not None:
                    moments = enc.moments if moments is None else moments.merge(enc.moments)
                if bar is not None:
                    bar.update(enc.rows)
            if rows == 0:
                raise DataError(f"{out_dir.name}: the data source produced no rows")
            # Each field is finished on its own (fitted, then mapped to its file), fields side by side.
            numbers: dict[str, np.ndarray] = {}
            if pre is None:
                for d, given in zip(schema.dense, dense_given, strict=True):
                    if not given:  # each row its fill: a constant, which trained without a word
                        warnings.warn(
                            f"dense feature '{d.name}': in the training split every value is missing, so every "
                            f"row holds its fill ({d.fill:g}) and the feature carries no information; check the "
                            "column",
                            stacklevel=2,
                        )
                own = [f for f in vocab_fields if f.vocabulary is None]
                vocabs = {}
                for f, (vocab, ids) in zip(
                    own, ordered_map(lambda f: spills[f.name].fit(f), own), strict=True
                ):
                    vocabs[f.name], numbers[f.name] = vocab, ids
                    if not len(vocab):
                        _warn_empty_vocabulary(f, spills[f.name])
                vocabs |= {f.name: vocabs[f.vocabulary] for f in vocab_fields if f.vocabulary is not None}
                pre = Preprocessor(schema, vocabs, scales=_fit_scales(schema, moments, dense_given))
            fitted = pre

            def write_ids(f: SparseFeature) -> None:
                ids = numbers.get(f.name)
                if fitting and f.vocabulary is not None:  # its distinct ids, in the other field's vocabulary
                    ids = spills[f.name].lookup_seen(fitted)
                with open(tmp / f"{f.name}.values.bin", "wb") as out:
                    spills[f.name].map_to(out, ids)

            map_bar = progress_bar(progress, f"mapping ids {out_dir.name}", " fields", len(vocab_fields))
            if map_bar is not None:
                stack.callback(map_bar.close)
            for _ in ordered_map(write_ids, vocab_fields):
                if map_bar is not None:
                    map_bar.update(1)
        shutil.rmtree(scratch)
        if fitting and pre.scales:  # the files are closed: dense.bin holds every row, unscaled
            _scale_in_place(tmp / "dense.bin", rows, pre)
        meta = {
            "version": FORMAT_VERSION,
            "rows": rows,
            "num_dense": len(schema.dense),
            "sparse": [{"name": f.name, "multi": f.multi, "weighted": f.weighted} for f in schema.sparse],
            "fingerprint": fingerprint(pre),
        }
        if schema.weight is not None:  # left out otherwise: a split without weights reads as before the key
            meta["weight"] = True
        if source is not None:  # the files read (sources.source_files): a resume refused names what changed
            meta["source"] = source
        if stats is not None:  # complete: the batches are all read
            meta["read"] = {
                "skipped": stats.skipped,
                "examples": stats.examples,
                "truncated": stats.truncated,
            }
        (tmp / "meta.json").write_text(json.dumps(meta))
    return pre
