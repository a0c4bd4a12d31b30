"""Readers: stream a dataset file as ``pyarrow.RecordBatch`` es in the raw layout of a ``Schema``.

``read_batches(path, fmt, schema)`` is the entry point; ``fmt`` is one of ``FORMATS`` and
``options`` are validated by ``options_model(fmt)``. Every batch has exactly the columns
``schema.column_names()`` with the types of ``raw_arrow_schema(schema)`` and at most
``chunk_rows`` rows; a sequence feature's lists are cut to its ``max_len`` (the most recent ids
kept, the cut rows counted in ``ReadStats.truncated``). Bad rows raise a one-line ``DataError`` naming file and line, or are dropped
and counted in ``ReadStats`` under ``on_bad_row="skip"``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import chain
from pathlib import Path
from types import ModuleType

import numpy as np
import pyarrow as pa
import pydantic

from recscale.data.chunks import rechunk
from recscale.data.readers import criteo, csv, libsvm, movielens, parquet
from recscale.data.readers.base import (
    BadRows,
    NoRows,
    OnBadRow,
    ReadStats,
    as_trained,
    check_file,
    data_files,
    position_unit,
    raw_arrow_schema,
)
from recscale.data.readers.text import read_header
from recscale.data.schema import Schema
from recscale.errors import ConfigError, DataError

__all__ = [
    "FORMATS",
    "WEIGHTED_FORMATS",
    "NoRows",
    "ReadStats",
    "holds_column",
    "options_model",
    "raw_arrow_schema",
    "read_batches",
    "validate_options",
]

_MODULES: dict[str, ModuleType] = {
    "csv": csv,
    "libsvm": libsvm,
    "criteo": criteo,
    "movielens": movielens,
    "parquet": parquet,
}
FORMATS: tuple[str, ...] = tuple(_MODULES)
# The formats whose files name their columns, so that one can hold row weights (``Schema.weight``).
WEIGHTED_FORMATS = ("csv", "parquet")
# (start, n) -> (n,) bool: which of the read's rows start .. start + n - 1 to keep (read_batches's keep).
RowFilter = Callable[[int, int], np.ndarray]


def _module(fmt: str) -> ModuleType:
    if fmt not in _MODULES:
        raise DataError(f"unknown data format '{fmt}'; known formats: {', '.join(FORMATS)}")
    return _MODULES[fmt]


def options_model(fmt: str) -> type[pydantic.BaseModel]:
    """The pydantic model validating ``options`` for format ``fmt`` (unknown keys are errors)."""
    return _module(fmt).Options


def validate_options(fmt: str, options: dict | None) -> pydantic.BaseModel:
    """``options`` checked against ``options_model(fmt)``; a ConfigError names the bad key."""
    try:
        return options_model(fmt).model_validate(options or {})
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in ("data.options", *first["loc"]))
        msg = f"{first['msg'].removeprefix('Value error, ')} (format '{fmt}')"
        if first["type"] == "extra_forbidden":
            msg = f"unknown key for format '{fmt}' (its options: {', '.join(options_model(fmt).model_fields) or 'none'})"
        raise ConfigError(f"{where}: {msg}") from None


def holds_column(path: str | Path, fmt: str, options: dict | None, name: str) -> bool:
    """Whether the files ``path`` names have a column ``name``: a CSV header's, a Parquet schema's; never for a
    format of a fixed layout. A file the reader would refuse raises its error now, and so do parts of which
    some have the column and some not (read as one split, they would be weighed or not by the first)."""
    if fmt not in WEIGHTED_FORMATS:
        return False
    opts = validate_options(fmt, options)
    if isinstance(opts, csv.Options) and opts.columns is not None:  # files without a header: these columns
        return name in opts.columns

    def has(file: Path) -> bool:
        if fmt == "parquet":
            return name in parquet.open_parquet(file).schema_arrow.names
        assert isinstance(opts, csv.Options)
        check_file(file)
        return name in read_header(file, opts.delimiter, quote=opts.quote)

    files = data_files(path, fmt)
    if len(files) > 1:  # an empty part has no header, and adds no rows to weigh
        files = [f for f in files if f.stat().st_size > 0] or files[:1]
    found = [has(f) for f in files]
    if any(found) and not all(found):
        with_, without = (files[found.index(want)] for want in (True, False))
        raise DataError(
            f"{path}: column '{name}' is in some of its files ({with_}) and not in others ({without}); "
            f"give files that all have it, or none"
        )
    return bool(found) and found[0]


def read_batches(
    path: str | Path,
    fmt: str,
    schema: Schema,
    options: dict | None = None,
    chunk_rows: int = 65536,
    on_bad_row: OnBadRow = "error",
    stats: ReadStats | None = None,
    keep: RowFilter | None = None,
) -> Iterator[pa.RecordBatch]:
    """Stream ``path`` (format ``fmt``) as raw-layout batches of at most ``chunk_rows`` rows.

    The file, its columns and the options are checked at once (``DataError``/``ConfigError``);
    bad rows are found while streaming. ``stats`` (if given) counts rows and skipped bad rows.
    A read that yields no row at all (empty file, header only, or every row bad) is a DataError.
    ``keep(start, n)``: which of the good rows ``start .. start + n - 1`` (counted from 0 over the whole
    read) the stream yields, a (n,) bool array; the others are dropped before anything counts them
    (sequences cut), so one file can be read as two splits.
    """
    module = _module(fmt)
    opts = validate_options(fmt, options)
    if on_bad_row not in ("error", "skip"):
        raise ConfigError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    if chunk_rows < 1:
        raise ConfigError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if schema.weight is not None and fmt not in WEIGHTED_FORMATS:  # DataConfig refuses it first
        raise ConfigError(f"schema.weight: format '{fmt}' has a fixed layout with no column of row weights")
    stats = ReadStats() if stats is None else stats
    assert keep is None or stats.positions is None  # a kept row's position would need the filter too
    extra = (chunk_rows,) if fmt == "parquet" else ()
    files = data_files(path, fmt)
    if len(files) == 1:
        file = files[0]
        return _counted(
            module.read(file, schema, opts, BadRows(file, position_unit(fmt), on_bad_row, stats), *extra),
            file, schema, chunk_rows, stats, keep,
        )  # fmt: skip

    # Every part checked now (its header, its columns), not hours into the read. A reader's check closes its
    # file and the stream it returns opens it only when the read reaches it: a Spark job's thousands of parts
    # held open at once could exhaust file handles. A part holding no rows (an empty part) adds none.
    def part(file: Path) -> Iterator[pa.RecordBatch]:
        if file.stat().st_size == 0:
            return iter(())
        try:
            return module.read(
                file, schema, opts, BadRows(file, position_unit(fmt), on_bad_row, stats), *extra
            )
        except NoRows:
            return iter(())

    streams = [part(f) for f in files]
    return _counted(chain.from_iterable(streams), Path(path), schema, chunk_rows, stats, keep)


def _counted(
    batches: Iterator[pa.RecordBatch],
    path: Path,
    schema: Schema,
    chunk_rows: int,
    stats: ReadStats,
    keep: RowFilter | None = None,
) -> Iterator[pa.RecordBatch]:
    rows = 0
    for batch in rechunk(batches, chunk_rows, pa.concat_batches):
        start, rows = rows, rows + batch.num_rows
        if keep is not None:
            batch = batch.filter(pa.array(keep(start, batch.num_rows)))
            if not batch.num_rows:
                continue
        stats.rows += batch.num_rows
        yield as_trained(batch, schema, stats)
    if not rows:
        # Why they were bad, or the line says nothing of it (e.g. a Criteo test file's 39 fields read by eval).
        first = f"; first at {stats.examples[0].removeprefix(f'{path} ')}" if stats.examples else ""
        if not stats.skipped:
            raise NoRows(f"{path} has no data rows")
        raise DataError(f"{path} has no data rows ({stats.skipped} bad rows dropped{first})")
