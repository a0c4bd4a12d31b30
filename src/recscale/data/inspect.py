"""``recscale data inspect``: describe a data file without a user schema.

``inspect_file`` guesses the format (unless given), infers a schema, streams the file once and
returns a JSON-able summary: rows, bad rows, positive rate, and per column its type, number of
distinct non-null values (for multi-id columns: distinct ids) and missing values; a multi-id column (a
sequence feature's data, or a bag's) also its ids per row: mean, p50, p90 (nearest rank) and max, and with
``max_len`` the rows a sequence feature of that ``max_len`` would cut (``truncated``).

The counts are those of a training read of the file with the inferred schema and
``data.on_bad_row: skip``: ``rows`` are the rows training reads, ``bad_rows`` the rows it drops (a
wrong column count, a label that is not 0/1, a dense value that is not a finite number, an id that is
none: a float that is not a whole number, bytes that are not UTF-8), not among ``rows``; each example
names its line (parquet: its data row) as training's do. The positive rate and column statistics cover
``rows`` only. Where a CSV column found dense only at the end of the stream held a NaN or infinity, the
file is read a second time with the kinds found, those rows then dropped from every statistic.

Inferred schemas: csv/parquet: the column named ``label`` (or ``inspect_file``'s ``label``) is the label (parquet: one of numbers); numeric
columns holding a non-integer value (parquet: float columns) are dense; text cells containing ``|``
(parquet: list columns) are multi; the rest sparse (parquet: a struct, map or list of lists is
``unsupported``, reported with its type and no statistics; a list column of numbers ``NAME__w`` beside
multi column ``NAME`` is ``weights``, of ``NAME``, which is then ``weighted``: its rows checked as training's
weights are, no statistics of its own). criteo: its fixed layout. libsvm: ``fields``
mode with one feature per token position (``f1``, ``f2``, ...) when the first lines agree on a token count,
else ``bag`` mode (one weighted multi feature ``features``). movielens: every joined column,
``float`` ones dense (but ``rating``, the label's source), ``token_seq`` ones multi; split ``all``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recscale.data.access import histogram_of_counts
from recscale.data.materialize import progress_bar
from recscale.data.preprocess import DenseMoments
from recscale.data.readers import FORMATS, ReadStats, libsvm, read_batches, validate_options
from recscale.data.readers.base import (
    FLOAT32,
    NUMBER_RE,
    BadRows,
    Locate,
    Problem,
    check_file,
    check_sequence,
    consecutive,
    damage_named,
    data_files,
    is_list,
    list_ids,
    list_weights,
    nonempty_ids,
    normal_ids,
    parse_floats,
    raw_arrow_schema,
    split_ids,
    to_dense,
    to_ids,
    to_label,
)
from recscale.data.readers.criteo import COLUMNS as CRITEO_COLUMNS
from recscale.data.readers.csv import Options as CsvOptions
from recscale.data.readers.csv import delimiter_hint
from recscale.data.readers.movielens import KEYS, RATING, files_of
from recscale.data.readers.parquet import holds_numbers, open_parquet
from recscale.data.readers.text import (
    column_of,
    first_line,
    iter_chunks,
    iter_converted,
    iter_text_tables,
    lines_of,
    read_header,
)
from recscale.data.schema import LABEL, WEIGHT_SUFFIX, DenseFeature, Schema, SparseFeature
from recscale.errors import DataError

LIBSVM_LINE = re.compile(rb"^\S+(\s+[^\s:]+:\S+)+\s*$")
# A JSON object or array of them opening a file's first line ('[id],[click]', a CSV header, does not)
JSON_LINE = re.compile(rb"^\s*(\{|\[\s*(\{|$))")
MULTI_SEP = "|"
# A weighted multi-id cell's entry, ``id:weight`` (``csv`` reader): an id, a colon, a number.
ID_WEIGHT_RE = r"^.+:[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$"
UNSUPPORTED = "unsupported"  # a parquet column no feature can read (struct, map, list of lists)
WEIGHTS = "weights"  # a parquet list column NAME__w of numbers: the weights of multi-id column NAME
# Merge the per-batch distinct values every this many batches (bounds the duplicates held).
MERGE_EVERY = 64


def _movielens(path: Path) -> bool:
    """Whether ``path`` is MovieLens atomic files: an ``.inter`` file, or the folder holding one."""
    return path.suffix == ".inter" or (path.is_dir() and any(path.glob("*.inter")))


def guess_format(path: str | Path) -> str:
    """The format of ``path`` from its name, else its first bytes / first line."""
    path = Path(path)
    if _movielens(path):
        return "movielens"
    if path.is_dir():  # a folder of CSV or Parquet splits, say: MovieLens is the one format read as a folder
        # Not a Spark job's markers (_SUCCESS), which hold no rows to inspect.
        files = sorted(f.name for f in path.iterdir() if f.is_file() and not f.name.startswith((".", "_")))
        listed = (
            f"one of its files ({', '.join(files[:5])}{', ...' if len(files) > 5 else ''})"
            if files
            else "a file"
        )
        raise DataError(
            f"{path} is a directory with no MovieLens .inter file; a format is guessed from a file: give {listed}"
        )
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
    if JSON_LINE.match(line):  # JSON (lines): its commas made it a CSV of '{"label": 1' columns
        raise DataError(
            f"{path}: JSON, which recscale does not read; convert it to CSV or Parquet (e.g. pandas: "
            "read_json(PATH, lines=True).to_parquet(OUT)), or pass --format if it is one of "
            f"{', '.join(FORMATS)}"
        )
    if b"," in line:
        return "csv"
    other = next((d for d in ("\t", ";", "|") if d.encode() in line), None)
    hint = f"; if it is text delimited by {other!r}, pass --delimiter {other!r}" if other else ""
    raise DataError(f"{path}: cannot tell its format; pass --format, one of: {', '.join(FORMATS)}{hint}")


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


class _Lengths:
    """How many rows hold each number of ids (a multi-id column's lists, as training reads them)."""

    def __init__(self) -> None:
        self.rows_of = np.zeros(1, dtype=np.int64)  # [k]: rows with k ids
        # [k]: those of them a sequence feature reads (``truncated``): a history with an empty element
        # (3||7, a null or "" in a list) is a bad row there, where a bag drops the empty id
        self.history_rows_of = np.zeros(1, dtype=np.int64)

    def add(self, lengths: np.ndarray, malformed: Problem | None = None) -> None:
        self.rows_of = _histogram(lengths, self.rows_of)
        kept = lengths if malformed is None else lengths[~malformed.bad]
        self.history_rows_of = _histogram(kept, self.history_rows_of)

    def report(self, max_len: int | None) -> dict[str, Any]:
        rows = int(self.rows_of.sum())
        cumulative = np.cumsum(self.rows_of)

        def at_most(q: float) -> int | None:  # nearest rank: q of the rows hold at most this many ids
            return int(np.searchsorted(cumulative, np.ceil(q * rows))) if rows else None

        out: dict[str, Any] = {
            "mean": round(float(self.rows_of @ np.arange(len(self.rows_of))) / rows, 4) if rows else None,
            "p50": at_most(0.5),
            "p90": at_most(0.9),
            "max": int(np.flatnonzero(self.rows_of)[-1]) if rows else None,
        }
        if max_len is not None:
            out["truncated"] = int(self.history_rows_of[max_len + 1 :].sum())
        return out


def _histogram(lengths: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``counts`` (rows by number of ids) with ``lengths`` added."""
    out = np.bincount(lengths, minlength=len(counts))
    out[: len(counts)] += counts
    return out


LARGE_DENSE = 10.0  # a dense column reaching beyond +-this is suggested with scale: standard


class _Column:
    """Running statistics of one column; ``kind`` None means: infer it from text cells (``decided``: the
    kind an earlier pass inferred, which the rows are then checked as). With ``tables``, id columns also
    count each id's accesses (pooling factor, access histogram)."""

    def __init__(self, name: str, kind: str | None, tables: bool = False, decided: str | None = None) -> None:
        self.name, self.kind, self.decided = name, kind, decided
        self.missing = 0
        self.rows = self.ids = 0
        self.distinct = _Distinct()
        self.lengths = _Lengths()  # reported for a multi-id column
        self.counts = _Counts() if tables and (kind or decided) not in (LABEL, "dense") else None
        self.positives = 0
        self.numeric, self.integral, self.has_sep = True, True, False
        # Cells a dense feature rejects as NaN or infinite (``to_dense``'s rule), while still numeric.
        self.nonfinite = 0
        self.moments = DenseMoments.of(np.zeros((0, 1)))  # of its finite numbers: a dense column's range
        self.arrow_type = ""  # parquet: the column's type (reported for an UNSUPPORTED one)
        self.weights_of: _Column | None = None  # WEIGHTS: the multi-id column they weigh
        self.weighted = False  # a multi-id column with a WEIGHTS column
        # A text multi-id column whose every id reads ``id:number``, a fraction among them: weighted cells
        # (``a:0.5|b:2``) written for ``weighted: true``, which inspect counts as ids whole.
        self.pairs: bool | None = None
        self.fractions = False

    def check(self, values: pa.Array, batch: pa.RecordBatch) -> Problem | None:
        """The rows training drops for this column's cells, as ``read_batches`` finds them: a label that
        is not 0/1 (``to_label``), a dense value that is not a finite number (``to_dense``), an id that is
        none (``to_ids``, ``list_ids``: bytes that are not UTF-8, a float that is not a whole number)."""
        kind = self.kind or self.decided
        if kind not in (LABEL, "dense", "sparse", "multi", WEIGHTS):
            return None
        if isinstance(values, pa.DictionaryArray):
            values = values.dictionary_decode()
        if kind == WEIGHTS and self.weights_of is not None:  # as the parquet reader checks them: per id
            ids = batch.column(self.weights_of.name)
            if isinstance(ids, pa.DictionaryArray):
                ids = ids.dictionary_decode()
            return list_weights(values, list_ids(ids)[0], self.weights_of.name)[1]
        if kind == LABEL:
            return to_label(values)[1]
        if kind == "dense":
            return to_dense(values, self.name)[1]
        if kind == "sparse":
            return to_ids(values, self.name)[1]
        return list_ids(values, self.name)[1] if is_list(values.type) else None

    def add(self, values: pa.Array) -> None:
        """Count the cells of rows training reads (those ``check`` rejected already dropped)."""
        self.rows += len(values)
        if self.kind in (UNSUPPORTED, WEIGHTS):
            return
        if isinstance(values, pa.DictionaryArray):
            values = values.dictionary_decode()
        if is_list(values.type):  # ids as training reads them
            (ids,) = nonempty_ids(list_ids(values)[0])
            lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False)
            self.lengths.add(lengths, check_sequence(values, self.name, MULTI_SEP))
            self._add_ids(ids.flatten())
            return
        self.missing += values.null_count
        if self.kind == LABEL:
            self.positives += int(to_label(values)[0].to_numpy().sum())
        elif self.kind is None:
            values = self._observe(values)
        elif self.kind == "dense":
            self._add_numbers(to_dense(values, self.name)[0])
        self._add_ids(values)

    def _add_numbers(self, values: pa.Array) -> None:
        """Count the finite float32 values of ``values`` into the column's range and moments."""
        finite = values.filter(pc.is_finite(values)).to_numpy(zero_copy_only=False)
        self.moments = self.moments.merge(DenseMoments.of(finite.reshape(-1, 1)))

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
            # As to_dense reads them: in float32, where 1e300 is infinite too.
            as_dense = pc.cast(floats, FLOAT32)
            self.nonfinite += pc.sum(pc.invert(pc.is_finite(as_dense))).as_py() or 0  # nulls: missing
            if self.numeric:
                self._add_numbers(as_dense)
        if pc.any(pc.match_substring(cells, MULTI_SEP)).as_py():
            self.has_sep = True
            ids = split_ids(cells, MULTI_SEP)[0]  # as training reads them
            lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False)
            self.lengths.add(lengths, check_sequence(cells, self.name, MULTI_SEP))
            flat = ids.flatten()
            if self.pairs is not False and len(flat):
                self.pairs = bool(pc.all(pc.match_substring_regex(flat, ID_WEIGHT_RE)).as_py())
                self.fractions |= bool(pc.any(pc.match_substring_regex(flat, r":[^:]*\.")).as_py())
            return flat
        self.lengths.add(cells.is_valid().to_numpy(zero_copy_only=False).astype(np.int64))  # one id, or none
        return normal_ids(cells)  # as training reads them: 3.0 is id 3

    def needs_scale(self) -> bool:
        """Whether the column's values reach magnitudes that models train badly on unscaled (inputs ~1e3 took
        an FM's first step to a LogLoss of 210): its suggested feature then standardises them."""
        m = self.moments
        return bool(m.count) and max(abs(float(m.lo[0])), abs(float(m.hi[0]))) > LARGE_DENSE

    def inferred(self) -> str:
        """The column's kind: given, decided by an earlier pass, or inferred from its cells."""
        if self.kind is not None:
            return self.kind
        if self.decided is not None:
            return self.decided
        return "multi" if self.has_sep else "dense" if self.numeric and not self.integral else "sparse"

    def report(self, max_len: int | None = None) -> dict[str, Any]:
        kind = self.inferred()
        if kind == UNSUPPORTED:
            return {"name": self.name, "type": kind, "arrow_type": self.arrow_type}
        if kind == WEIGHTS and self.weights_of is not None:
            return {"name": self.name, "type": kind, "feature": self.weights_of.name}
        cardinality = self.distinct.count()
        # A multi-id row without ids is missing: a null cell or list, an empty one, or only empty ids.
        missing = int(self.lengths.rows_of[0]) if kind == "multi" else self.missing
        out: dict[str, Any] = {
            "name": self.name,
            "type": kind,
            "cardinality": cardinality,
            "missing": missing,
        }
        if kind == "dense" and self.moments.count:
            m = self.moments
            out["range"] = {"min": float(m.lo[0]), "max": float(m.hi[0]), "mean": float(m.mean[0]),
                            "std": float(np.sqrt(m.m2[0] / m.count))}  # fmt: skip
        if kind == "multi":
            if self.weighted:
                out["weighted"] = True
            elif self.pairs and self.fractions:
                out["looks_weighted"] = True  # its ids read id:weight; counted whole, as inspect cannot know
            out["length"] = self.lengths.report(max_len)
        if self.counts is not None and kind in ("sparse", "multi"):
            out["pooling"] = round(self.ids / max(self.rows, 1), 4)
            out["access_histogram"] = [round(h, 5) for h in histogram_of_counts(self.counts.counts())]
        return out


