"""Streaming delimited text: whole-line chunks of a (compressed) file, parsed by pyarrow with exact
line numbers for errors and dropped rows."""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from recscale.data.chunks import ordered_map
from recscale.data.readers.base import NUMBER_RE, Locate, Problem, check_unique_columns, convert, damage_named
from recscale.data.schema import Schema
from recscale.errors import DataError

# Bytes read per text chunk: big enough to amortise per-chunk overhead, small enough to stream.
BLOCK_BYTES = 8 << 20

R = TypeVar("R")
# pyarrow ends a row at a carriage return alone too, where recscale counts lines by their line feeds.
PARQUET_MAGIC = b"PAR1"  # a Parquet file's first bytes
UTF8_BOM = b"\xef\xbb\xbf"  # what some editors write first in a UTF-8 file: no part of its first line
_LINE_MAX = 16 << 20  # a header line longer than this is no header (first_line)
BARE_CR = (
    "a carriage return (\\r) inside the line, which ends a row for the parser; remove it "
    "(lines end in \\n or \\r\\n)"
)


@contextmanager
def _input_stream(path: Path) -> Iterator[pa.NativeFile]:
    """``path`` opened for reading, decompressed as its name says; a damaged file named (``damage_named``), a
    Parquet file too (read as text, its bytes were called no UTF-8, to be saved as UTF-8)."""
    with open(path, "rb") as f:
        if f.read(len(PARQUET_MAGIC)) == PARQUET_MAGIC:
            raise DataError(f"{path} is a Parquet file, not delimited text; read it with data.format=parquet")
    with damage_named(path), pa.input_stream(str(path), compression="detect") as stream:
        yield stream


def iter_chunks(
    path: Path, skip_first_line: bool = False, quote: bool = False
) -> Iterator[tuple[int, bytearray]]:
    """Stream a text file (``.gz``/``.bz2``/... decompressed) as chunks of whole lines.

    Yields (1-based line number of the chunk's first line, the chunk's bytes). Only line ends are
    counted, so line numbers are exact for any content. Each chunk is a buffer of its own that the
    stream reads into: the bytes are copied once (a partial last line is carried over to the next chunk).
    A UTF-8 byte order mark at the file's start is dropped.
    A block with no line feed but a carriage return is an error at once (``_check_no_bare_cr``), not a
    file read whole into memory as one line. ``quote``: '"' quotes cells, which may hold a ``\r``.
    """
    line, carry, first_block = 1, b"", True
    with _input_stream(path) as stream:
        while True:
            chunk = bytearray(len(carry) + BLOCK_BYTES)
            chunk[: len(carry)] = carry
            end = len(carry) + stream.readinto(memoryview(chunk)[len(carry) :])
            if end == len(carry):
                break
            if first_block and chunk.startswith(UTF8_BOM):  # as pyarrow's parser skips it in a CSV header
                del chunk[: len(UTF8_BOM)]
                end -= len(UTF8_BOM)
            first_block = False
            cut = chunk.rfind(b"\n", 0, end) + 1
            if not cut:
                _check_no_bare_cr(path, line, chunk, end, quote)
            carry = bytes(chunk[cut:end])
            del chunk[cut:]  # in place: the chunk ends at its last line end
            if skip_first_line and chunk:
                skip_first_line = False
                del chunk[: chunk.find(b"\n") + 1]
                line += 1
            if chunk:
                yield line, chunk
                line += chunk.count(b"\n")
    if carry and not skip_first_line:
        yield line, bytearray(carry)


def _check_no_bare_cr(path: Path, line: int, chunk: bytearray, end: int, quote: bool) -> None:
    """A DataError when ``chunk[:end]``, a block without a line feed, holds a carriage return that no line
    feed follows (one at its very end may be a CRLF's first half): a file whose lines end in \r alone
    (old Mac) is one line for recscale. Where quotes are in the block, a \r may be inside a quoted cell,
    so the check is left to the parse."""
    last = end - 1 if chunk[end - 1 : end] == b"\r" else end
    if chunk.find(b"\r", 0, last) >= 0 and not (quote and chunk.find(b'"', 0, end) >= 0):
        raise DataError(f"{path} line {line}: {BARE_CR}")


