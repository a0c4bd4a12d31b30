"""Preprocessed datasets on disk and the loader that turns them into ``Batch`` es.

A split is *materialised* once (``recscale.data.materialize``): raw record batches are preprocessed
into flat binary column files (one per array), described by ``meta.json``. Training then
reads them through ``numpy.memmap``: each epoch is a seeded permutation, each batch a vectorised
gather, so files larger than memory work and a run resumes at an exact (epoch, batch) position.

Layout of a materialised split directory::

    meta.json               rows, columns, dtypes, fingerprint of source + preprocessing
    label.bin               (N,) float32
    weight.bin              (N,) float32              row weights (schema.weight) only; "weight": true in meta
    dense.bin               (N, n_dense) float32
    {field}.values.bin      (total_ids,) int64
    {field}.offsets.bin     (N + 1,) int64            multi-id fields only
    {field}.weights.bin     (total_ids,) float32      weighted fields only
"""

from __future__ import annotations

import gc
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recscale.data.batch import Batch
from recscale.data.preprocess import OOV
from recscale.errors import DataError, ResourceError

FORMAT_VERSION = 1


def read_meta(split_dir: Path) -> dict | None:
    """The split's meta.json, or None when the directory is absent or incomplete, or the file is not one
    (damaged: a byte that is not UTF-8, JSON of another shape), as a split written again replaces it."""
    try:
        meta = json.loads((Path(split_dir) / "meta.json").read_text())
    except (FileNotFoundError, ValueError):  # ValueError: JSONDecodeError, UnicodeDecodeError
        return None
    return meta if _well_formed(meta) else None


def _well_formed(meta: object) -> bool:
    """``meta`` has what ``ArrayDataset`` reads from a meta.json of this version."""
    if not isinstance(meta, dict) or meta.get("version") != FORMAT_VERSION:
        return False
    fields = meta.get("sparse")
    return (
        type(meta.get("rows")) is int
        and type(meta.get("num_dense")) is int
        and type(meta.get("weight", False)) is bool  # absent (a split from before row weights): none
        and isinstance(fields, list)
        and all(
            isinstance(f, dict)
            and isinstance(f.get("name"), str)
            and type(f.get("multi")) is bool
            and type(f.get("weighted")) is bool
            for f in fields
        )
    )


def _map_ids(path: Path, dtype: type[np.generic]) -> np.ndarray:
    """A field's ids (or weights) file, mapped read-only. Empty where no row of the split holds an id of
    the field (a multi-id column empty throughout, e.g. a small eval file): mmap refuses an empty file."""
    return np.memmap(path, dtype, "r") if path.stat().st_size else np.zeros(0, dtype)