@dataclass
class _Chunk:
    """Rows of a file as read, before the bad-row checks: ``locate`` maps row indices to file positions;
    ``rejected`` are (position, reason) of rows the parser already dropped (a wrong column count)."""

    batch: pa.RecordBatch
    locate: Locate
    rejected: list[tuple[int, str]]
    # The rows' problems as the reader found them (criteo, libsvm: its batch is the raw layout already);
    # None: ``_Column.check`` finds them.
    problems: list[Problem | None] | None = None
    bad: BadRows | None = None  # its file's, where a split's parts are read one after another


def _take(chunks: Iterator[_Chunk], max_rows: int | None) -> Iterator[_Chunk]:
    """The first ``max_rows`` rows of a stream (all when None), good or bad: the rows the parser
    rejected count as read too."""
    left = max_rows
    for chunk in chunks:
        if left is not None:
            if left <= 0:
                return
            n = chunk.batch.num_rows
            if n + len(chunk.rejected) > left:
                # The positions of all rows read, in file order: the cut falls after the left-th.
                at = chunk.locate(np.arange(n))
                cut = np.sort(np.concatenate([at, [pos for pos, _ in chunk.rejected]]))[left - 1]
                kept = int(np.searchsorted(at, cut, side="right"))
                problems = chunk.problems
                if problems is not None:
                    problems = [p if p is None else Problem(p.bad[:kept], p.reason) for p in problems]
                rejected = [r for r in chunk.rejected if r[0] <= cut]
                chunk = _Chunk(chunk.batch.slice(0, kept), chunk.locate, rejected, problems, chunk.bad)
            left -= chunk.batch.num_rows + len(chunk.rejected)
        yield chunk


