"""Pieces the readers share: bad-row policy, vectorised cell conversion, streaming text chunks.

Every conversion works on whole pyarrow arrays. Per-row Python runs only to word the message of
a bad row (at most a few per batch), never on the happy path.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Literal, NoReturn

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from recscale.data.schema import LABEL, WEIGHT_SUFFIX, Schema
from recscale.errors import DataError

OnBadRow = Literal["error", "skip"]
MAX_EXAMPLES = 5
SKIP_HINT = "(set data.on_bad_row: skip to drop such rows)"
# Bytes read per text chunk: big enough to amortise per-chunk overhead, small enough to stream.
BLOCK_BYTES = 8 << 20
# A number as pyarrow's string->float cast accepts it, plus NaN/inf spelled out (reported as such).
NUMBER_RE = r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$|^[+-]?(?i:nan|inf|infinity)$"

FLOAT32 = pa.float32()

Locate = Callable[[np.ndarray], np.ndarray]


@dataclass
class ReadStats:
    """What one read produced: rows yielded, bad rows dropped, and the first reasons for the drops."""

    rows: int = 0
    skipped: int = 0
    examples: list[str] = field(default_factory=list)


@dataclass
class Problem:
    """Rows of one batch failing one check: ``bad`` is a (rows,) bool mask, ``reason(i)`` says why."""

    bad: np.ndarray
    reason: Callable[[int], str]


class BadRows:
    """Applies ``on_bad_row`` to one file: raise on its first bad row, or drop and count bad rows.

    Positions are 1-based ``unit`` s of the file: ``line`` (header = line 1) or data ``row``.
    """

    def __init__(self, where: str | Path, unit: str, on_bad_row: OnBadRow, stats: ReadStats) -> None:
        self.where = str(where)
        self.unit = unit
        self.on_bad_row = on_bad_row
        self.stats = stats

    def keep(
        self,
        n: int,
        problems: Sequence[Problem | None],
        locate: Locate,
        rejected: Sequence[tuple[int, str]] = (),
    ) -> np.ndarray | None:
        """Which of a batch's ``n`` rows to keep, as a (n,) bool mask; None when all are good.

        locate: row indices -> file positions (increasing); rejected: (position, reason) of rows
        the parser already dropped, e.g. for a wrong column count.
        """
        found = [p for p in problems if p is not None]
        bad = np.zeros(n, dtype=bool)
        for p in found:
            bad |= p.bad
        bad_idx = np.flatnonzero(bad)
        if not len(bad_idx) and not rejected:
            return None
        # Word only the first few bad rows: that is all the error or the examples need.
        first = bad_idx[:MAX_EXAMPLES]
        worded = [
            (int(pos), next(p.reason(int(i)) for p in found if p.bad[i]))
            for i, pos in zip(first, locate(first), strict=True)
        ]
        worded = sorted([*worded, *rejected], key=lambda e: e[0])
        if self.on_bad_row == "error":
            self.fail(*worded[0])
        self.stats.skipped += len(bad_idx) + len(rejected)
        room = MAX_EXAMPLES - len(self.stats.examples)
        self.stats.examples += [f"{self.where} {self.unit} {pos}: {why}" for pos, why in worded[:room]]
        return ~bad

    def fail(self, pos: int, reason: str) -> NoReturn:
        raise DataError(f"{self.where} {self.unit} {pos}: {reason} {SKIP_HINT}")


def consecutive(first: int) -> Locate:
    """Locate for batches whose rows are consecutive positions starting at ``first``."""
    return lambda idx: first + idx


def check_file(path: Path) -> None:
    """DataError unless ``path`` is a non-empty regular file."""
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if path.is_dir():
        raise DataError(f"{path} is a directory; this format reads one file")
    if path.stat().st_size == 0:
        raise DataError(f"{path} is empty (0 bytes)")


def missing_columns_error(path: Path, missing: Sequence[str], columns: Sequence[str]) -> DataError:
    """The error for schema columns absent from a file: names them and lists what the file has."""
    return DataError(
        f"{path}: column(s) {', '.join(repr(m) for m in missing)} named in the schema are not in the file; "
        f"its columns are: {', '.join(columns)}"
    )


def raw_arrow_schema(schema: Schema) -> pa.Schema:
    """The pyarrow schema of reader output for ``schema`` (see ``recscale.data.schema``)."""
    fields = [pa.field(LABEL, pa.float32(), nullable=False)]
    fields += [pa.field(name, pa.float32()) for name in schema.dense_names]
    for f in schema.sparse:
        if not f.multi:
            fields.append(pa.field(f.name, pa.string()))
            continue
        fields.append(pa.field(f.name, pa.list_(pa.string())))
        if f.weighted:
            fields.append(pa.field(f.name + WEIGHT_SUFFIX, pa.list_(pa.float32())))
    return pa.schema(fields)


# ---------------------------------------------------------------- cell conversion


def parse_floats(cells: pa.Array) -> tuple[pa.Array, np.ndarray | None]:
    """Cells (strings or numbers) -> float64, nulls kept; plus a mask of non-numeric cells (None: none)."""
    try:
        return pc.cast(cells, pa.float64()), None
    except pa.ArrowInvalid:
        pass
    # Slow path, only for a batch holding a bad cell: find which cells are not numbers.
    trimmed = pc.utf8_trim_whitespace(cells)
    ok = pc.match_substring_regex(trimmed, NUMBER_RE)
    values = pc.cast(pc.if_else(ok, trimmed, None), pa.float64())
    return values, ~pc.fill_null(ok, True).to_numpy(zero_copy_only=False)


def to_label(cells: pa.Array, minus_one: bool = False) -> tuple[pa.Array, Problem | None]:
    """Label cells -> float32 0/1. With ``minus_one``, -1 means 0 (libsvm). Null or other = bad."""
    values, _ = parse_floats(cells)
    v = values.to_numpy(zero_copy_only=False)  # null -> NaN, which fails every test below
    ok = (v == 0) | (v == 1)
    if minus_one:
        ok |= v == -1
    label = pa.array((v == 1).astype(np.float32))
    if ok.all():
        return label, None
    allowed = "-1, 0 or 1" if minus_one else "0 or 1"

    def reason(i: int) -> str:
        raw = cells[i].as_py()
        return "label is missing" if raw is None else f"label {raw!r} is not {allowed}"

    return label, Problem(~ok, reason)


def to_dense(cells: pa.Array, name: str, dtype: pa.DataType = FLOAT32) -> tuple[pa.Array, Problem | None]:
    """Dense cells -> ``dtype``, null = missing. Non-numeric, NaN or infinite (in ``dtype``) = bad."""
    values, not_number = parse_floats(cells)
    values = pc.cast(values, dtype)
    finite = pc.fill_null(pc.is_finite(values), True).to_numpy(zero_copy_only=False)
    bad = ~finite if not_number is None else ~finite | not_number
    if not bad.any():
        return values, None

    def reason(i: int) -> str:
        what = "not a number" if not_number is not None and not_number[i] else "NaN or infinite"
        return f"dense feature '{name}' value {cells[i].as_py()!r} is {what}"

    return values, Problem(bad, reason)


def is_list(dtype: pa.DataType) -> bool:
    return pa.types.is_list(dtype) or pa.types.is_large_list(dtype)


def to_ids(cells: pa.Array) -> pa.Array:
    """Single-id cells -> strings (ints become their decimal text), null = missing."""
    return cells if cells.type == pa.string() else pc.cast(cells, pa.string())


def _rows_with(bad_items: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """(rows,) mask of rows owning at least one bad item, items laid out row by row."""
    owner = np.repeat(np.arange(len(lengths)), lengths)
    return np.bincount(owner[bad_items], minlength=len(lengths)) > 0


def _lists(lengths: np.ndarray, values: pa.Array) -> pa.ListArray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def split_ids(
    cells: pa.Array, sep: str, weighted: bool = False, name: str = ""
) -> tuple[pa.Array, pa.Array | None, Problem | None]:
    """Multi-id cells ``"a|b|c"`` -> list<string> (empty cell = []); plus list<float32> weights.

    Weighted entries are ``id:weight`` (``id`` alone weighs 1); ``name`` is the feature, for
    messages. Empty ids (``a||b``) are dropped.
    """
    parts = pc.split_pattern(pc.fill_null(cells, ""), sep)
    flat = parts.flatten()
    lengths = np.diff(parts.offsets.to_numpy())
    nonempty = pc.not_equal(flat, "").to_numpy(zero_copy_only=False)
    if not nonempty.all():
        owner = np.repeat(np.arange(len(lengths)), lengths)
        lengths = np.bincount(owner[nonempty], minlength=len(lengths))
        flat = flat.filter(pa.array(nonempty))
    if not weighted:
        return _lists(lengths, flat), None, None
    pairs = pc.extract_regex(flat, r"^(?P<id>.*?)(?::(?P<w>[^:]*))?$")
    w_text = pairs.field("w")
    weights, bad_w = to_dense(pc.if_else(pc.equal(w_text, ""), "1", w_text), name)
    ids, weights = _lists(lengths, pairs.field("id")), _lists(lengths, weights)
    if bad_w is None:
        return ids, weights, None

    def reason(i: int) -> str:
        start = int(lengths[:i].sum())
        j = start + int(np.argmax(bad_w.bad[start : start + lengths[i]]))
        return f"sparse feature '{name}' weight {w_text[j].as_py()!r} is not a finite number"

    return ids, weights, Problem(_rows_with(bad_w.bad, lengths), reason)


def list_ids(cells: pa.Array) -> pa.Array:
    """List cells (ints or strings) -> list<string>, null list = []."""
    ids = pc.cast(cells, pa.list_(pa.string()))
    return pc.fill_null(ids, pa.scalar([], pa.list_(pa.string())))


def list_weights(weights: pa.Array, ids: pa.Array, name: str) -> tuple[pa.Array, Problem | None]:
    """A ``{name}__w`` list column -> list<float32> aligned with ``ids``; misaligned or non-finite = bad."""
    weights = pc.fill_null(pc.cast(weights, pa.list_(pa.float32())), pa.scalar([], pa.list_(pa.float32())))
    n_w = pc.list_value_length(weights).to_numpy()
    n_ids = pc.list_value_length(ids).to_numpy()
    finite = pc.fill_null(pc.is_finite(weights.flatten()), False).to_numpy(zero_copy_only=False)
    bad = (n_w != n_ids) | _rows_with(~finite, n_w)
    if not bad.any():
        return weights, None

    def reason(i: int) -> str:
        if n_w[i] != n_ids[i]:
            return f"sparse feature '{name}' has {n_ids[i]} ids but {n_w[i]} weights"
        return f"sparse feature '{name}' has a weight that is not a finite number"

    return weights, Problem(bad, reason)


def convert(column: Callable[[str], pa.Array], schema: Schema) -> tuple[list[pa.Array], list[Problem | None]]:
    """Source columns (fetched by name) -> raw-layout arrays in ``schema.column_names()`` order.

    Multi-id features come as list columns (weights in ``{name}__w``) or as text cells split by
    the feature's ``sep``.
    """
    label, problem = to_label(column(schema.label))
    arrays, problems = [label], [problem]
    for d in schema.dense:
        values, problem = to_dense(column(d.name), d.name)
        arrays.append(values)
        problems.append(problem)
    for f in schema.sparse:
        cells = column(f.name)
        if not f.multi:
            arrays.append(to_ids(cells))
        elif is_list(cells.type):
            ids = list_ids(cells)
            arrays.append(ids)
            if f.weighted:
                weights, problem = list_weights(column(f.name + WEIGHT_SUFFIX), ids, f.name)
                arrays.append(weights)
                problems.append(problem)
        else:
            ids, weights, problem = split_ids(cells, f.sep, f.weighted, f.name)
            arrays += [ids] if weights is None else [ids, weights]
            problems.append(problem)
    return arrays, problems


def make_batch(arrays: list[pa.Array], schema: Schema, keep: np.ndarray | None) -> pa.RecordBatch:
    """The raw-layout batch of ``arrays``, bad rows (``keep`` False) dropped."""
    batch = pa.RecordBatch.from_arrays(arrays, schema=raw_arrow_schema(schema))
    return batch if keep is None else batch.filter(pa.array(keep))


def rechunk(batches: Iterator[pa.RecordBatch], rows: int) -> Iterator[pa.RecordBatch]:
    """Re-cut a stream of batches into batches of exactly ``rows`` rows (the last may be shorter)."""
    pending: list[pa.RecordBatch] = []
    count = 0
    for batch in batches:
        while batch.num_rows:
            take = min(rows - count, batch.num_rows)
            pending.append(batch.slice(0, take))
            count += take
            batch = batch.slice(take)
            if count == rows:
                yield pending[0] if len(pending) == 1 else pa.concat_batches(pending)
                pending, count = [], 0
    if count:
        yield pending[0] if len(pending) == 1 else pa.concat_batches(pending)


# ---------------------------------------------------------------- delimited text


def iter_chunks(path: Path, skip_first_line: bool = False) -> Iterator[tuple[int, bytes]]:
    """Stream a text file (``.gz``/``.bz2``/... decompressed) as chunks of whole lines.

    Yields (1-based line number of the chunk's first line, bytes). Only line ends are counted,
    so line numbers are exact for any content.
    """
    line, carry = 1, b""
    with pa.input_stream(str(path), compression="detect") as stream:
        while data := stream.read(BLOCK_BYTES):
            data = carry + data
            cut = data.rfind(b"\n") + 1
            chunk, carry = data[:cut], data[cut:]
            if skip_first_line and chunk:
                skip_first_line = False
                chunk = chunk[chunk.find(b"\n") + 1 :]
                line += 1
            if chunk:
                yield line, chunk
                line += chunk.count(b"\n")
    if carry and not skip_first_line:
        yield line, carry


def lines_of(chunk: bytes, where: Path, first_line: int) -> pa.Array:
    """A chunk's lines as one string array (line ends included), built without a per-line loop."""
    buf = np.frombuffer(chunk, dtype=np.uint8)
    ends = np.flatnonzero(buf == 10) + 1
    if not len(ends) or ends[-1] != len(buf):
        ends = np.append(ends, len(buf))
    offsets = np.concatenate([[0], ends]).astype(np.int32)
    raw = pa.Array.from_buffers(pa.binary(), len(ends), [None, pa.py_buffer(offsets), pa.py_buffer(chunk)])
    try:
        return raw.cast(pa.string())
    except pa.ArrowInvalid:
        raise DataError(f"{where} lines {first_line}-{first_line + len(ends) - 1}: not UTF-8 text") from None


def _text_options(delimiter: str, quote: bool, handler: Callable | None) -> pacsv.ParseOptions:
    quote_char = '"' if quote else False
    return pacsv.ParseOptions(delimiter=delimiter, quote_char=quote_char, invalid_row_handler=handler)


def first_line(path: Path) -> bytes:
    """A text file's first line (line end excluded), read without loading the file."""
    with pa.input_stream(str(path), compression="detect") as stream:
        head = b""
        while b"\n" not in head and (more := stream.read(1 << 16)):
            head += more
    return head.split(b"\n", 1)[0].rstrip(b"\r")


def read_header(path: Path, delimiter: str, quote: bool) -> list[str]:
    """Column names in a delimited file's first line."""
    line = first_line(path)
    if not line.strip():
        raise DataError(f"{path} is empty: no header line")
    if b"\0" in line:
        raise DataError(f"{path} line 1: binary data, not delimited text; check the path and data.format")
    try:
        table = pacsv.read_csv(
            io.BytesIO(line + b"\n"),
            read_options=pacsv.ReadOptions(use_threads=False),
            parse_options=_text_options(delimiter, quote, None),
        )
    except pa.ArrowInvalid as e:
        reason = str(e).splitlines()[0][:120]
        raise DataError(f"{path} line 1: not a {delimiter!r}-delimited header ({reason}); check data.format") from None
    return table.column_names


def _nonempty_lines(chunk: bytes) -> np.ndarray:
    """0-based indices of a chunk's non-empty lines: the ones pyarrow parses into rows."""
    buf = np.frombuffer(chunk, dtype=np.uint8)
    starts = np.concatenate([[0], np.flatnonzero(buf == 10) + 1])
    if starts[-1] == len(buf):  # the "line" after a final newline does not exist
        starts = starts[:-1]
    ends = np.append(starts[1:] - 1, len(buf))
    length = ends - starts
    cr_only = (length == 1) & (buf[np.minimum(starts, len(buf) - 1)] == 13)
    return np.flatnonzero((length > 0) & ~cr_only)


@dataclass
class TextChunk:
    """One chunk of a delimited file: ``table`` has string columns (null = empty cell)."""

    table: pa.Table
    locate: Locate  # table row indices -> 1-based file lines
    rejected: list[tuple[int, str]]  # (line, reason) of rows with a wrong column count, not in table


def iter_text_tables(
    path: Path,
    names: Sequence[str],
    include: Sequence[str],
    *,
    delimiter: str,
    quote: bool,
    skip_header: bool,
) -> Iterator[TextChunk]:
    """Stream a delimited text file as string tables of the ``include`` columns, with exact lines.

    ``names`` are all the file's columns in order. Empty lines are skipped.
    """
    convert_options = pacsv.ConvertOptions(
        include_columns=list(include),
        column_types=dict.fromkeys(include, pa.string()),
        strings_can_be_null=True,
        null_values=[""],
    )
    for first, chunk in iter_chunks(path, skip_first_line=skip_header):
        yield _parse_chunk(path, first, chunk, names, (delimiter, quote), convert_options)


def _parse_chunk(
    path: Path,
    first: int,
    chunk: bytes,
    names: Sequence[str],
    dialect: tuple[str, bool],
    convert_options: pacsv.ConvertOptions,
) -> TextChunk:
    """Parse one chunk; rows with a wrong column count are dropped and reported by line."""
    bad_rows: list[pacsv.InvalidRow] = []

    def on_bad(row: pacsv.InvalidRow) -> str:
        bad_rows.append(row)
        return "skip"

    try:
        # Single-threaded: only then does pyarrow number rejected rows; and its CPU pool, used by
        # threaded reads, can abort the process at exit ("terminate called without an active
        # exception", apache/arrow#34314).
        table = pacsv.read_csv(
            pa.BufferReader(chunk),
            # One block for the whole chunk: a cell longer than pyarrow's default 1 MiB block would
            # otherwise "straddle two block boundaries" and fail.
            read_options=pacsv.ReadOptions(
                column_names=list(names), use_threads=False, block_size=len(chunk) + 1
            ),
            parse_options=_text_options(*dialect, on_bad),
            convert_options=convert_options,
        )
    except pa.ArrowInvalid as e:  # e.g. bytes that are not UTF-8
        last = first + chunk.count(b"\n") - chunk.endswith(b"\n")
        raise DataError(f"{path} lines {first}-{last}: {e}") from None
    lines = cache(lambda: _nonempty_lines(chunk))
    # pyarrow numbers rejected rows 1-based among the chunk's non-empty lines.
    gone = np.array([r.number - 1 for r in bad_rows], dtype=np.int64)
    rejected = [
        (first + int(lines()[k]), f"has {r.actual_columns} columns, expected {r.expected_columns}")
        for k, r in zip(gone, bad_rows, strict=True)
    ]

    def locate(idx: np.ndarray) -> np.ndarray:
        return first + np.delete(lines(), gone)[idx]

    return TextChunk(table.combine_chunks(), locate, rejected)


def column_of(table: pa.Table) -> Callable[[str], pa.Array]:
    """Fetch a table column as one contiguous array."""
    return lambda name: table.column(name).combine_chunks()
