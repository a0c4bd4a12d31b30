"""Pieces the readers share: bad-row policy and vectorised cell conversion (streaming text: ``text``).

Every conversion works on whole pyarrow arrays. Per-row Python runs only to word the message of
a bad row (at most a few per batch), never on the happy path.
"""

from __future__ import annotations

import glob
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NoReturn

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recscale.data.schema import LABEL, WEIGHT, WEIGHT_SUFFIX, Schema
from recscale.errors import DataError

OnBadRow = Literal["error", "skip"]
MAX_EXAMPLES = 5
SKIP_HINT = "(set data.on_bad_row: skip to drop such rows)"
# A number as pyarrow's string->float cast accepts it, plus NaN/inf spelled out (reported as such).
NUMBER_RE = r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$|^[+-]?(?i:nan|inf|infinity)$"

FLOAT32 = pa.float32()
MAX_EXACT = float(2**53)  # a float64 holds every integer up to this exactly
# A text id written as a whole number with a zero fraction (3.0, -12.00, +007.0): the integer's id, as a
# float or decimal column's 3.0 is in Parquet. The groups rebuild it: sign (none for zero), then digits.
WHOLE_TEXT_RE = r"^\+?(?:-?0*(0)|(-?)0*([1-9]\d*))\.0+$"

Locate = Callable[[np.ndarray], np.ndarray]


@dataclass
class ReadStats:
    """What one read produced: rows yielded, bad rows dropped, and the first reasons for the drops."""

    rows: int = 0
    skipped: int = 0
    examples: list[str] = field(default_factory=list)
    truncated: dict[str, int] = field(default_factory=dict)  # sequence feature -> rows cut to max_len
    # Each kept row's position in its file (``position_unit``), batch by batch; only when asked (not None).
    positions: list[np.ndarray] | None = None
    position_files: list[str] = field(default_factory=list)  # the file of each batch of ``positions``


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
        if self.stats.positions is not None:
            self.stats.positions.append(locate(np.flatnonzero(~bad)))
            self.stats.position_files.append(self.where)
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


def position_unit(fmt: str) -> str:
    """What a row's position in a file of format ``fmt`` counts: data ``row`` s of Parquet, else the
    text's ``line`` s (header = line 1)."""
    return "row" if fmt == "parquet" else "line"


def consecutive(first: int) -> Locate:
    """Locate for batches whose rows are consecutive positions starting at ``first``."""
    return lambda idx: first + idx


class NoRows(DataError):
    """A file with no data rows at all (empty, or a header alone): none was bad."""


def check_file(path: Path, headerless: bool = False) -> None:
    """DataError unless ``path`` is a non-empty regular file. An empty file of a ``headerless`` format
    (Criteo, libsvm) is a file of no rows (``NoRows``); other formats need at least their header."""
    if not path.exists():
        if path.is_symlink():
            _part(path)  # a broken link, named as one
        raise DataError(f"{path}: no such file")
    if path.is_dir():
        raise DataError(f"{path} is a directory; this format reads one file")
    check_regular(path)
    if path.stat().st_size == 0:
        raise (NoRows if headerless else DataError)(f"{path} is empty (0 bytes)")


def names_data(path: str | Path) -> bool:
    """Whether ``path`` names something to read: a file or directory, or a glob pattern matching a file."""
    return Path(path).exists() or (glob.has_magic(str(path)) and bool(glob.glob(str(path), recursive=True)))


