"""libsvm / libfm lines: ``label idx:val idx:val ...``, labels 0/1 or -1/1 (-1 means 0).

Two modes (option ``mode``):

- ``fields`` (default; the NFM/AFN libfm splits, e.g. Frappe in libfm form): each line has one
  ``idx:val`` token per sparse feature of the schema, in schema order; the k-th token's ``idx``
  (a string) is the k-th feature's id, ``val`` is ignored (1 in these files). A line with another
  token count is a bad row.
- ``bag``: the schema has exactly one sparse feature, multi and weighted: a line's idx are its
  ids, its vals their weights.

An ``idx`` is read as every reader reads a text id (``base.normal_ids``): ``3.0`` is id ``3``.

The schema has no dense features in either mode. Errors and dropped rows name 1-based file lines.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recscale.data.readers.base import (
    BadRows,
    Locate,
    Problem,
    check_file,
    make_batch,
    normal_ids,
    to_dense,
    to_label,
)
from recscale.data.readers.text import (
    NotUtf8,
    drop_undecodable,
    iter_chunks,
    lines_of,
)
from recscale.data.schema import Schema
from recscale.errors import DataError
from recscale.settings import Settings

# Whitespace as pyarrow's ascii_split_whitespace sees it, and a piece of a token.
SPACE, PIECE = r"[\t\n\v\f\r ]", r"[^\t\n\v\f\r :]+"
TOKEN_RE = rf"{PIECE}:{PIECE}"
# A well-formed line: a label, then idx:val tokens; so it splits on ' ' and ':' into 1 + 2k pieces.
LINE_RE = rf"^{PIECE}({SPACE}+{TOKEN_RE})*$"


class Options(Settings):
    """``data.options`` for ``format: libsvm``."""

    mode: Literal["fields", "bag"] = "fields"


def read(path: Path, schema: Schema, options: Options, bad: BadRows) -> Iterator[pa.RecordBatch]:
    """Check the file and that the schema fits the mode now; return the stream of raw batches."""
    check_file(path, headerless=True)
    if schema.dense:
        raise DataError(f"{path}: libsvm data has no dense features; the schema lists {schema.dense_names}")
    if options.mode == "bag":
        if len(schema.sparse) != 1 or not schema.sparse[0].weighted:
            raise DataError(
                f"{path}: libsvm mode 'bag' needs exactly one sparse feature with multi: true and "
                f"weighted: true; the schema has {schema.sparse_names}"
            )
    elif any(f.multi for f in schema.sparse):
        raise DataError(f"{path}: libsvm mode 'fields' reads one id per feature; set multi: false")
    return _batches(path, schema, options, bad)


def _batches(path: Path, schema: Schema, options: Options, bad: BadRows) -> Iterator[pa.RecordBatch]:
    for arrays, problems, locate, dropped in parsed_chunks(path, schema, options, bad.on_bad_row == "skip"):
        keep = bad.keep(len(arrays[0]), problems, locate, dropped)
        yield make_batch(arrays, schema, keep)


def parsed_chunks(
    path: Path, schema: Schema, options: Options, skip_undecodable: bool
) -> Iterator[tuple[list[pa.Array], list[Problem | None], Locate, list[tuple[int, str]]]]:
    """Each chunk's rows in the raw layout, all of them, bad ones too: (arrays, their problems, row
    indices -> file lines, (line, reason) of lines that are not UTF-8 text, with ``skip_undecodable``;
    without it such a line is an error)."""
    for first, chunk in iter_chunks(path):
        dropped: list[tuple[int, str]] = []
        try:
            text = lines_of(chunk, path, first)
        except NotUtf8:
            if not skip_undecodable:
                raise
            clean, dropped = drop_undecodable(chunk, first)  # emptied: blank lines, which are no rows
            text = lines_of(clean, path, first)
        lines = pc.ascii_trim_whitespace(text)
        nonblank = pc.not_equal(lines, "").to_numpy(zero_copy_only=False)
        line_no = first + np.flatnonzero(nonblank)
        arrays, problems = _parse(lines.filter(pa.array(nonblank)), schema, options)
        yield arrays, problems, line_no.take, dropped


def _parse(lines: pa.Array, schema: Schema, options: Options) -> tuple[list[pa.Array], list[Problem | None]]:
    """Non-blank lines -> raw-layout arrays and the problems of their rows."""
    well_formed = pc.match_substring_regex(lines, LINE_RE).to_numpy(zero_copy_only=False)
    # A malformed line becomes a bare label so the split below stays aligned (it is dropped).
    # With ':' as a separator too, a line splits into label, idx1, val1, idx2, val2, ...
    text = pc.replace_substring(pc.if_else(pa.array(well_formed), lines, "0"), ":", " ")
    parts = pc.ascii_split_whitespace(text)
    flat = parts.flatten()
    offsets = parts.offsets.to_numpy()
    starts = offsets[:-1] - offsets[0]
    n_tokens = (np.diff(offsets) - 1) // 2
    label, label_problem = to_label(flat.take(pa.array(starts)), minus_one=True)
    problems = [label_problem, _problem(~well_formed, lambda i: _malformed(lines[i].as_py()))]
    if options.mode == "bag":
        is_token = np.ones(len(flat), dtype=bool)
        is_token[starts] = False
        tokens = flat.filter(pa.array(is_token))
        idx = normal_ids(tokens.take(pa.array(np.arange(0, len(tokens), 2))))
        weights, weight_problem = to_dense(tokens.take(pa.array(np.arange(1, len(tokens), 2))), "val")
        pair_offsets = pa.array(np.append((starts - np.arange(len(starts))) // 2, len(idx)).astype(np.int32))
        ids = pa.ListArray.from_arrays(pair_offsets, idx)
        arrays = [label, ids, pa.ListArray.from_arrays(pair_offsets, weights)]
        if weight_problem is not None:
            bad_val = weight_problem.bad
            owner = np.repeat(np.arange(len(n_tokens)), n_tokens)
            bad_row = np.bincount(owner[bad_val], minlength=len(n_tokens)) > 0

            def reason(i: int) -> str:
                first = pair_offsets[i].as_py()
                j = first + int(np.argmax(bad_val[first : first + n_tokens[i]]))
                val = tokens[2 * j + 1].as_py()
                return f"token '{idx[j].as_py()}:{val}': val {val!r} is not a finite number"

            problems.append(Problem(bad_row, reason))
        return arrays, problems
    n_fields = len(schema.sparse)
    arrays = [label]
    for k in range(n_fields):
        absent = n_tokens <= k
        take = pa.array(np.where(absent, 0, starts + 1 + 2 * k), mask=absent, type=pa.int64())
        arrays.append(normal_ids(flat.take(take)))
    count = _problem(n_tokens != n_fields, lambda i: f"has {n_tokens[i]} idx:val tokens, expected {n_fields}")
    return arrays, [*problems, count]


def _malformed(line: str) -> str:
    """Why a (trimmed, non-blank) line fails ``LINE_RE``: a label with ':' or a token not idx:val."""
    label, *tokens = re.split(f"{SPACE}+", line)
    if ":" in label:
        return f"label {label!r} is not -1, 0 or 1"
    bad = next(t for t in tokens if not re.fullmatch(TOKEN_RE, t))
    return f"token {bad!r} is not idx:val"


def _problem(bad: np.ndarray, reason: Callable[[int], str]) -> Problem | None:
    return Problem(bad, reason) if bad.any() else None
