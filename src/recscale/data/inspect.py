"""``recscale data inspect``: describe a data file without a user schema.

``inspect_file`` guesses the format (unless given), infers a schema, streams the file once and
returns a JSON-able summary: rows, bad rows, positive rate, and per column its type, number of
distinct non-null values (for multi-id columns: distinct ids) and missing values.

Inferred schemas: csv/parquet: a column named ``label`` is the label; numeric columns holding a
non-integer value (parquet: float columns) are dense; text cells containing ``|`` (parquet: list
columns) are multi; the rest sparse (parquet: a struct, map or list of lists is ``unsupported``,
reported with its type and no statistics). criteo: its fixed layout. libsvm: ``fields`` mode with one
feature per token position (``f1``, ``f2``, ...) when the first lines agree on a token count,
else ``bag`` mode (one weighted multi feature ``features``). movielens: every joined column,
``float`` ones dense (but ``rating``, the label's source), ``token_seq`` ones multi; split ``all``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recscale.data.access import histogram_of_counts
from recscale.data.readers import FORMATS, ReadStats, read_batches, validate_options
from recscale.data.readers.base import (
    MAX_EXAMPLES,
    check_file,
    is_list,
    parse_floats,
    to_label,
)
from recscale.data.readers.criteo import COLUMNS as CRITEO_COLUMNS
from recscale.data.readers.movielens import KEYS, RATING, files_of
from recscale.data.readers.parquet import open_parquet
from recscale.data.readers.text import (
    column_of,
    first_line,
    iter_chunks,
    iter_text_tables,
    lines_of,
    read_header,
)
from recscale.data.schema import LABEL, WEIGHT_SUFFIX, DenseFeature, Schema, SparseFeature
from recscale.errors import DataError

LIBSVM_LINE = re.compile(rb"^\S+(\s+[^\s:]+:\S+)+\s*$")
MULTI_SEP = "|"
UNSUPPORTED = "unsupported"  # a parquet column no feature can read (struct, map, list of lists)
# Merge the per-batch distinct values every this many batches (bounds the duplicates held).
MERGE_EVERY = 64


def guess_format(path: str | Path) -> str:
    """The format of ``path`` from its name, else its first bytes / first line."""
    path = Path(path)
    if path.is_dir() or path.suffix == ".inter":
        return "movielens"
    check_file(path)
    suffixes = [s for s in path.suffixes if s not in (".gz", ".bz2", ".zst")]
    last = suffixes[-1] if suffixes else ""
    with path.open("rb") as f:
        magic = f.read(4)
    if last in (".parquet", ".pq") or magic == b"PAR1":
        return "parquet"
    if last == ".csv":
        return "csv"
    line = first_line(path)
    if line.count(b"\t") == len(CRITEO_COLUMNS) - 1:
        return "criteo"
    if LIBSVM_LINE.match(line):
        return "libsvm"
    if b"," in line:
        return "csv"
    raise DataError(f"{path}: cannot tell its format; pass one of: {', '.join(FORMATS)}")


class _Distinct:
    """Distinct non-null values of a stream of arrays, merged with pyarrow (no per-value Python)."""

    def __init__(self) -> None:
        self.parts: list[pa.Array] = []

    def add(self, values: pa.Array) -> None:
        self.parts.append(pc.unique(values.drop_null()))
        if len(self.parts) >= MERGE_EVERY:
            self.parts = [self._merged()]

    def _merged(self) -> pa.Array:
        return pc.unique(pa.chunked_array(self.parts))

    def count(self) -> int:
        return len(self._merged()) if self.parts else 0


class _Counts:
    """Access count of every distinct non-null value of a stream of arrays (pyarrow group-by)."""

    def __init__(self) -> None:
        self.parts: list[pa.Table] = []

    def add(self, values: pa.Array) -> None:
        counts = pc.value_counts(values.drop_null())
        self.parts.append(pa.table({"v": counts.field("values"), "n": counts.field("counts")}))
        if len(self.parts) >= MERGE_EVERY:
            self.parts = [self._merged()]

    def _merged(self) -> pa.Table:
        summed = pa.concat_tables(self.parts).group_by("v").aggregate([("n", "sum")])
        return pa.table({"v": summed.column("v"), "n": summed.column("n_sum")})

    def counts(self) -> np.ndarray:
        return self._merged().column("n").to_numpy() if self.parts else np.zeros(0, dtype=np.int64)


class _Column:
    """Running statistics of one column; ``kind`` None means: infer it from text cells. With
    ``tables``, id columns also count each id's accesses (pooling factor, access histogram)."""

    def __init__(self, name: str, kind: str | None, tables: bool = False) -> None:
        self.name, self.kind = name, kind
        self.missing = 0
        self.rows = self.ids = 0
        self.distinct = _Distinct()
        self.counts = _Counts() if tables and kind not in (LABEL, "dense") else None
        self.positives = self.labelled = 0
        # Rows whose label training rejects (to_label's rule), and the first few reasons.
        self.bad_labels, self.bad_label_examples = 0, list[str]()
        self.numeric, self.integral, self.has_sep = True, True, False
        self.arrow_type = ""  # parquet: the column's type (reported for an UNSUPPORTED one)

    def add(self, values: pa.Array) -> None:
        self.rows += len(values)
        if self.kind == UNSUPPORTED:
            return
        if isinstance(values, pa.DictionaryArray):
            values = values.dictionary_decode()
        if is_list(values.type):  # missing = null or empty list
            filled = pc.sum(pc.greater(pc.list_value_length(values), 0)).as_py() or 0
            self.missing += len(values) - filled
            self._add_ids(values.flatten())
            return
        self.missing += values.null_count
        if self.kind == LABEL:
            label, problem = to_label(values)
            bad = problem.bad if problem is not None else np.zeros(len(values), dtype=bool)
            self.positives += int(label.to_numpy()[~bad].sum())
            self.labelled += int((~bad).sum())
            self.bad_labels += int(bad.sum())
            for i in np.flatnonzero(bad)[: MAX_EXAMPLES - len(self.bad_label_examples)]:
                self.bad_label_examples.append(problem.reason(int(i)))  # type: ignore[union-attr]
        elif self.kind is None:
            values = self._observe(values)
        self._add_ids(values)

    def _add_ids(self, values: pa.Array) -> None:
        self.distinct.add(values)
        if self.counts is not None:
            self.ids += len(values) - values.null_count
            self.counts.add(values)

    def _observe(self, cells: pa.Array) -> pa.Array:
        """Track whether text cells look numeric/integral/multi; return the ids to count."""
        if self.numeric:  # once a cell is not a number, the column is not dense
            floats, not_number = parse_floats(cells)
            self.numeric = not_number is None or not not_number.any()
            finite = floats.filter(pc.is_finite(floats))
            if len(finite) and not pc.all(pc.equal(pc.floor(finite), finite)).as_py():
                self.integral = False
        if pc.any(pc.match_substring(cells, MULTI_SEP)).as_py():
            self.has_sep = True
            return pc.split_pattern(cells, MULTI_SEP).flatten()
        return cells

    def report(self) -> dict[str, Any]:
        kind = self.kind
        if kind == UNSUPPORTED:
            return {"name": self.name, "type": kind, "arrow_type": self.arrow_type}
        if kind is None:
            kind = "multi" if self.has_sep else "dense" if self.numeric and not self.integral else "sparse"
        cardinality = self.distinct.count()
        out = {"name": self.name, "type": kind, "cardinality": cardinality, "missing": self.missing}
        if self.counts is not None and kind in ("sparse", "multi"):
            out["pooling"] = round(self.ids / max(self.rows, 1), 4)
            out["access_histogram"] = [round(h, 5) for h in histogram_of_counts(self.counts.counts())]
        return out