def data_files(path: str | Path, fmt: str) -> list[Path]:
    """The files a data path names, sorted by name: one file; a glob pattern's matches (``day_*.tsv``, where no
    file has that very name); or a directory's files (not MovieLens', a directory of one dataset). A split
    written in parts, as Spark or Hadoop writes them: their marker files (``_SUCCESS``, ``.part-0.crc``) are
    left out, as are hidden files and a pattern's directories. A directory holding directories is refused
    (Hive-style ``date=.../`` partitions: their files would be left out unread), as is a part that is a broken
    link or no regular file (a part left out would be rows lost without a word). A path that is none of these
    is returned as it is, for the reader to name what is wrong with it."""
    path = Path(path)
    if path.is_dir() and fmt != "movielens":
        entries = sorted(f for f in path.iterdir() if not _marker(f.name))
        folders = [f.name for f in entries if f.is_dir()]
        if folders:
            listed = ", ".join(folders[:3]) + (", ..." if len(folders) > 3 else "")
            raise DataError(
                f"{path} holds folders ({listed}): a folder's own files are read, not its folders' (Hive-style "
                f"partitions are not, nor their names as columns); give a pattern matching their files, e.g. "
                f"'{path / '**' / '*'}'"
            )
        if not entries:
            raise DataError(
                f"{path} is a directory with no data files in it; give a file, or a folder of them"
            )
        return [_part(f) for f in entries]
    if not path.exists() and glob.has_magic(str(path)):
        # Markers, and files in a marker's folder (Spark's _temporary/), are left out where the pattern's
        # wildcards match them (``parts/*`` matches _SUCCESS), not where it names them (``parts/_*``).
        fixed = next(i for i, part in enumerate(path.parts + ("*",)) if glob.has_magic(part))
        named = any(_marker(part) for part in path.parts[fixed:])
        matches = sorted(
            m
            for m in map(Path, glob.glob(str(path), recursive=True))
            if not m.is_dir() and (named or not any(_marker(part) for part in m.parts[fixed:]))
        )
        if not matches:
            raise DataError(f"{path}: no file matches this pattern; fix the pattern or give a file")
        return [_part(m) for m in matches]
    return [path]


def _marker(name: str) -> bool:
    """A file that is no data of a split written in parts: hidden (``.part-0.crc``) or a job's marker
    (``_SUCCESS``, ``_committed_123``, a ``_temporary`` folder)."""
    return name.startswith((".", "_"))


def _part(path: Path) -> Path:
    """``path``, one part of a split: a DataError if it is a broken link or no regular file."""
    if not path.exists():
        raise DataError(
            f"{path} is a symbolic link to {os.readlink(path)}, which does not exist; fix the link or remove it"
        )
    check_regular(path)
    return path


def check_regular(path: Path) -> None:
    """DataError if ``path`` (which exists) is neither a regular file nor a directory: a pipe (``<(zcat F)``,
    whose name resolves to none: it read as "does not exist") or a device (its size is 0 whatever it holds:
    it read as "is empty")."""
    if not path.is_file() and not path.is_dir():
        raise DataError(
            f"{path} is not a regular file (a pipe, e.g. <(zcat F), or a device); write the data to a file "
            "and give that (a .gz, .bz2, .zst or .lz4 file is read as it is)"
        )


@contextmanager
def damage_named(path: str | Path) -> Iterator[None]:
    """An error pyarrow raises reading ``path`` in the block (a compressed stream or Parquet page cut short or
    damaged: an OSError without errno, which names no file) as a DataError naming it."""
    try:
        yield
    except OSError as e:
        if e.errno is not None:  # the operating system's, which names its file
            raise
        raise DataError(f"{path}: {' '.join(str(e).split())} (a file cut short or damaged?)") from None


def check_unique_columns(where: str, names: Sequence[str]) -> None:
    """A file naming a column twice is an error: a read by name would take one of them, or fail inside
    pyarrow. ``where`` says what names them (``FILE line 1: the header``, ``FILE: the parquet schema``)."""
    twice = [n for n, count in Counter(names).items() if count > 1]
    if twice:
        listed = ", ".join(repr(n) for n in twice)
        raise DataError(
            f"{where} names column(s) {listed} more than once; "
            "rename or remove the duplicates so that each column name is unique"
        )