def _scan(chunks: Iterator[_Chunk], columns: list[_Column], bad: BadRows | None, bar: Any = None) -> int:
    """Stream the chunks into the columns' statistics; the rows training would drop (``_Column.check``)
    are counted by ``bad`` instead (as training counts them: each example names its position), or
    with ``bad`` None were dropped by the reader already. Returns the rows kept: those training reads.
    ``bar`` (a ``progress_bar``, or None) counts the rows read, and is closed at the end."""
    rows = 0
    with bar if bar is not None else nullcontext():
        for chunk in chunks:
            if bar is not None:
                bar.update(chunk.batch.num_rows + len(chunk.rejected))
            batch = chunk.batch
            if (rows_bad := chunk.bad or bad) is not None:
                problems = chunk.problems
                if problems is None:
                    problems = [col.check(batch.column(col.name), batch) for col in columns]
                keep = rows_bad.keep(batch.num_rows, problems, chunk.locate, chunk.rejected)
                if keep is not None:
                    batch = batch.filter(pa.array(keep))
            rows += batch.num_rows
            for col in columns:
                col.add(batch.column(col.name))
    return rows


def _csv_chunks(path: Path, names: list[str], delimiter: str, quote: bool, header: bool) -> Iterator[_Chunk]:
    """Every column of a CSV as strings (``header``: its first line names them, else ``names`` do)."""
    chunks = iter_text_tables(
        path, names, names, delimiter=delimiter, quote=quote, skip_header=header, skip_undecodable=True
    )
    for chunk in chunks:
        cells = column_of(chunk.table)
        batch = pa.RecordBatch.from_arrays([cells(n) for n in names], names=names)
        yield _Chunk(batch, chunk.locate, chunk.rejected)