class ArrayDataset:
    """Random access to a materialised split. ``gather(idx)`` builds one ``Batch``."""

    def __init__(self, split_dir: Path, index: np.ndarray | None = None) -> None:
        self.dir = Path(split_dir)
        meta = read_meta(self.dir)
        if meta is None:
            raise DataError(
                f"{self.dir}: not a complete preprocessed split (meta.json missing or from another version)"
            )
        self.meta = meta
        if index is None:  # a view (``subset``) of a split was checked as the split
            self._check_files()
        self.index = index  # the rows of the split this view holds, in order (None: all of them)
        self.rows: int = meta["rows"] if index is None else len(index)
        self.keys = [f["name"] for f in meta["sparse"]]
        self._weighted = any(f["weighted"] for f in meta["sparse"])
        self.weighted_rows: bool = meta.get("weight", False)  # a weight per row (else every row weighs 1)
        self._arrays: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.rows

    def _check_files(self) -> None:
        """A DataError naming the first column file that is missing or not the size meta.json gives it (a
        copy cut short, a disk fault): read, it failed inside a loader worker or gave other rows' ids."""
        n = self.meta["rows"]
        for name, itemsize, items in self._files(n):
            path = self.dir / name
            size = path.stat().st_size if path.is_file() else None
            if size != itemsize * items:
                raise DataError(
                    f"{path}: {'missing' if size is None else f'{size} bytes'} where the split's "
                    f"meta.json needs {itemsize * items}: the split is damaged; delete {self.dir} and rerun "
                    "the command that wrote it (train, or data prepare for a data.prepared directory)"
                )

    def batch_bytes(self, rows: int) -> int:
        """About the bytes of the arrays ``gather_arrays`` builds for ``rows`` rows (a multi-id field's ids
        counted at the split's mean per row), from the column files' sizes: no batch is built."""
        a, n = self._open(), max(self.meta["rows"], 1)
        per_row = a["dense"].itemsize * self.meta["num_dense"] + a["label"].itemsize
        per_row += a["weight"].itemsize if self.weighted_rows else 0
        for f in self.meta["sparse"]:
            ids = a[f"{f['name']}.values"]
            per_id = ids.itemsize + (4 if self._weighted else 0)  # a float32 weight per id of every field
            per_row += 4 + per_id * (len(ids) / n if f["multi"] else 1)  # an int32 length per row and field
        return math.ceil(per_row * rows)

    def _files(self, n: int) -> Iterator[tuple[str, int, int]]:
        """(file name, bytes per item, items) of each column file; a multi-id field's ids are counted by
        its last offset, read once its offsets file is known to be whole."""
        yield "label.bin", 4, n
        if self.meta.get("weight", False):
            yield "weight.bin", 4, n
        yield "dense.bin", 4, n * self.meta["num_dense"]
        for f in self.meta["sparse"]:
            name, ids = f["name"], n
            if f["multi"]:
                yield f"{name}.offsets.bin", 8, n + 1
                ids = int(np.fromfile(self.dir / f"{name}.offsets.bin", np.int64, offset=8 * n)[0])
            yield f"{name}.values.bin", 8, ids
            if f["weighted"]:
                yield f"{name}.weights.bin", 4, ids

    def _open(self) -> dict[str, np.ndarray]:
        # Opened lazily so the object pickles cheaply into DataLoader worker processes.
        if self._arrays is None:
            d, n = self.dir, self.meta["rows"]
            arrays = {
                "label": np.memmap(d / "label.bin", np.float32, "r", shape=(n,)),
                "dense": np.memmap(d / "dense.bin", np.float32, "r", shape=(n, self.meta["num_dense"]))
                if self.meta["num_dense"]
                else np.zeros((n, 0), np.float32),
            }
            if self.weighted_rows:
                arrays["weight"] = np.memmap(d / "weight.bin", np.float32, "r", shape=(n,))
            for f in self.meta["sparse"]:
                name = f["name"]
                arrays[f"{name}.values"] = _map_ids(d / f"{name}.values.bin", np.int64)
                if f["multi"]:
                    arrays[f"{name}.offsets"] = np.memmap(
                        d / f"{name}.offsets.bin", np.int64, "r", shape=(n + 1,)
                    )
                if f["weighted"]:
                    arrays[f"{name}.weights"] = _map_ids(d / f"{name}.weights.bin", np.float32)
            self._arrays = arrays
        return self._arrays

    def labels(self) -> np.ndarray:
        labels = np.asarray(self._open()["label"])
        return labels if self.index is None else labels[self.index]

    def weights(self) -> np.ndarray | None:
        """(len(self),) float32: each row's weight; None where the split has none (every row weighs 1)."""
        if not self.weighted_rows:
            return None
        weights = np.asarray(self._open()["weight"])
        return weights if self.index is None else weights[self.index]

    def subset(self, mask: np.ndarray) -> ArrayDataset:
        """A view of the rows where ``mask`` (len(self),) is true, in order."""
        rows = np.flatnonzero(mask)
        return ArrayDataset(self.dir, rows if self.index is None else self.index[rows])

    def unknown_fields(self) -> list[str]:
        """The sparse fields where every id of the materialised split (all its rows, whatever the view) is
        OOV: unseen in training or missing. A field holding no id at all is not one. Such a field is
        usually written another way than training's file wrote it (007 for 7, another id space)."""
        return [name for name, share in self.oov_shares().items() if share == 1.0]

    def oov_shares(self) -> dict[str, float]:
        """Each sparse field's share of ids (all rows of the materialised split, whatever the view) that are
        OOV; a field holding no id at all is left out."""
        a = self._open()
        names = (f["name"] for f in self.meta["sparse"])
        return {
            n: float(np.count_nonzero(ids == OOV) / len(ids)) for n in names if len(ids := a[f"{n}.values"])
        }

    def ids(self, name: str) -> np.ndarray:
        """(len(self),) int64: the single-id field ``name``'s id of each row (OOV: unseen or missing)."""
        f = next((f for f in self.meta["sparse"] if f["name"] == name), None)
        if f is None or f["multi"]:
            raise KeyError(name)
        ids = self._open()[f"{name}.values"]
        return np.array(ids) if self.index is None else ids[self.index]  # a copy, not the read-only map

    def hold_out(self, fraction: float) -> tuple[ArrayDataset, ArrayDataset]:
        """(selection rows, held-out rows): ``held_out(len(self), fraction)`` splits the view in two."""
        held = held_out(len(self), fraction)
        return self.subset(~held), self.subset(held)

    def lengths(self, idx: np.ndarray, names: list[str]) -> np.ndarray:
        """(len(idx), len(names)) int64: how many ids rows ``idx`` hold in each multi-id field ``names``."""
        a = self._open()
        if self.index is not None:
            idx = self.index[idx]
        cols = [a[f"{n}.offsets"][idx + 1] - a[f"{n}.offsets"][idx] for n in names]
        return np.stack(cols, axis=1) if cols else np.zeros((len(idx), 0), np.int64)

    def gather_arrays(self, idx: np.ndarray) -> tuple[np.ndarray, ...]:
        """Rows ``idx`` -> (dense (B, n_dense), values, lengths (n_keys * B,), weights or empty, labels (B,),
        row weights (B,) or empty)."""
        a = self._open()
        if self.index is not None:
            idx = self.index[idx]
        values, lengths, weights = [], [], []
        for f in self.meta["sparse"]:
            name = f["name"]
            if f["multi"]:
                off = a[f"{name}.offsets"]
                starts, ends = off[idx], off[idx + 1]
                lens = ends - starts
                # Positions of every id of the selected rows, without a Python loop over rows.
                pos = np.repeat(starts - np.cumsum(lens) + lens, lens) + np.arange(int(lens.sum()))
                values.append(a[f"{name}.values"][pos])
                lengths.append(lens.astype(np.int32))
                if self._weighted:
                    w = a[f"{name}.weights"][pos] if f["weighted"] else np.ones(len(pos), np.float32)
                    weights.append(w)
            else:
                values.append(a[f"{name}.values"][idx])
                lengths.append(np.ones(len(idx), np.int32))
                if self._weighted:
                    weights.append(np.ones(len(idx), np.float32))
        return (
            np.ascontiguousarray(a["dense"][idx]),
            np.concatenate(values),
            np.concatenate(lengths),
            np.concatenate(weights) if weights else np.zeros(0, np.float32),
            np.ascontiguousarray(a["label"][idx]),
            np.ascontiguousarray(a["weight"][idx]) if self.weighted_rows else np.zeros(0, np.float32),
        )

    def to_batch(self, arrays: tuple[np.ndarray, ...] | tuple[torch.Tensor, ...]) -> Batch:
        dense, values, lengths, weights, labels, rows = (torch.as_tensor(x) for x in arrays)
        kjt = KeyedJaggedTensor(
            keys=self.keys, values=values, lengths=lengths, weights=weights if self._weighted else None
        )
        return Batch(dense=dense, sparse=kjt, labels=labels, weights=rows if self.weighted_rows else None)

    def gather(self, idx: np.ndarray) -> Batch:
        return self.to_batch(self.gather_arrays(idx))