def missing_columns_error(path: Path, missing: Sequence[str], columns: Sequence[str]) -> DataError:
    """The error for schema columns absent from a file: names them and lists what the file has, and the
    file's columns they may have meant: the same name but for spaces around it or letter case (a header
    written ``click, hour``, whose columns are ``' hour'`` and so on, listed as names look alike)."""
    near = {m: c for m in missing for c in columns if c != m and c.strip().casefold() == m.strip().casefold()}
    hint = (
        f"; the file has {', '.join(f'{c!r} (not {m!r})' for m, c in near.items())}: rename "
        f"{'it' if len(near) == 1 else 'them'} in the file's header or in the schema"
        if near
        else ""
    )
    return DataError(
        f"{path}: column(s) {', '.join(repr(m) for m in missing)} named in the schema are not in the file; "
        f"its columns are: {', '.join(columns)}{hint}"
    )


def raw_arrow_schema(schema: Schema) -> pa.Schema:
    """The pyarrow schema of reader output for ``schema`` (see ``recscale.data.schema``)."""
    fields = [pa.field(LABEL, pa.float32(), nullable=False)]
    if schema.weight is not None:
        fields.append(pa.field(WEIGHT, pa.float32(), nullable=False))
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
    """Cells (strings, bytes or numbers) -> float64, nulls kept; plus a mask of cells that are no number
    (None: none): text that is not a number, bytes that are not UTF-8 text."""
    if _is_bytes(cells.type):
        text, undecodable = _as_text(cells)
        values, not_number = parse_floats(text)
        if undecodable is None:
            return values, not_number
        return values, undecodable if not_number is None else undecodable | not_number
    if not (pa.types.is_string(cells.type) or pa.types.is_large_string(cells.type)):
        # Numbers: an integer beyond 2**53 is rounded to the nearest float (float32 rounds it further).
        return pc.cast(cells, pa.float64(), safe=False), None
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
    """Label cells -> float32 0/1. With ``minus_one``, -1 means 0 (libsvm). Text ``true``/``false`` (any
    case: pandas' and Spark's CSV of a boolean column) is 1/0, as a Parquet boolean is. Null or other = bad."""
    values, _ = parse_floats(cells)
    v = values.to_numpy(zero_copy_only=False)  # null -> NaN, which fails every test below
    ok = (v == 0) | (v == 1)
    if minus_one:
        ok |= v == -1
    if not ok.all() and (pa.types.is_string(cells.type) or pa.types.is_large_string(cells.type)):
        word = pc.utf8_lower(pc.utf8_trim_whitespace(cells))
        true, false = (
            pc.fill_null(pc.equal(word, w), False).to_numpy(zero_copy_only=False) for w in ("true", "false")
        )
        v = np.where(true, 1.0, np.where(false, 0.0, v))
        ok |= true | false
    label = pa.array((v == 1).astype(np.float32))
    if ok.all():
        return label, None
    allowed = "-1, 0 or 1" if minus_one else "0 or 1"

    def reason(i: int) -> str:
        raw = cells[i].as_py()
        return "label is missing" if raw is None else f"label {raw!r} is not {allowed}"

    return label, Problem(~ok, reason)


def to_dense(
    cells: pa.Array, name: str, dtype: pa.DataType = FLOAT32, what: str | None = None
) -> tuple[pa.Array, Problem | None]:
    """Dense cells -> ``dtype``, null = missing. Non-numeric, NaN or infinite (in ``dtype``) = bad; ``what``
    names the cells in a bad row's reason (default: dense feature ``name``)."""
    parsed, not_number = parse_floats(cells)
    values = pc.cast(parsed, dtype)
    finite = pc.fill_null(pc.is_finite(values), True).to_numpy(zero_copy_only=False)
    bad = ~finite if not_number is None else ~finite | not_number
    if not bad.any():
        return values, None

    def reason(i: int) -> str:
        if not_number is not None and not_number[i]:
            why = "not a number"
        elif pc.is_finite(parsed[i]).as_py():  # finite as read, infinite in dtype (float32 beyond ±3.4e38)
            info = np.finfo(dtype.to_pandas_dtype())
            why = f"beyond {info.dtype}'s range (±{float(info.max):.3g})"
        else:
            why = "NaN or infinite"
        return f"{subject} {cells[i].as_py()!r} is {why}"

    subject = f"dense feature '{name}' value" if what is None else what
    return values, Problem(bad, reason)


