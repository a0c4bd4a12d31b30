"""Materialising a split: raw record batches -> the column files ``ArrayDataset`` reads, in one pass
over the source, fitting the vocabularies on the way for the training split.

Whatever does not depend on a vocabulary (label, dense values, offsets, weights, hashed ids) is
written to its file as each batch arrives. A vocabulary field's ids are dictionary-encoded per batch,
their one hash pass: the codes go to a scratch file, the batch's distinct ids to an Arrow IPC scratch
file and, when fitting, their counts (a bincount of the codes) to a ``VocabCounter``. Once the source
is read, each field's codes are mapped block by block: one ``index_in`` of the block's distinct ids
against the vocabulary (its hash set is built once per block, not once per batch), then a numpy take.
The source is parsed once, and memory holds a few batches and one block, whatever the file's size.
"""

from __future__ import annotations

import json
import shutil
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
    Preprocessor,
    VocabCounter,
    dense_matrix,
    hashed_ids,
    values_and_lengths,
)
from recscale.data.schema import LABEL, WEIGHT_SUFFIX, Schema
from recscale.errors import DataError
from recscale.io import atomic_dir

# Ids mapped per index_in call: big enough that building the vocabulary's hash set is amortised,
# small enough to bound memory (int32 codes + int64 positions and ids: ~80 MB).
BLOCK_IDS = 1 << 22


def progress_bar(enabled: bool, desc: str, unit: str = " rows", total: int | None = None) -> Any:
    """A tqdm bar on the terminal, or None."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(desc=desc, unit=unit, unit_scale=unit == " rows", total=total, leave=False)


class _Spill:
    """One vocabulary field's codes and per-batch dictionaries, on disk until its vocabulary is known.

    A null id has the code ``len(distinct)``: one past the batch's distinct ids, which maps to OOV."""

    def __init__(self, scratch: Path, name: str, stack: ExitStack) -> None:
        self.codes_path, self.dicts_path = scratch / f"{name}.codes", scratch / f"{name}.dicts"
        self.codes = stack.enter_context(open(self.codes_path, "wb"))
        self.sink = stack.enter_context(pa.OSFile(str(self.dicts_path), "wb"))
        self.writer: pa.ipc.RecordBatchFileWriter | None = None
        self.sizes: list[int] = []  # ids per batch

    def add(self, codes: np.ndarray, distinct: pa.Array) -> None:
        self.codes.write(codes.tobytes())
        if self.writer is None:
            self.writer = pa.ipc.new_file(self.sink, pa.schema([("ids", distinct.type)]))
        self.writer.write_batch(pa.record_batch([distinct], names=["ids"]))
        self.sizes.append(len(codes))

    def map_to(self, pre: Preprocessor, name: str, out: IO[bytes]) -> None:
        """Write the field's vocabulary ids (int64), in row order, to ``out``."""
        if self.writer is None:
            return
        self.writer.close()
        self.sink.close()
        self.codes.close()
        codes = np.memmap(self.codes_path, np.int32, "r") if sum(self.sizes) else np.zeros(0, np.int32)
        with pa.memory_map(str(self.dicts_path)) as source:
            reader = pa.ipc.open_file(source)
            first, start = 0, 0
            while first < len(self.sizes):
                last, n = first + 1, self.sizes[first]
                while last < len(self.sizes) and n + self.sizes[last] <= BLOCK_IDS:
                    n += self.sizes[last]
                    last += 1
                dicts = [reader.get_batch(i).column(0) for i in range(first, last)]
                lens = np.array([len(d) for d in dicts], dtype=np.int64)
                ids = pre.lookup(name, pa.concat_arrays(dicts))
                # Each batch's slice of ``ids`` followed by its null slot (OOV).
                ends = np.cumsum(lens)
                table = np.insert(ids, ends, OOV)
                base = np.repeat(ends - lens + np.arange(len(lens)), self.sizes[first:last])
                out.write(table[codes[start : start + n].astype(np.int64) + base].tobytes())
                first, start = last, start + n


@dataclass
class _Encoded:
    """One batch, preprocessed as far as it can be without the vocabularies: file name -> array."""

    rows: int
    arrays: dict[str, np.ndarray]
    codes: dict[str, tuple[np.ndarray, pa.Array, np.ndarray]]  # field -> (codes, distinct ids, counts)


def _encode(batch: pa.RecordBatch, schema: Schema) -> _Encoded:
    """The per-batch work, run in worker threads (pyarrow and numpy release the GIL)."""
    label = batch.column(LABEL).to_numpy(zero_copy_only=False).astype(np.float32)
    arrays = {"label": label, "dense": dense_matrix(batch, schema)}
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
    return _Encoded(batch.num_rows, arrays, codes)


def materialize(
    batches: Iterable[pa.RecordBatch],
    schema: Schema,
    out_dir: Path,
    *,
    pre: Preprocessor | None = None,
    fingerprint: Callable[[Preprocessor], str] = lambda _: "",
    progress: bool = False,
) -> Preprocessor:
    """Preprocess ``batches`` into a split directory at ``out_dir`` (written atomically: a failure
    leaves no directory that looks complete). With ``pre`` None the vocabularies are fitted on these
    batches (the training split) and the fitted ``Preprocessor`` is returned; else ``pre`` maps them.
    ``fingerprint(pre)`` is stored in meta.json."""
    vocab_fields = [f for f in schema.sparse if f.hash_buckets is None]
    counter = VocabCounter(schema) if pre is None else None
    rows = 0
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
            files |= {k: stack.enter_context(open(tmp / f"{k}.bin", "wb")) for k in ("label", "dense")}
            spills = {f.name: _Spill(scratch, f.name, stack) for f in vocab_fields}
            offsets_end = {f.name: 0 for f in schema.sparse if f.multi}
            for f in schema.sparse:
                if f.multi:
                    files[f"{f.name}.offsets"].write(np.zeros(1, np.int64).tobytes())
            bar = progress_bar(progress, f"reading {out_dir.name}")
            if bar is not None:
                stack.callback(bar.close)
            for enc in ordered_map(lambda batch: _encode(batch, schema), batches):
                for name, array in enc.arrays.items():
                    if name.endswith(".offsets"):
                        field = name.removesuffix(".offsets")
                        array = array + offsets_end[field]
                        offsets_end[field] = int(array[-1]) if len(array) else offsets_end[field]
                    files[name].write(array.tobytes())
                for name, (codes, distinct, counts) in enc.codes.items():
                    spills[name].add(codes, distinct)
                    if counter is not None:
                        counter.add(name, distinct, counts)
                rows += enc.rows
                if bar is not None:
                    bar.update(enc.rows)
            if rows == 0:
                raise DataError(f"{out_dir.name}: the data source produced no rows")
            if pre is None:
                assert counter is not None
                pre = counter.fit()
            map_bar = progress_bar(progress, f"mapping ids {out_dir.name}", " fields", len(vocab_fields))
            if map_bar is not None:
                stack.callback(map_bar.close)
            for f in vocab_fields:
                with open(tmp / f"{f.name}.values.bin", "wb") as out:
                    spills[f.name].map_to(pre, f.name, out)
                if map_bar is not None:
                    map_bar.update(1)
        shutil.rmtree(scratch)
        meta = {
            "version": FORMAT_VERSION,
            "rows": rows,
            "num_dense": len(schema.dense),
            "sparse": [{"name": f.name, "multi": f.multi, "weighted": f.weighted} for f in schema.sparse],
            "fingerprint": fingerprint(pre),
        }
        (tmp / "meta.json").write_text(json.dumps(meta))
    return pre