def _parquet_chunks(path: Path, file: pq.ParquetFile) -> Iterator[_Chunk]:
    row = 1
    with damage_named(path):
        for batch in file.iter_batches():
            yield _Chunk(batch, consecutive(row), [])
            row += batch.num_rows


def _reader_chunks(path: Path, fmt: str, schema: Schema, options: dict) -> Iterator[_Chunk]:
    """Every row of a criteo or libsvm file as its training reader converts it, with the rows' problems."""
    layout = raw_arrow_schema(schema)
    if fmt == "criteo":
        check_file(path)
        for text, arrays, problems in iter_converted(
            path, CRITEO_COLUMNS, CRITEO_COLUMNS, schema, delimiter="\t", quote=False, skip_header=False,
            skip_undecodable=True,
        ):  # fmt: skip
            yield _Chunk(
                pa.RecordBatch.from_arrays(arrays, schema=layout), text.locate, text.rejected, problems
            )
        return
    opts = libsvm.Options.model_validate(options)
    for arrays, problems, locate, dropped in libsvm.parsed_chunks(path, schema, opts, skip_undecodable=True):
        yield _Chunk(pa.RecordBatch.from_arrays(arrays, schema=layout), locate, dropped, problems)


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
    max_len: int | None = None,
    label: str = LABEL,
    progress: bool = False,
    weight: str | None = None,
) -> dict[str, Any]:
    """Summarise a data file: format, rows, bad rows, positive rate and per-column statistics.

    Streams the file; with ``max_rows`` the counts cover only its first ``max_rows`` rows, good or bad
    (movielens, whose files are read whole: the first of its ratings sorted by time, all bad rows). No
    schema is needed (see the module doc for the inferred one). With ``tables``, each id column also
    reports the embedding-table features of the learned sharding planner: ``pooling`` (ids per row)
    and ``access_histogram`` (``data.access``; over the rows read: ``max_rows`` 4096 gives the
    histogram of one batch as the planner's cost models see it). With ``max_len``, each multi-id column's
    ``length`` also counts the rows a sequence feature of that ``max_len`` would cut (``truncated``).
    ``label`` names a csv or parquet file's label column (the schema's ``label``; default ``label``), ``weight``
    its column of row weights (the schema's ``weight``, not a dense feature, which the file's numbers would make it).
    ``progress``: a bar of the rows read (a file of millions of rows takes minutes).
    """
    given = Path(path)
    # A folder or a pattern of parts (not a MovieLens folder: one dataset) is read part after part, as training
    # reads it; each part's bad rows name it. The first part decides the format and the columns.
    parts = [given] if _movielens(given) or fmt == "movielens" else data_files(given, "csv")
    path = parts[0]

    def each(chunks: Callable[[Path], Iterator[_Chunk]], unit: str) -> Iterator[_Chunk]:
        """Every part's chunks, each tagged with its part's bad-row policy."""
        for part in parts:
            bad = BadRows(part, unit, "skip", stats)
            for chunk in chunks(part):
                chunk.bad = bad
                yield chunk

    def bar(again: bool = False) -> Any:
        return progress_bar(progress, f"{'reading again' if again else 'reading'} {given.name}")

    options = dict(options or {})
    fmt = fmt or (
        "csv" if options.keys() & {"delimiter", "quote", "columns"} else guess_format(path)
    )  # csv options
    checked = validate_options(fmt, options)
    if label != LABEL and fmt not in ("csv", "parquet"):
        raise DataError(
            f"{path}: --label names a csv or parquet column; a {fmt} file's label is its format's own"
        )
    if weight is not None and fmt not in ("csv", "parquet"):
        raise DataError(f"{path}: --weight names a csv or parquet column; a {fmt} file has a fixed layout")
    stats = ReadStats()
    fixed: Schema | None = None  # the format's own layout (criteo, libsvm, movielens)
    if fmt == "csv":
        check_file(path)
        assert isinstance(checked, CsvOptions)
        delimiter, quote, header = checked.delimiter, checked.quote, checked.columns is None
        names = read_header(path, delimiter, quote=quote) if header else list(checked.columns or ())
        if header and len(names) == 1 and (other := delimiter_hint(names[0], delimiter)) is not None:
            # The file's columns read as one: no schema, no statistics worth reporting.
            raise DataError(f"{path} line 1: {other} (data inspect: pass --delimiter)")
        _check_label(path, label, names, weight)
        columns = [_Column(n, LABEL if n == label else None, tables) for n in names]

        def csv_part(part: Path) -> Iterator[_Chunk]:
            if part == path or not header:
                return _csv_chunks(part, names, delimiter, quote, header)
            check_file(part)
            own = read_header(part, delimiter, quote=quote)  # in any order, as training reads by name
            if sorted(own) != sorted(names):
                raise DataError(
                    f"{part} line 1: its columns ({', '.join(own)}) are not {path.name}'s ({', '.join(names)})"
                )
            return _csv_chunks(part, own, delimiter, quote, header)

        rows = _scan(_take(each(csv_part, "line"), max_rows), columns, None, bar())
        if any(c.kind is None and c.inferred() == "dense" and c.nonfinite for c in columns):
            # A NaN or infinity in a column found dense only now: training drops its row, so read
            # again with every column's kind decided, dropping those rows from every statistic.
            columns = [
                _Column(c.name, c.kind, tables, None if c.kind is not None else c.inferred()) for c in columns
            ]
            stats = ReadStats()
            rows = _scan(_take(each(csv_part, "line"), max_rows), columns, None, bar(again=True))
    elif fmt == "parquet":
        file = open_parquet(path)
        _check_label(path, label, file.schema_arrow.names, weight)
        columns = [
            _Column(
                f.name, LABEL if f.name == label and holds_numbers(f.type) else _parquet_kind(f.type), tables
            )
            for f in file.schema_arrow
        ]
        for c, f in zip(columns, file.schema_arrow, strict=True):
            c.arrow_type = str(f.type)
        _pair_weights(columns, file.schema_arrow)

        def parquet_part(part: Path) -> Iterator[_Chunk]:
            if part == path:
                return _parquet_chunks(part, file)
            other = open_parquet(part)
            if sorted(other.schema_arrow.names) != sorted(file.schema_arrow.names):
                raise DataError(
                    f"{part}: its columns ({', '.join(other.schema_arrow.names)}) are not {path.name}'s "
                    f"({', '.join(file.schema_arrow.names)})"
                )
            return _parquet_chunks(part, other)

        rows = _scan(_take(each(parquet_part, "row"), max_rows), columns, None, bar())
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
        fixed = schema
        kinds = {LABEL: LABEL} | dict.fromkeys(schema.dense_names, "dense")
        kinds |= {f.name: "multi" if f.multi else "sparse" for f in schema.sparse}
        columns = [
            _Column(n, kinds[n], tables) for n in schema.column_names() if not n.endswith(WEIGHT_SUFFIX)
        ]
        if fmt == "movielens":
            # Its files are read whole, joined and sorted by time: the reader drops (and counts in stats)
            # the bad rows of every file, and max_rows takes the first rows of the sorted ratings.
            batches = read_batches(path, fmt, schema, options, on_bad_row="skip", stats=stats)
            chunks = _take((_Chunk(b, consecutive(1), []) for b in batches), max_rows)
            rows = _scan(chunks, columns, None, bar())
        else:  # every row as the reader converts it, bad ones too, so that max_rows counts them
            chunks = each(lambda part: _reader_chunks(part, fmt, schema, options), "line")
            rows = _scan(_take(chunks, max_rows), columns, None, bar())
    if not rows and not stats.skipped and max_rows != 0:
        raise DataError(f"{given} has no data rows")  # as training refuses it (a header alone, say)
    config_schema, left_out = _config_schema(columns, fixed, label, weight)
    label_column = next((c for c in columns if c.kind == LABEL), None)
    return {
        "path": str(given),
        **({"files": len(parts)} if len(parts) > 1 else {}),
        "format": fmt,
        "options": options,
        "schema": config_schema,
        "schema_left_out": left_out,
        "rows": rows,
        "bad_rows": stats.skipped,
        "bad_row_examples": stats.examples,
        "positive_rate": label_column.positives / label_column.rows
        if label_column and label_column.rows
        else None,
        "columns": [c.report(max_len) for c in columns],
    }