def to_weight(cells: pa.Array) -> tuple[pa.Array, Problem | None]:
    """Row-weight cells -> float32. A missing cell, a value that is not a number, NaN, infinite (in float32) or
    negative = bad: a weight that is no finite amount >= 0 would turn the loss and every metric NaN or
    negative, and a missing one has no default that is surely right."""
    values, problem = to_dense(cells, "", what="weight")
    missing = pc.is_null(values).to_numpy(zero_copy_only=False)  # also text that is no number (``problem``)
    negative = pc.fill_null(pc.less(values, 0.0), False).to_numpy(zero_copy_only=False)
    if problem is None and not (missing.any() or negative.any()):
        return values, None
    wrong = problem.reason if problem is not None else None
    bad = missing | negative | (problem.bad if problem is not None else False)

    def reason(i: int) -> str:
        if wrong is not None and problem is not None and problem.bad[i]:
            return wrong(i)
        return "weight is missing" if missing[i] else f"weight {cells[i].as_py()!r} is negative"

    return pc.fill_null(values, 0.0), Problem(bad, reason)


def is_list(dtype: pa.DataType) -> bool:
    """A list column of any layout: list, large_list or fixed_size_list."""
    return pa.types.is_list(dtype) or pa.types.is_large_list(dtype) or pa.types.is_fixed_size_list(dtype)


def _is_bytes(dtype: pa.DataType) -> bool:
    return (
        pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype) or pa.types.is_fixed_size_binary(dtype)
    )


def normal_ids(ids: pa.Array) -> pa.Array:
    """Text ids as every reader reads them, whatever the file format: an empty string is a missing id (null,
    as an empty CSV cell is), and a whole number written with a zero fraction (``3.0``, ``-4.00``) is the
    integer's id (``3``, ``-4``), as a Parquet float or decimal column's 3.0 is. Other text, ``007`` or
    ``1.5`` say, is the id as written. Both checks are one pass of a plain comparison unless they find one."""
    if len(ids) and pc.min(pc.binary_length(ids)).as_py() == 0:
        ids = pc.if_else(pc.equal(ids, ""), pa.scalar(None, ids.type), ids)
    if pc.any(pc.match_substring(ids, ".")).as_py():
        whole = pc.fill_null(pc.match_substring_regex(ids, WHOLE_TEXT_RE), False)
        ids = pc.if_else(whole, pc.replace_substring_regex(ids, WHOLE_TEXT_RE, r"\1\2\3"), ids)
    return ids


def _as_text(values: pa.Array) -> tuple[pa.Array, np.ndarray | None]:
    """Values (ints, strings, bytes, floats, decimals) -> text ids (``normal_ids``); plus a mask of values
    that are no id (None: none), which become null: bytes that are not UTF-8 text, floats that are not
    whole numbers (``_whole``). A decimal is its exact text: 12.0 is id "12", 12.5 is "12.5"."""
    if pa.types.is_floating(values.type):
        return _whole(values)
    try:
        return normal_ids(pc.cast(values, pa.string())), None
    except pa.ArrowInvalid:
        if not _is_bytes(values.type):
            raise
    # Slow path, only for a batch holding such a value: find which ones do not decode.
    bad = np.array([v is not None and not _decodes(v) for v in values.to_pylist()], dtype=bool)
    kept = pc.if_else(pa.array(~bad), values, pa.scalar(None, values.type))
    return normal_ids(pc.cast(kept, pa.string())), bad


def _whole(values: pa.Array) -> tuple[pa.Array, np.ndarray | None]:
    """Float ids -> the decimal text of the integers they hold (3.0 is id "3", as the integer 3 is, where
    a float's own text would be "1e+16" for 10**16, "-0" for -0.0); plus a mask of values that are not whole
    numbers a float holds exactly (2.5, NaN, infinity, beyond 2**53), which become null."""
    x = pc.cast(values, pa.float64())
    ok = pc.and_(pc.and_(pc.is_finite(x), pc.equal(pc.floor(x), x)), pc.less_equal(pc.abs(x), MAX_EXACT))
    text = pc.cast(pc.cast(pc.if_else(ok, x, pa.scalar(None, pa.float64())), pa.int64()), pa.string())
    bad = ~pc.fill_null(ok, True).to_numpy(zero_copy_only=False)
    return text, bad if bad.any() else None