def _take(batches: Iterator[pa.RecordBatch], max_rows: int | None) -> Iterator[pa.RecordBatch]:
    """The first ``max_rows`` rows of a stream (all when None)."""
    left = max_rows
    for batch in batches:
        if left is not None:
            if left <= 0:
                return
            batch = batch.slice(0, left)
            left -= batch.num_rows
        yield batch


def _csv_tables(path: Path, delimiter: str) -> tuple[list[str], Iterator[pa.RecordBatch], ReadStats]:
    """Every column of a CSV as strings; rows with a wrong column count counted as bad."""
    check_file(path)
    names = read_header(path, delimiter, quote=True)
    stats = ReadStats()

    def batches() -> Iterator[pa.RecordBatch]:
        chunks = iter_text_tables(path, names, names, delimiter=delimiter, quote=True, skip_header=True)
        for chunk in chunks:
            stats.skipped += len(chunk.rejected)
            room = MAX_EXAMPLES - len(stats.examples)
            stats.examples += [f"{path} line {line}: {why}" for line, why in chunk.rejected[:room]]
            cells = column_of(chunk.table)
            yield pa.RecordBatch.from_arrays([cells(n) for n in names], names=names)

    return names, batches(), stats


def _libsvm_options(path: Path, options: dict) -> tuple[dict, Schema]:
    """The libsvm mode (fields when the first lines agree on a token count) and its schema."""
    check_file(path)
    first, chunk = next(iter_chunks(path))
    head = chunk[: chunk.rfind(b"\n", 0, 1 << 20) + 1] or chunk  # whole lines of the first MiB
    lines = pc.ascii_trim_whitespace(lines_of(head, path, first))
    lines = lines.filter(pc.not_equal(lines, ""))[:1000]
    counts = np.unique(pc.list_value_length(pc.ascii_split_whitespace(lines)).to_numpy() - 1)
    if counts.size == 0 or counts.max() < 1:
        raise DataError(
            f"{path}: no libsvm features in its first lines (a line is 'label id:value ...'); "
            "is this the right --format?"
        )
    mode = options.get("mode", "fields" if len(counts) == 1 else "bag")
    if mode == "bag":
        sparse = [SparseFeature(name="features", multi=True, weighted=True)]
    else:
        sparse = [SparseFeature(name=f"f{k + 1}") for k in range(int(counts.max()))]
    return {**options, "mode": mode}, Schema(sparse=sparse)


