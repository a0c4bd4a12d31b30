"""Streams of row pieces: re-cut into fixed-size chunks (Arrow record batches or NumPy arrays), or
processed in threads, in order."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import chain, islice
from typing import TypeVar

import numpy as np
import pyarrow as pa

Rows = TypeVar("Rows", pa.RecordBatch, np.ndarray)
T = TypeVar("T")
R = TypeVar("R")


def usable_cores() -> int:
    """The cores this process may run on (taskset, a container's cpuset), as torch counts them: the machine's
    count (os.cpu_count) can be far more."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Threads working on pieces side by side: pyarrow and numpy release the GIL in their kernels.
THREADS = min(4, usable_cores())


def ordered_map(fn: Callable[[T], R], items: Iterable[T], workers: int = THREADS) -> Iterator[R]:
    """``map(fn, items)`` computed in ``workers`` threads, results in order. At most 2 x ``workers``
    items are in flight, so a file streams in bounded memory; an error surfaces at its own item."""
    if workers <= 1:
        yield from map(fn, items)
        return
    # A stream of one item (a small file: one text chunk) gains nothing from threads, and starting them
    # costs more than parsing it: a split of 1,000 small parts paid that 1,000 times.
    items = iter(items)
    head = list(islice(items, 2))
    if len(head) < 2:
        yield from map(fn, head)
        return
    pool = ThreadPoolExecutor(workers, thread_name_prefix="recscale-data")
    pending: deque[Future[R]] = deque()
    try:
        for item in chain(head, items):
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        # The consumer stopped early or an item failed: drop the work not yet started, and do not
        # wait for the items running. A generator left suspended (e.g. by an error its consumer
        # raised) is closed by the garbage collector, which can run inside threading's shutdown-lock
        # bookkeeping: joining the workers there deadlocks the process.
        pool.shutdown(wait=False, cancel_futures=True)


def rechunk(pieces: Iterator[Rows], rows: int, concat: Callable[[list[Rows]], Rows]) -> Iterator[Rows]:
    """Re-cut ``pieces`` into chunks of exactly ``rows`` rows (the last one shorter); ``concat`` joins
    the slices that make up one chunk. The argument is checked at once, not at the first ``next``."""
    if rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {rows}")
    return _cut(pieces, rows, concat)


def _cut(pieces: Iterator[Rows], rows: int, concat: Callable[[list[Rows]], Rows]) -> Iterator[Rows]:
    pending: list[Rows] = []
    count = 0
    for piece in pieces:
        while len(piece):
            take = min(rows - count, len(piece))
            pending.append(piece[:take])
            count += take
            piece = piece[take:]
            if count == rows:
                yield pending[0] if len(pending) == 1 else concat(pending)
                pending, count = [], 0
    if count:
        yield pending[0] if len(pending) == 1 else concat(pending)