def lines_of(chunk: bytes | bytearray, where: Path, first_line: int) -> pa.Array:
    """A chunk's lines as one string array (line ends included), built without a per-line loop; a
    ``NotUtf8`` error names the first line that is not UTF-8 text."""
    buf = np.frombuffer(chunk, dtype=np.uint8)
    ends = np.flatnonzero(buf == 10) + 1
    if not len(ends) or ends[-1] != len(buf):
        ends = np.append(ends, len(buf))
    offsets = np.concatenate([[0], ends]).astype(np.int32)
    raw = pa.Array.from_buffers(pa.binary(), len(ends), [None, pa.py_buffer(offsets), pa.py_buffer(chunk)])
    try:
        return raw.cast(pa.string())
    except pa.ArrowInvalid:
        raise utf8_error(where, chunk, first_line) or DataError(f"{where}: not UTF-8 text") from None


class NotUtf8(DataError):
    """A line that is not UTF-8 text: what ``on_bad_row: skip`` drops (``drop_undecodable``)."""


def _not_utf8(data: bytes | bytearray, e: UnicodeDecodeError) -> str:
    """Why ``data`` failed to decode at ``e``: its byte and 1-based position in its line."""
    at = e.start - data.rfind(b"\n", 0, e.start)
    return f"not UTF-8 text (byte {data[e.start]:#04x} at position {at})"


def utf8_error(path: Path, data: bytes | bytearray, first: int) -> NotUtf8 | None:
    """The error naming the line (``data`` starts at line ``first``) and position of ``data``'s first byte
    that is not UTF-8 text; None when all of it is."""
    try:
        data.decode()
    except UnicodeDecodeError as e:
        line = first + data.count(b"\n", 0, e.start)
        return NotUtf8(f"{path} line {line}: {_not_utf8(data, e)}; save the file as UTF-8")
    return None


def drop_undecodable(chunk: bytes | bytearray, first: int) -> tuple[bytes, list[tuple[int, str]]]:
    """``chunk`` (which starts at line ``first``) with each line that is not UTF-8 text emptied, its line
    feed kept: an empty line is no row, and every later line keeps its number; and (line, reason) of
    each, the rows ``on_bad_row: skip`` counts as dropped. Runs only on a chunk that failed to decode, so
    its per-line loop is off the happy path."""
    lines = bytes(chunk).split(b"\n")
    dropped = []
    for k, line in enumerate(lines):
        try:
            line.decode()
        except UnicodeDecodeError as e:
            dropped.append((first + k, _not_utf8(line, e)))
            lines[k] = b""
    return b"\n".join(lines), dropped


def _text_options(delimiter: str, quote: bool, handler: Callable | None) -> pacsv.ParseOptions:
    quote_char = '"' if quote else False
    return pacsv.ParseOptions(delimiter=delimiter, quote_char=quote_char, invalid_row_handler=handler)


def first_line(path: Path) -> bytes:
    """A text file's first line (line end excluded), read without loading the file: a DataError if it has
    no line end within ``_LINE_MAX`` bytes (a file of other data, or of one huge line)."""
    with _input_stream(path) as stream:
        head = b""
        # A carriage return ends the search too: a file whose lines end in \r alone is not read whole (the
        # header check names it); one at the very end may be a CRLF's first half.
        while b"\n" not in head and b"\r" not in head[:-1] and (more := stream.read(1 << 16)):
            head += more
            if len(head) > _LINE_MAX and b"\n" not in head and b"\r" not in head:
                raise DataError(
                    f"{path} line 1: no line end in its first {_LINE_MAX >> 20} MiB, so no header line; "
                    "check the path and data.format"
                )
    return head.split(b"\n", 1)[0].rstrip(b"\r")


HEADERLESS_HINT = (
    "give the file a first line naming its columns (Spark: write with option header=true), or name them in "
    "data.options.columns (a file without a header)"
)


def _check_header(path: Path, names: list[str]) -> None:
    """A header's names are unique; a first line that repeats a number or an empty cell is a row of data (a
    part cut from a file after its header, a Spark CSV written without one), said so, not as duplicate names."""
    if len(set(names)) < len(names) and any(
        re.fullmatch(NUMBER_RE, n.strip()) or not n.strip() for n in names
    ):
        raise DataError(f"{path} line 1 is a row of data, not a header; {HEADERLESS_HINT}")
    check_unique_columns(f"{path} line 1: the header", names)


