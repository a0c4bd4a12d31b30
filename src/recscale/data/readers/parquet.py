"""Parquet files, streamed by row groups, cast to the raw layout.

Columns are looked up by the schema's names (the label column by ``schema.label``, the row weights' by
``schema.weight``). Integer ids
become their decimal text; float ids (a column of floats, or a list of them) that of the integer they
hold (3.0 is id "3"), and one that is not a whole number (1.5, NaN) makes its row bad; a decimal id its
text, a whole one the integer's (12.0 is "12", 3.5 "3.5"); a string id as CSV reads its cell: "" is a missing
id, "3.0" is "3" (``base.normal_ids``). A multi-id
feature is a list column (of ids as above; list, large_list or fixed_size_list; an empty id, "" or null,
is dropped with its weight, as CSV's ``x|`` reads ``['x']``), its weights (if weighted) the list<float>
column ``{name}__w``; or a string column split like CSV cells. Dictionary-encoded columns are read as their values. A column whose type its
feature cannot read (a struct, a list where one value is read, ...) is a one-line error before any row
is read. Errors and dropped rows name 1-based data rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from recscale.data.readers.base import (
    BadRows,
    check_file,
    check_unique_columns,
    consecutive,
    convert,
    damage_named,
    is_list,
    make_batch,
    missing_columns_error,
)
from recscale.data.readers.csv import source_columns
from recscale.data.schema import WEIGHT_SUFFIX, Schema
from recscale.errors import DataError
from recscale.settings import Settings


class Options(Settings):
    """``data.options`` for ``format: parquet``: none."""


def read(
    path: Path, schema: Schema, options: Options, bad: BadRows, chunk_rows: int
) -> Iterator[pa.RecordBatch]:
    """Check the file and its columns now; return the stream of raw-layout batches, which opens the file
    again only when read (a split's thousands of parts, all checked first, are not held open)."""
    with open_parquet(path) as file:
        arrow = file.schema_arrow
    wanted = source_columns(schema)
    for f in schema.sparse:
        if f.weighted and f.name in arrow.names and is_list(arrow.field(f.name).type):
            wanted.append(f.name + WEIGHT_SUFFIX)
    missing = [c for c in wanted if c not in arrow.names]
    if missing:
        raise missing_columns_error(path, missing, arrow.names)
    _check_types(path, arrow, schema)
    return _batches(path, schema, bad, chunk_rows, wanted)


def open_parquet(path: Path) -> pq.ParquetFile:
    """``path`` opened, a DataError unless it is a parquet file whose column names are unique."""
    check_file(path)
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        with path.open("rb") as f:
            head = f.read(4096)
        if head and b"\0" not in head and not head.startswith(b"PAR1"):  # e.g. a Parquet run's CSV export
            raise DataError(
                f"{path} is not a parquet file but text; if it is a CSV file, read it with data.format=csv"
            ) from None
        raise DataError(f"{path} is not a readable parquet file: {e}") from None
    check_unique_columns(f"{path}: the parquet schema", file.schema_arrow.names)
    return file


def _check_types(path: Path, arrow: pa.Schema, schema: Schema) -> None:
    """DataError naming the first schema column whose Parquet type its feature cannot read: a list or
    struct where one value is read (the label, dense and single-id features), a label or dense column of
    no numbers (a date, a time), and for a multi-id feature anything but a list of plain values or a
    string column of ids joined by its ``sep``."""
    multi = {f.name: f.sep for f in schema.sparse if f.multi}
    role = {schema.label: "the label"} | dict.fromkeys(schema.dense_names, "a dense feature")
    if schema.weight is not None:
        role[schema.weight] = "the row weight"
    for name in source_columns(schema):
        dtype = _plain(arrow.field(name).type)
        if name in multi:
            if is_list(dtype) and not pa.types.is_nested(_plain(dtype.value_type)):
                continue
            # A null column (pyarrow's type for one of nothing but nulls): every row without ids.
            if pa.types.is_string(dtype) or pa.types.is_large_string(dtype) or pa.types.is_null(dtype):
                continue
            need = f"a list of ids (integers or strings) or a string of ids joined by {multi[name]!r}"
        elif name in role:
            if holds_numbers(dtype):
                continue
            need = f"one number per row ({role[name]})"
        elif not pa.types.is_nested(dtype):
            continue
        else:
            need = "one id per row (to read a list column, set multi: true on its sparse feature)"
        raise DataError(f"{path}: column {name!r} is {arrow.field(name).type}; it must hold {need}")


def holds_numbers(dtype: pa.DataType) -> bool:
    """A type the label and dense features read as numbers (``base.parse_floats``); a date or time is none.
    A dictionary-encoded type by its values."""
    dtype = _plain(dtype)
    t = pa.types
    return (
        t.is_integer(dtype) or t.is_floating(dtype) or t.is_decimal(dtype) or t.is_boolean(dtype)
        or t.is_null(dtype) or t.is_string(dtype) or t.is_large_string(dtype) or t.is_binary(dtype)
        or t.is_large_binary(dtype)
    )  # fmt: skip


def _plain(dtype: pa.DataType) -> pa.DataType:
    """A dictionary-encoded type's value type (how the column is read); other types as they are."""
    return dtype.value_type if pa.types.is_dictionary(dtype) else dtype


def _column(batch: pa.RecordBatch, name: str) -> pa.Array:
    """Column ``name`` of ``batch``, a dictionary-encoded one as its plain values (what the conversions
    take); a column of type null as strings, all null."""
    column = batch.column(name)
    if pa.types.is_null(column.type):  # all missing: as a string column of nulls, which every feature reads
        return pa.nulls(len(column), pa.string())
    return column.dictionary_decode() if isinstance(column, pa.DictionaryArray) else column


def _batches(
    path: Path, schema: Schema, bad: BadRows, chunk_rows: int, wanted: list[str]
) -> Iterator[pa.RecordBatch]:
    row = 1
    with damage_named(bad.where), pq.ParquetFile(path) as file:
        for batch in file.iter_batches(batch_size=chunk_rows, columns=wanted):
            arrays, problems = convert(partial(_column, batch), schema)
            keep = bad.keep(batch.num_rows, problems, consecutive(row))
            row += batch.num_rows
            yield make_batch(arrays, schema, keep)