def _check_label(path: Path, label: str, names: list[str], weight: str | None = None) -> None:
    """A label column named otherwise than ``label``, and a row-weight column, must be columns of the file."""
    for flag, name in (("--label", label if label != LABEL else None), ("--weight", weight)):
        if name is not None and name not in names:
            raise DataError(
                f"{path}: {flag} {name!r} is not a column of the file; its columns are: {', '.join(names)}"
            )
    if weight is not None and weight == label:
        raise DataError(f"{path}: --weight {weight!r} is the label column; name the column of row weights")


def _config_schema(
    columns: list[_Column], fixed: Schema | None, label: str = LABEL, weight: str | None = None
) -> tuple[dict[str, Any] | None, list[str]]:
    """The ``data.schema`` that trains on the file as inspected, as a config takes it (JSON, which YAML reads):
    the format's fixed layout (``fixed``: criteo, libsvm, movielens), else the columns as inferred (None for
    columns no schema can take: no label column, no features); and the columns left out of it because
    training refuses their name (a pandas index column's empty name, or ``label`` where ``label`` names
    another column: the readers skip a column no feature names)."""
    left_out: list[str] = []
    if fixed is None:
        kinds = {c.name: c.inferred() for c in columns}
        dense, sparse = [], []
        for c in columns:
            if c.name == weight:  # the schema's row weights (--weight): no feature of the model
                continue
            try:
                if c.name == LABEL and c.kind != LABEL:  # the name the readers give the label column
                    raise ValueError(c.name)
                if kinds[c.name] == "dense":
                    dense.append(DenseFeature(name=c.name, scale="standard" if c.needs_scale() else "none"))
                elif kinds[c.name] in ("sparse", "multi"):
                    sparse.append(
                        SparseFeature(name=c.name, multi=kinds[c.name] == "multi", weighted=c.weighted)
                    )
            except ValueError:
                left_out.append(c.name)
        try:
            fixed = Schema(label=label, weight=weight, dense=dense, sparse=sparse)
        except ValueError:
            return None, left_out
        if LABEL not in kinds.values():
            return None, left_out
    return fixed.model_dump(mode="json", exclude_defaults=True), left_out