def read_header(path: Path, delimiter: str, quote: bool) -> list[str]:
    """Column names in a delimited file's first line."""
    line = first_line(path)
    if not line.strip():
        raise DataError(f"{path} is empty: no header line")
    if b"\0" in line:
        if line.startswith((b"\xff\xfe", b"\xfe\xff")) or not (
            line[::2].strip(b"\0") and line[1::2].strip(b"\0")
        ):
            # What Excel's "Unicode Text" and PowerShell's redirection write: text, two bytes a character.
            raise DataError(f"{path} line 1: UTF-16 text, not UTF-8; save the file as UTF-8")
        raise DataError(f"{path} line 1: binary data, not delimited text; check the path and data.format")
    if b"\r" in line:  # e.g. a file whose lines end in \r alone: its "first line" is the whole file
        raise DataError(f"{path} line 1: {BARE_CR}")
    if (not_utf8 := utf8_error(path, line, 1)) is not None:  # pyarrow's names would raise UnicodeDecodeError
        raise not_utf8
    if not (quote and b'"' in line):
        # No quoting: the names are the cells between delimiters, as pyarrow reads them (its byte order mark
        # dropped), without its parser's fixed cost, which a split of 1,000 parts paid 1,000 times.
        names = line.removeprefix(UTF8_BOM).decode().split(delimiter)
        _check_header(path, names)
        return names
    try:
        table = pacsv.read_csv(
            io.BytesIO(line + b"\n"),
            read_options=pacsv.ReadOptions(use_threads=False),
            parse_options=_text_options(delimiter, quote, None),
        )
    except pa.ArrowInvalid as e:
        reason = str(e).splitlines()[0][:120]
        raise DataError(
            f"{path} line 1: not a {delimiter!r}-delimited header ({reason}); check data.format"
        ) from None
    names = table.column_names
    _check_header(path, names)
    return names


def _nonempty_lines(chunk: bytes | bytearray) -> np.ndarray:
    """0-based indices of a chunk's non-empty lines: the ones pyarrow parses into rows."""
    buf = np.frombuffer(chunk, dtype=np.uint8)
    feeds = np.flatnonzero(buf == 10)
    starts = np.concatenate([[0], feeds + 1])
    ends = np.append(feeds, len(buf))  # each line's end, its line feed left out
    if starts[-1] == len(buf):  # the "line" after a final newline does not exist
        starts, ends = starts[:-1], ends[:-1]
    length = ends - starts
    cr_only = (length == 1) & (buf[np.minimum(starts, len(buf) - 1)] == 13)
    return np.flatnonzero((length > 0) & ~cr_only)


def _first_bare_cr_line(chunk: bytes | bytearray) -> int:
    """0-based line of a chunk's first carriage return that no line feed follows."""
    buf = np.frombuffer(chunk, dtype=np.uint8)
    cr = np.flatnonzero(buf == 13)
    after = np.append(buf, 0)[cr + 1]
    pos = int(cr[after != 10][0])
    return int(np.count_nonzero(buf[:pos] == 10))


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
    skip_undecodable: bool = False,
) -> Iterator[TextChunk]:
    """Stream a delimited text file as string tables of the ``include`` columns, with exact lines.

    ``names`` are all the file's columns in order. Empty lines are skipped. A line that is not UTF-8
    text is an error (``NotUtf8``), or with ``skip_undecodable`` (``on_bad_row: skip``) a row of
    ``TextChunk.rejected``. Chunks are parsed in threads, each single-threaded (see ``_parse_chunk``),
    and come back in order.
    """
    text = _convert_options(include)
    dialect = (delimiter, quote)
    return _parsed(path, names, dialect, skip_header, skip_undecodable, lambda parse: parse(text))