def held_out(rows: int, fraction: float, salt: int = 0, start: int = 0) -> np.ndarray:
    """(rows,) bool: row i (of ``start`` .. ``start + rows - 1``) is held out when a fixed hash of i
    (splitmix64) falls below ``fraction``. The same rows of a file whatever the seed, model or run, so every
    run of a suite reports on one set; another ``salt`` draws independently of the first (negative
    downsampling, the valid rows of data.valid_fraction)."""
    x = np.arange(start, start + rows, dtype=np.uint64) + np.uint64(
        0x9E3779B97F4A7C15 * (1 + 2 * salt) % 2**64
    )
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53 < fraction


def epoch_batches(
    rows: int,
    batch_size: int,
    *,
    seed: int,
    epoch: int,
    drop_last: bool,
    rank: int = 0,
    world_size: int = 1,
) -> list[np.ndarray]:
    """Row indices of each batch of one epoch for this rank, in an order shuffled by ``seed`` and ``epoch``.

    ``batch_size`` is the *global* batch; rank r takes the r-th contiguous slice of it, so W ranks
    together see exactly the batches a single process with the same global batch sees. A batch that
    does not split evenly (the last, with ``drop_last=False``) gives the ranks slices one row apart.
    """
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(rows, generator=g).numpy()
    n_full = rows // batch_size
    bounds = [(i * batch_size, (i + 1) * batch_size) for i in range(n_full)]
    if not drop_last and rows % batch_size:
        bounds.append((n_full * batch_size, rows))
    out = []
    for lo, hi in bounds:
        size = hi - lo
        out.append(np.sort(order[lo:hi][rank * size // world_size : (rank + 1) * size // world_size]))
    return out


class _Gather(IterableDataset):
    def __init__(self, ds: ArrayDataset, batches: list[np.ndarray]) -> None:
        self.ds, self.batches = ds, batches

    def __iter__(self) -> Iterator[tuple[np.ndarray, ...]]:
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        # Worker w builds batches w, w + nw, ...; the DataLoader interleaves them back in order.
        for i in range(wid, len(self.batches), nw):
            yield self.ds.gather_arrays(self.batches[i])


PREFETCH = 4  # batches each worker builds ahead
SHARED_MEMORY = Path("/dev/shm")
# Seconds the reader waits for a worker's next batch (built in milliseconds) before it calls the workers stuck
WORKER_TIMEOUT_S = 300.0


def _check_shared_memory(ds: ArrayDataset, rows: int, workers: int) -> None:
    """Workers hand their batches over in shared memory (/dev/shm). A batch that does not fit is dropped (its
    worker prints a traceback) and the loader waits for it forever: training on a container's 64 MiB /dev/shm
    hung. Refused unless the batches in flight fit (those the workers build ahead, and two the reader holds;
    measured: 1 worker peaked at 5.2 batches) of ``rows`` rows each. Sized from the files, not by building
    one: the parent builds no batch (a batch's work in the parent is what the workers are there to spare)."""
    if not SHARED_MEMORY.is_dir():
        return
    batches = PREFETCH * workers + 2
    need = ds.batch_bytes(rows) * batches
    free = shutil.disk_usage(SHARED_MEMORY).free
    if need > free:
        raise ResourceError(
            f"data.num_workers={workers} hands batches over in shared memory, {SHARED_MEMORY}, where the "
            f"{batches} batches in flight need about {need / 2**20:.1f} MiB and {free / 2**20:.1f} MiB is free; "
            "enlarge it (e.g. docker run --shm-size=1g), or lower data.num_workers (0: no workers) or "
            "train.batch_size"
        )


def iterate(ds: ArrayDataset, batches: list[np.ndarray], num_workers: int = 0) -> Iterator[Batch]:
    """Yield ``Batch`` es for the given index batches, built in ``num_workers`` worker processes."""
    if num_workers == 0 or len(batches) < 2:
        for idx in batches:
            yield ds.gather(idx)
        return
    workers = min(num_workers, len(batches))
    _check_shared_memory(ds, max(map(len, batches)), workers)
    loader = DataLoader(
        _Gather(ds, batches),
        batch_size=None,
        num_workers=workers,
        prefetch_factor=PREFETCH,
        persistent_workers=False,
        # Its own generator for the workers' base seed: drawn from the global one, that seed moved the
        # global RNG (dropout's), so data.num_workers=0 trained another model than 1, and an evaluation
        # in workers (valid over one eval batch) changed the masks of the steps after it.
        generator=torch.Generator(),
        timeout=WORKER_TIMEOUT_S,
    )
    # The workers fork with the parent's objects frozen, so their garbage collection never runs a finalizer
    # of an object the parent held: one that takes a lock another parent thread held at the fork (TensorBoard's
    # writer, a pool's) would wait forever, and the loader with it.
    gc.freeze()
    try:
        arrays_of = iter(loader)
    finally:
        gc.unfreeze()
    while True:
        try:
            arrays = next(arrays_of)
        except StopIteration:
            return
        except RuntimeError as e:
            if not str(e).startswith("DataLoader timed out"):
                raise
            # /dev/shm filled during the run (another job's files): the worker's batch was dropped, as
            # _check_shared_memory says, and the loader waited for it forever.
            free = shutil.disk_usage(SHARED_MEMORY).free / 2**20 if SHARED_MEMORY.is_dir() else math.nan
            raise ResourceError(
                f"the data workers sent no batch for {WORKER_TIMEOUT_S:.0f} s; a worker whose batch did not fit "
                f"in shared memory ({SHARED_MEMORY}, {free:.1f} MiB free now) drops it: free or enlarge it, or set "
                "data.num_workers=0"
            ) from None
        yield ds.to_batch(arrays)
