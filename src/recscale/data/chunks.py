"""Re-cutting a stream of row pieces (Arrow record batches or NumPy arrays) into fixed-size chunks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np
import pyarrow as pa

Rows = TypeVar("Rows", pa.RecordBatch, np.ndarray)


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