def _decodes(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _no_id(name: str, raw: object, column: pa.DataType) -> str:
    """Why the value ``raw`` of a ``column`` column is no id of sparse feature ``name``."""
    if isinstance(raw, bytes):
        return f"sparse feature '{name}' id {raw!r} is not UTF-8 text"
    assert isinstance(raw, float)  # _as_text finds no other bad value
    what = (
        "is beyond 2**53, where a float no longer holds every integer"
        if raw.is_integer()
        else "is not a whole number"
    )
    return (
        f"sparse feature '{name}' id {raw!r} {what} (its column is {column}; ids are integers or strings, "
        "a float column's read as the integers it holds)"
    )


def to_ids(cells: pa.Array, name: str = "") -> tuple[pa.Array, Problem | None]:
    """Single-id cells -> strings (ints become their decimal text, whole floats and text such as ``3.0``
    the text of the integer, ``normal_ids``), null or ``""`` = missing; bytes that are not UTF-8 text and
    floats that are not whole numbers are bad rows (``name`` is the feature, for messages)."""
    if cells.type == pa.string():
        return normal_ids(cells), None
    ids, bad = _as_text(cells)
    if bad is None or not bad.any():
        return ids, None
    return ids, Problem(bad, lambda i: _no_id(name, cells[i].as_py(), cells.type))


def _rows_with(bad_items: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """(rows,) mask of rows owning at least one bad item, items laid out row by row."""
    owner = np.repeat(np.arange(len(lengths)), lengths)
    return np.bincount(owner[bad_items], minlength=len(lengths)) > 0


def _keep_items(
    lengths: np.ndarray, keep: np.ndarray, *values: pa.Array
) -> tuple[np.ndarray, list[pa.Array]]:
    """Per-row lengths and ``values`` (items laid out row by row) once the items not in ``keep`` are dropped."""
    owner = np.repeat(np.arange(len(lengths)), lengths)
    mask = pa.array(keep)
    return np.bincount(owner[keep], minlength=len(lengths)), [v.filter(mask) for v in values]


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
        lengths, (flat,) = _keep_items(lengths, nonempty, flat)
    if not weighted:
        return _lists(lengths, normal_ids(flat)), None, None
    pairs = pc.extract_regex(flat, r"^(?P<id>.*?)(?::(?P<w>[^:]*))?$")
    w_text = pairs.field("w")
    weights, bad_w = to_dense(pc.if_else(pc.equal(w_text, ""), "1", w_text), name)
    ids, weights = _lists(lengths, normal_ids(pairs.field("id"))), _lists(lengths, weights)
    if bad_w is None:
        return ids, weights, None

    def reason(i: int) -> str:
        start = int(lengths[:i].sum())
        j = start + int(np.argmax(bad_w.bad[start : start + lengths[i]]))
        return f"sparse feature '{name}' weight {w_text[j].as_py()!r} is not a finite number"

    return ids, weights, Problem(_rows_with(bad_w.bad, lengths), reason)


def list_ids(cells: pa.Array, name: str = "") -> tuple[pa.Array, Problem | None]:
    """List cells (ints, strings, bytes or floats) -> list<string>, null list = []; a list holding bytes
    that are not UTF-8 text or floats that are not whole numbers is a bad row (as ``to_ids``; ``name`` is
    the feature, for messages)."""
    value_type = cells.type.value_type
    if not pa.types.is_floating(value_type):
        try:
            ids = pc.fill_null(pc.cast(cells, pa.list_(pa.string())), pa.scalar([], pa.list_(pa.string())))
            lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False)
            return _lists(lengths, normal_ids(pc.list_flatten(ids))), None
        except pa.ArrowInvalid:
            if not _is_bytes(value_type):
                raise
    flat = pc.list_flatten(cells)
    lengths = pc.fill_null(pc.list_value_length(cells), 0).to_numpy(zero_copy_only=False)
    text, bad_items = _as_text(flat)
    if bad_items is None:
        return _lists(lengths, text), None
    starts = np.concatenate([[0], np.cumsum(lengths)])

    def reason(i: int) -> str:
        j = int(starts[i]) + int(np.argmax(bad_items[starts[i] : starts[i + 1]]))
        return _no_id(name, flat[j].as_py(), cells.type)

    return _lists(lengths, text), Problem(_rows_with(bad_items, lengths), reason)


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


def check_sequence(cells: pa.Array, name: str, sep: str) -> Problem | None:
    """Rows whose ordered id list has an empty element (text ``3||7``, ``3|7|``; a list column's ``""``)
    or a null one (list column): in a sequence a missing position is malformed, not droppable. An empty cell or list is an
    empty history, which is valid."""
    if is_list(cells.type):
        lengths = pc.fill_null(pc.list_value_length(cells), 0).to_numpy(zero_copy_only=False)
        items = pc.list_flatten(cells)
        if pa.types.is_dictionary(items.type):
            items = items.dictionary_decode()
        if pa.types.is_string(items.type) or pa.types.is_large_string(items.type) or _is_bytes(items.type):
            # "" is no id either, as text or as bytes (``normal_ids`` makes both a missing id)
            items = pc.if_else(pc.equal(pc.binary_length(items), 0), None, items)
        bad_items = pc.is_null(items).to_numpy(zero_copy_only=False)
    else:
        text = pc.fill_null(cells, "")
        parts = pc.split_pattern(text, sep)
        lengths = np.diff(parts.offsets.to_numpy())
        bad_items = pc.equal(parts.flatten(), "").to_numpy(zero_copy_only=False)
        bad_items &= np.repeat(pc.not_equal(text, "").to_numpy(zero_copy_only=False), lengths)
    bad = _rows_with(bad_items, lengths)
    if not bad.any():
        return None
    how = (
        "a null or empty element" if is_list(cells.type) else f"an empty element (write ids as 3{sep}7{sep}9)"
    )
    return Problem(bad, lambda i: f"sequence feature '{name}' has {how}; an empty cell is an empty history")


def as_trained(batch: pa.RecordBatch, schema: Schema, stats: ReadStats) -> pa.RecordBatch:
    """A raw-layout batch of good rows as training takes it, whoever read it (a reader, the server):
    empty ids dropped, sequences cut to ``max_len`` (cut rows counted in ``stats``)."""
    return truncate_sequences(drop_empty_ids(batch, schema), schema, stats)


def drop_empty_ids(batch: pa.RecordBatch, schema: Schema) -> pa.RecordBatch:
    """Each plain multi-id feature's lists without their empty ids and those ids' weights (``nonempty_ids``).
    A sequence's empty id is a bad row instead (``check_sequence``): a position of a history cannot be dropped."""
    for f in schema.sparse:
        if not f.multi or f.sequence:
            continue
        names = [f.name, f.name + WEIGHT_SUFFIX] if f.weighted else [f.name]
        for name, values in zip(names, nonempty_ids(*(batch.column(n) for n in names)), strict=True):
            i = batch.schema.get_field_index(name)
            batch = batch.set_column(i, batch.schema.field(i), values)
    return batch


def nonempty_ids(ids: pa.Array, *aligned: pa.Array) -> list[pa.Array]:
    """``ids`` (list<string>) without their empty ids, ``""`` or null (a CSV cell ``x|`` is ``['x']``, and so
    is a list ``['x', '']``), and each ``aligned`` list column (weights) without the same items."""
    flat = pc.list_flatten(ids)
    keep = pc.fill_null(pc.not_equal(flat, ""), False).to_numpy(zero_copy_only=False)
    if keep.all():
        return [ids, *aligned]
    lengths = pc.fill_null(pc.list_value_length(ids), 0).to_numpy(zero_copy_only=False)
    lengths, kept = _keep_items(lengths, keep, flat, *(pc.list_flatten(a) for a in aligned))
    return [_lists(lengths, values) for values in kept]


def truncate_sequences(batch: pa.RecordBatch, schema: Schema, stats: ReadStats) -> pa.RecordBatch:
    """Cut each sequence feature's lists to their last (most recent) ``max_len`` ids; count cut rows."""
    for f in schema.sparse:
        if f.max_len is None:
            continue
        col = batch.column(f.name)
        lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False)
        over = lengths > f.max_len
        if not over.any():
            continue
        stats.truncated[f.name] = stats.truncated.get(f.name, 0) + int(over.sum())
        flat = pc.list_flatten(col)
        # Position of each id counted from its row's end: keep those within max_len of it.
        from_end = np.repeat(np.cumsum(lengths), lengths) - np.arange(len(flat))
        kept = _lists(np.minimum(lengths, f.max_len), flat.filter(pa.array(from_end <= f.max_len)))
        batch = batch.set_column(batch.schema.get_field_index(f.name), batch.schema.field(f.name), kept)
    return batch