def _pair_weights(columns: list[_Column], arrow: pa.Schema) -> None:
    """A list-of-numbers column ``NAME__w`` beside multi-id column ``NAME`` holds NAME's weights, as the
    parquet reader reads them for a weighted feature: not ids of a feature of its own."""
    by_name = {c.name: c for c in columns}
    for c in columns:
        owner = by_name.get(c.name.removesuffix(WEIGHT_SUFFIX))
        if not c.name.endswith(WEIGHT_SUFFIX) or owner is None or owner is c or owner.kind != "multi":
            continue
        dtype = arrow.field(c.name).type
        dtype = dtype.value_type if pa.types.is_dictionary(dtype) else dtype
        if is_list(dtype) and (
            pa.types.is_integer(dtype.value_type) or pa.types.is_floating(dtype.value_type)
        ):
            c.kind, c.counts, c.weights_of, owner.weighted = WEIGHTS, None, owner, True


def _parquet_kind(dtype: pa.DataType) -> str:
    if pa.types.is_dictionary(dtype):
        dtype = dtype.value_type
    if is_list(dtype) and not pa.types.is_nested(dtype.value_type):
        return "multi"
    if pa.types.is_nested(dtype):  # a struct, map or list of lists: no feature reads it
        return UNSUPPORTED
    return "dense" if pa.types.is_floating(dtype) else "sparse"


