"""Parquet files, streamed by row groups, cast to the raw layout.

Columns are looked up by the schema's names (the label column by ``schema.label``). Integer ids
become strings. A multi-id feature is a list column (ints or strings), its weights (if weighted)
the list<float> column ``{name}__w``; or a string column split like CSV cells. Errors and dropped
rows name 1-based data rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict

from recscale.data.readers.base import (
    BadRows,
    check_file,
    check_unique_columns,
    consecutive,
    convert,
    is_list,
    make_batch,
    missing_columns_error,
)
from recscale.data.readers.csv import source_columns
from recscale.data.schema import WEIGHT_SUFFIX, Schema
from recscale.errors import DataError


class Options(BaseModel):
    """``data.options`` for ``format: parquet``: none."""

    model_config = ConfigDict(extra="forbid")


def read(
    path: Path, schema: Schema, options: Options, bad: BadRows, chunk_rows: int
) -> Iterator[pa.RecordBatch]:
    """Check the file and its columns now; return the stream of raw-layout batches."""
    file = open_parquet(path)
    arrow = file.schema_arrow
    wanted = source_columns(schema)
    for f in schema.sparse:
        if f.weighted and f.name in arrow.names and is_list(arrow.field(f.name).type):
            wanted.append(f.name + WEIGHT_SUFFIX)
    missing = [c for c in wanted if c not in arrow.names]
    if missing:
        raise missing_columns_error(path, missing, arrow.names)
    return _batches(file, schema, bad, chunk_rows, wanted)


def open_parquet(path: Path) -> pq.ParquetFile:
    """``path`` opened, a DataError unless it is a parquet file whose column names are unique."""
    check_file(path)
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path} is not a readable parquet file: {e}") from None
    check_unique_columns(f"{path}: the parquet schema", file.schema_arrow.names)
    return file


def _batches(
    file: pq.ParquetFile, schema: Schema, bad: BadRows, chunk_rows: int, wanted: list[str]
) -> Iterator[pa.RecordBatch]:
    row = 1
    for batch in file.iter_batches(batch_size=chunk_rows, columns=wanted):
        arrays, problems = convert(batch.column, schema)
        keep = bad.keep(batch.num_rows, problems, consecutive(row))
        row += batch.num_rows
        yield make_batch(arrays, schema, keep)