# Schema.label of a read without labels (``unlabelled``); a config's label names a column (never empty).
NO_LABEL = ""


def unlabelled(schema: Schema) -> Schema:
    """``schema`` for files without its label column (``recscale predict`` of new rows): the readers look
    for no label and give every row label 0, and read no row weight (scores do not depend on it). CSV,
    Parquet and Criteo (its test files' layout) only: libsvm places the label in every line and MovieLens
    derives it."""
    return unweighted(schema).model_copy(update={"label": NO_LABEL})


def unweighted(schema: Schema) -> Schema:
    """``schema`` without its row-weight column: every row weighs 1 (a file to score that has none)."""
    return schema.model_copy(update={"weight": None})


def convert(column: Callable[[str], pa.Array], schema: Schema) -> tuple[list[pa.Array], list[Problem | None]]:
    """Source columns (fetched by name) -> raw-layout arrays in ``schema.column_names()`` order (the row weight,
    if the schema names one, read from its ``weight`` column: ``to_weight``).

    Multi-id features come as list columns (weights in ``{name}__w``) or as text cells split by
    the feature's ``sep``. An ``unlabelled`` schema reads label 0 for every row.
    """
    if schema.label == NO_LABEL:
        rows = len(column((schema.dense_names + schema.sparse_names)[0]))
        label, problem = pa.array(np.zeros(rows, dtype=np.float32)), None
    else:
        label, problem = to_label(column(schema.label))
    arrays, problems = [label], [problem]
    if schema.weight is not None:
        weight, problem = to_weight(column(schema.weight))
        arrays.append(weight)
        problems.append(problem)
    for d in schema.dense:
        values, problem = to_dense(column(d.name), d.name)
        arrays.append(values)
        problems.append(problem)
    for f in schema.sparse:
        cells = column(f.name)
        if not f.multi:
            ids, problem = to_ids(cells, f.name)
            arrays.append(ids)
            problems.append(problem)
        elif is_list(cells.type):
            ids, problem = list_ids(cells, f.name)
            arrays.append(ids)
            problems.append(problem)
            if f.weighted:
                weights, problem = list_weights(column(f.name + WEIGHT_SUFFIX), ids, f.name)
                arrays.append(weights)
                problems.append(problem)
        else:
            ids, weights, problem = split_ids(cells, f.sep, f.weighted, f.name)
            arrays += [ids] if weights is None else [ids, weights]
            problems.append(problem)
        if f.sequence:
            problems.append(check_sequence(cells, f.name, f.sep))
    return arrays, problems


def make_batch(arrays: list[pa.Array], schema: Schema, keep: np.ndarray | None) -> pa.RecordBatch:
    """The raw-layout batch of ``arrays``, bad rows (``keep`` False) dropped."""
    batch = pa.RecordBatch.from_arrays(arrays, schema=raw_arrow_schema(schema))
    return batch if keep is None else batch.filter(pa.array(keep))