def _movielens_schema(path: Path) -> Schema:
    """Every column of the joined MovieLens files (keys once), typed by their headers."""
    dense, sparse = [], []
    for part, file in files_of(path).items():
        for name, kind in file.types.items():
            if name == RATING or (part in KEYS and name == KEYS[part]):
                continue
            if kind == "float":
                dense.append(DenseFeature(name=name))
            else:
                sparse.append(SparseFeature(name=name, multi=kind == "token_seq"))
    return Schema(dense=dense, sparse=sparse)


def inspect_file(
    path: str | Path,
    fmt: str | None = None,
    options: dict | None = None,
    max_rows: int | None = None,
    tables: bool = False,
) -> dict[str, Any]:
    """Summarise a data file: format, rows, bad rows, positive rate and per-column statistics.

    Streams the file; with ``max_rows`` the counts cover only its first ``max_rows`` rows. No
    schema is needed (see the module doc for the inferred one). With ``tables``, each id column also
    reports the embedding-table features of the learned sharding planner: ``pooling`` (ids per row)
    and ``access_histogram`` (``data.access``; over the rows read: ``max_rows`` 4096 gives the
    histogram of one batch as the planner's cost models see it).
    """
    path = Path(path)
    fmt = fmt or guess_format(path)
    options = dict(options or {})
    validate_options(fmt, options)
    stats = ReadStats()
    if fmt == "csv":
        names, batches, stats = _csv_tables(path, options.get("delimiter", ","))
        columns = [_Column(n, LABEL if n == LABEL else None, tables) for n in names]
    elif fmt == "parquet":
        file = open_parquet(path)
        columns = [
            _Column(f.name, LABEL if f.name == LABEL else _parquet_kind(f.type), tables)
            for f in file.schema_arrow
        ]
        for c, f in zip(columns, file.schema_arrow, strict=True):
            c.arrow_type = str(f.type)
        batches = file.iter_batches()
    else:
        if fmt == "criteo":
            schema = Schema(
                dense=[DenseFeature(name=c) for c in CRITEO_COLUMNS[1:14]],
                sparse=[SparseFeature(name=c) for c in CRITEO_COLUMNS[14:]],
            )
        elif fmt == "libsvm":
            options, schema = _libsvm_options(path, options)
        else:  # movielens: validate_options above rejected unknown formats
            options = {"split": "all", **options}
            schema = _movielens_schema(path)
        batches = read_batches(path, fmt, schema, options, on_bad_row="skip", stats=stats)
        kinds = {LABEL: LABEL} | dict.fromkeys(schema.dense_names, "dense")
        kinds |= {f.name: "multi" if f.multi else "sparse" for f in schema.sparse}
        columns = [
            _Column(n, kinds[n], tables) for n in schema.column_names() if not n.endswith(WEIGHT_SUFFIX)
        ]
    rows = 0
    for batch in _take(batches, max_rows):
        rows += batch.num_rows
        for col in columns:
            col.add(batch.column(col.name))
    label = next((c for c in columns if c.kind == LABEL), None)
    if label is not None and label.bad_labels:  # rows training rejects are bad here too
        stats.skipped += label.bad_labels
        stats.examples += label.bad_label_examples[: max(0, MAX_EXAMPLES - len(stats.examples))]
    return {
        "path": str(path),
        "format": fmt,
        "options": options,
        "rows": rows,
        "bad_rows": stats.skipped,
        "bad_row_examples": stats.examples,
        "positive_rate": label.positives / label.labelled if label and label.labelled else None,
        "columns": [c.report() for c in columns],
    }


def _parquet_kind(dtype: pa.DataType) -> str:
    if pa.types.is_dictionary(dtype):
        dtype = dtype.value_type
    if is_list(dtype) and not pa.types.is_nested(dtype.value_type):
        return "multi"
    if pa.types.is_nested(dtype):  # a struct, map or list of lists: no feature reads it
        return UNSUPPORTED
    return "dense" if pa.types.is_floating(dtype) else "sparse"
