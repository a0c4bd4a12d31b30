"""Raw Criteo display-ads TSV: no header, 40 tab-separated fields per line, empty = missing (read without
labels, as `recscale predict` reads, also the test files' 39: no label field).

Fields: ``label`` (0/1), ``I1``..``I13`` (integer counts, may be negative), ``C1``..``C26``
(hexadecimal category hashes). The schema picks among these names (normally dense I1..I13 and
sparse C1..C26, label ``label``). Errors and dropped rows name 1-based file lines.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from recscale.data.readers.base import (
    NO_LABEL,
    BadRows,
    check_file,
    make_batch,
    missing_columns_error,
)
from recscale.data.readers.csv import source_columns
from recscale.data.readers.text import (
    first_line,
    iter_converted,
)
from recscale.data.schema import Schema
from recscale.settings import Settings

COLUMNS = ["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))]


class Options(Settings):
    """``data.options`` for ``format: criteo``: none, the layout is fixed."""


def read(path: Path, schema: Schema, options: Options, bad: BadRows) -> Iterator[pa.RecordBatch]:
    """Check the file and the schema's names now; return the stream of raw-layout batches."""
    check_file(path, headerless=True)
    wanted = source_columns(schema)
    missing = [c for c in wanted if c not in COLUMNS]
    if missing:
        raise missing_columns_error(path, missing, COLUMNS)
    # Read without labels (``unlabelled``), a file of 39 fields a line is Criteo's test layout: no label field.
    unlabelled_layout = schema.label == NO_LABEL and first_line(path).count(b"\t") == len(COLUMNS) - 2
    return _batches(path, schema, bad, wanted, COLUMNS[1:] if unlabelled_layout else COLUMNS)


def _batches(
    path: Path, schema: Schema, bad: BadRows, wanted: list[str], names: list[str]
) -> Iterator[pa.RecordBatch]:
    skip = bad.on_bad_row == "skip"
    chunks = iter_converted(
        path, names, wanted, schema, delimiter="\t", quote=False, skip_header=False, skip_undecodable=skip
    )
    for chunk, arrays, problems in chunks:
        keep = bad.keep(chunk.table.num_rows, problems, chunk.locate, chunk.rejected)
        yield make_batch(arrays, schema, keep)
