"""BARS/FuxiCTR-style CSV with a header line (e.g. Frappe_x1 ``train.csv``), optionally ``.gz``.

The schema's label column is read as ``label`` (its ``weight`` column, if any, as ``weight``); its other features are looked up by name in the
header. Empty cells (and ``""``) are missing values; an id cell is its text, but for a whole number
written with a zero fraction (``3.0`` is id ``3``, as a Parquet float 3.0 is: ``base.normal_ids``). A multi-id cell joins ids with the feature's ``sep``
(``a|b|c``); a weighted one writes ``id:weight`` entries (``a:0.5|b:2``; a bare id weighs 1).
Cells may be quoted (``"a,b"``) but hold no line breaks (one that does is an error naming the lines);
``quote: false`` reads ``"`` as any other character. Errors and dropped rows name 1-based
file lines (the header is line 1). A file without a header names its columns in ``columns``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
from pydantic import Field, field_validator

from recscale.data.readers.base import (
    NO_LABEL,
    NUMBER_RE,
    BadRows,
    check_file,
    make_batch,
    missing_columns_error,
)
from recscale.data.readers.text import (
    HEADERLESS_HINT,
    first_line,
    iter_converted,
    read_header,
)
from recscale.data.schema import Schema
from recscale.errors import DataError
from recscale.settings import Settings


class Options(Settings):
    """``data.options`` for ``format: csv``."""

    delimiter: str = Field(",", min_length=1, max_length=1)
    # '"' quotes cells ("a,b"); false reads it as any other character (a TSV of free text whose cells
    # may start with a quote, e.g. '"Best deal' of a title, which quoting would run into the next cells).
    quote: bool = True
    # A file without a header line (as `split` or a database export writes one): its columns, in order. Line 1
    # is then a data row, and lines are numbered from it.
    columns: list[str] | None = Field(None, min_length=1)

    @field_validator("delimiter", mode="before")
    @classmethod
    def _tab_spelled_out(cls, v: object) -> object:
        # `data inspect --delimiter` takes these for a tab; here they were "at most 1 character", no more.
        if v in ("\\t", "tab"):
            raise ValueError(
                f"'{v}' is not a tab: write a tab in double quotes, delimiter: \"\\t\" in YAML "
                """('data.options.delimiter="\\t"' on the command line)"""
            )
        return v

    @field_validator("columns")
    @classmethod
    def _unique(cls, v: list[str] | None) -> list[str] | None:
        twice = sorted({n for n in v if v.count(n) > 1}) if v is not None else []
        if twice:
            raise ValueError(f"names column(s) {', '.join(map(repr, twice))} more than once")
        return v


def source_columns(schema: Schema) -> list[str]:
    """The file columns a schema reads: its label column (none for ``unlabelled``), its row-weight column (if
    any), then its features."""
    label = [schema.label] if schema.label != NO_LABEL else []
    weight = [schema.weight] if schema.weight is not None else []
    return [*label, *weight, *schema.dense_names, *schema.sparse_names]


def read(path: Path, schema: Schema, options: Options, bad: BadRows) -> Iterator[pa.RecordBatch]:
    """Check the file and its header now; return the stream of raw-layout batches."""
    if options.columns is None:
        check_file(path)
        names = read_header(path, options.delimiter, quote=options.quote)
    else:
        check_file(path, headerless=True)
        names = options.columns
        # Its first line as text split at the delimiter: a data line need not parse as a header (ids repeat).
        if first_line(path).decode(errors="replace").split(options.delimiter) == names:
            raise DataError(
                f"{path} line 1 is a header naming data.options.columns; leave out columns for a file with a header"
            )
    wanted = source_columns(schema)
    missing = [c for c in wanted if c not in names]
    if missing:
        error = missing_columns_error(path, missing, names)
        if len(names) == 1 and (hint := delimiter_hint(names[0], options.delimiter)):
            raise DataError(f"{error}; {hint}")
        if len(missing) == len(wanted) and any(re.fullmatch(NUMBER_RE, n.strip()) for n in names):
            # No column found and a number among the "names": a part cut from a file after its header (split
            # -l), or a Spark CSV written without one (its default), read as if line 1 named the columns.
            raise DataError(f"{error}; line 1 is a row of data, not a header: {HEADERLESS_HINT}")
        raise error
    return _batches(path, schema, options, bad, names, wanted)


def delimiter_hint(header: str, delimiter: str) -> str | None:
    """For a header read as one column: the advice to set the delimiter it seems to use, if any."""
    other = next((d for d in (",", ";", "\t", "|") if d != delimiter and d in header), None)
    if other is None:
        return None
    return (
        f"the header is one column for delimiter {delimiter!r} but holds {other!r}: if the file is "
        f"{other!r}-delimited, set data.options.delimiter to {other!r}"
    )


def _batches(
    path: Path, schema: Schema, options: Options, bad: BadRows, names: list[str], wanted: list[str]
) -> Iterator[pa.RecordBatch]:
    chunks = iter_converted(
        path,
        names,
        wanted,
        schema,
        delimiter=options.delimiter,
        quote=options.quote,
        skip_header=options.columns is None,
        skip_undecodable=bad.on_bad_row == "skip",
    )
    for chunk, arrays, problems in chunks:
        keep = bad.keep(chunk.table.num_rows, problems, chunk.locate, chunk.rejected)
        yield make_batch(arrays, schema, keep)