def iter_converted(
    path: Path,
    names: Sequence[str],
    include: Sequence[str],
    schema: Schema,
    *,
    delimiter: str,
    quote: bool,
    skip_header: bool,
    skip_undecodable: bool = False,
) -> Iterator[tuple[TextChunk, list[pa.Array], list[Problem | None]]]:
    """``iter_text_tables``, each chunk also converted to the raw layout (``base.convert``) in its
    parsing thread: the casts and checks run in parallel too.

    The label and dense columns are parsed as float64 by the CSV reader itself (the parse a cast from
    text does, without building string columns first); a chunk holding any bad row is parsed again
    as text, which finds and words its problems exactly as before."""
    text = _convert_options(include)
    numeric = (schema.label, *([schema.weight] if schema.weight is not None else []), *schema.dense_names)
    numbers = _convert_options(include, [n for n in numeric if n in include])

    def then(
        parse: Callable[[pacsv.ConvertOptions], TextChunk],
    ) -> tuple[TextChunk, list[pa.Array], list[Problem | None]]:
        try:
            chunk = parse(numbers)
            arrays, problems = convert(column_of(chunk.table), schema)
            if all(p is None for p in problems):
                return chunk, arrays, problems
        except DataError:  # e.g. a cell that is not a number
            pass
        chunk = parse(text)
        arrays, problems = convert(column_of(chunk.table), schema)
        return chunk, arrays, problems

    return _parsed(path, names, (delimiter, quote), skip_header, skip_undecodable, then)


def _convert_options(include: Sequence[str], numbers: Sequence[str] = ()) -> pacsv.ConvertOptions:
    """Read the ``include`` columns as text (empty = null), ``numbers`` among them as float64."""
    types = dict.fromkeys(include, pa.string()) | dict.fromkeys(numbers, pa.float64())
    return pacsv.ConvertOptions(
        include_columns=list(include), column_types=types, strings_can_be_null=True, null_values=[""]
    )


def _parsed(
    path: Path,
    names: Sequence[str],
    dialect: tuple[str, bool],
    skip_header: bool,
    skip_undecodable: bool,
    then: Callable[[Callable[[pacsv.ConvertOptions], TextChunk]], R],
) -> Iterator[R]:
    """``then(parse)`` for each chunk, in threads; ``parse(options)`` parses the chunk. With
    ``skip_undecodable``, lines that are not UTF-8 text are emptied and reported as rejected rows."""

    def work(item: tuple[int, bytearray]) -> R:
        first, chunk = item
        # Found by the first parse, which leaves the chunk clean for a second one (``iter_converted``).
        dropped: list[tuple[int, str]] = []

        def parse(options: pacsv.ConvertOptions) -> TextChunk:
            nonlocal chunk
            try:
                parsed = _parse_chunk(path, first, chunk, names, dialect, options)
            except NotUtf8:
                if not skip_undecodable:
                    raise
                clean, dropped[:] = drop_undecodable(chunk, first)
                chunk = bytearray(clean)
                parsed = _parse_chunk(path, first, chunk, names, dialect, options)
            if dropped:
                parsed.rejected = sorted([*parsed.rejected, *dropped])
            return parsed

        return then(parse)

    return ordered_map(work, iter_chunks(path, skip_first_line=skip_header, quote=dialect[1]))


def _parse_chunk(
    path: Path,
    first: int,
    chunk: bytes | bytearray,
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
        if (not_utf8 := utf8_error(path, chunk, first)) is not None:
            raise not_utf8 from None
        last = first + chunk.count(b"\n") - chunk.endswith(b"\n")
        raise DataError(f"{path} lines {first}-{last}: {e}") from None
    lines = cache(lambda: _nonempty_lines(chunk))
    bare_cr = chunk.count(b"\r") != chunk.count(b"\r\n")
    if ((dialect[1] and b'"' in chunk) or bare_cr) and table.num_rows + len(bad_rows) != len(lines()):
        if bare_cr:
            # The line's parts would be rows of their own, and every later line number off.
            raise DataError(f"{path} line {first + _first_bare_cr_line(chunk)}: {BARE_CR}")
        # A quoted cell spanning lines: pyarrow joins them into one row, every later line number would be
        # off, and where a chunk ends inside it, the halves are two bad rows.
        last = first + chunk.count(b"\n") - chunk.endswith(b"\n")
        raise DataError(
            f"{path} lines {first}-{last}: a quoted cell holds a line break; cells must fit on one line "
            "(replace the line breaks inside quotes; or, if '\"' does not quote cells in this file, set "
            "data.options.quote: false; data inspect: --no-quote)"
        )
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
    """Fetch a table column as one contiguous array (copied only if it has several chunks)."""

    def column(name: str) -> pa.Array:
        col = table.column(name)
        return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()

    return column