# Rows a sample needs before a column distinct on every one of them is said to look like a row id.
ROW_ID_ROWS = 1000


def inspect_notes(report: dict[str, Any], label: str = LABEL) -> list[str]:
    """What ``inspect_file``'s ``report`` suggests doing before the schema is used, a line each."""
    notes = []
    columns = report["columns"]
    # A column unique on every row of a large sample is a row id (an impression or request id): its embedding
    # never sees an id twice, and at evaluation every id is one it never saw.
    unique = [
        c["name"] for c in columns
        if c["type"] == "sparse" and c["cardinality"] == report["rows"] >= ROW_ID_ROWS and not c["missing"]
    ]  # fmt: skip
    if unique:
        notes.append(
            f"{', '.join(unique)} {'holds' if len(unique) == 1 else 'hold'} a distinct value on each of the "
            f"{report['rows']:,} rows (a row id?): no id repeats, so its table learns nothing that carries to new "
            "rows; drop it from the schema unless the full data repeats its ids"
        )
    notes += [
        f"every id of {c['name']} reads id:weight (e.g. a:0.5): if they are weighted ids, set weighted: true on its "
        "feature (its cardinality here counts each id:weight whole)"
        for c in columns
        if c.get("looks_weighted")
    ]
    if report["format"] in ("csv", "parquet") and all(c["type"] != "label" for c in columns):
        names = [c["name"] for c in columns]
        # A CSV's first line that holds numbers is a data row: the file has no header.
        headerless = (
            report["format"] == "csv"
            and "columns" not in report["options"]
            and any(re.fullmatch(NUMBER_RE, n.strip()) for n in names)
        )
        fix = f"name its {len(names)} columns with --columns A,B,... (the label's as --label gives it, default 'label')"
        notes.append(
            f"no label column '{label}', so no schema: "
            + (
                f"line 1 reads as data, not a header: {fix}"
                if headerless
                else "name yours with --label COLUMN"
            )
        )
    return notes
