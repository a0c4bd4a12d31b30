"""MovieLens-100k as CTR data, from RecBole atomic files, with recscale's reproducible time split.

Files (``path`` is their directory or the ``.inter`` file): ``ml-100k.inter`` (``user_id``,
``item_id``, ``rating:float``, ``timestamp:float``) and, when present beside it, ``ml-100k.user`` (``age``,
``gender``, ``occupation``, ``zip_code``) and ``ml-100k.item`` (``movie_title``, ``release_year``,
``class``). They are tab-separated with a typed header (``user_id:token``): ``token`` is one id,
``token_seq`` a space-separated list of ids (e.g. ``class`` = the genres), ``float`` a number.

Output: the label is ``rating >= rating_threshold`` (default 4); user and item columns are
joined onto each rating (a rating whose user or item row is absent gets missing values); column
names are the header names without the ``:type``. A schema feature must be a ``token`` column
(sparse, multi: false), a ``token_seq`` column (sparse, multi: true) or a ``float`` column
(dense). The schema label is ``label`` (or ``rating``): both mean the thresholded rating.

Histories: two derived sequence features, declared in the schema as ``{name: history, multi: true,
max_len: N}`` (and/or ``liked_history``): the items the rating's user rated (``liked_history``: rated at
least ``rating_threshold``) *strictly before* the rating's timestamp, oldest first, the last ``max_len``
kept (rows cut are counted). They are computed over all ratings before the split is taken, so a valid
or test rating sees the user's earlier train ratings, and no rating sees one at or after its own time.

Split (the project's documented, reproducible split): all ratings (bad rows dropped first) are
sorted by (timestamp as a number, user_id, item_id; ids compared as strings). With n ratings and
``fractions`` (f_train, f_valid, f_test), default (0.8, 0.1, 0.1): ``train`` is the first
round(f_train * n), ``valid`` the next ones up to round((f_train + f_valid) * n), ``test`` the rest,
``all`` everything in that order. On ml-100k this gives 80,000 / 10,000 / 10,000 ratings; every
valid and test rating is no older than every train rating.

The files are small, so they are read whole (a global sort needs all ratings anyway); errors
and dropped rows name 1-based lines of the file they are in.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import model_validator

from recscale.data.readers.base import (
    FLOAT32,
    BadRows,
    Problem,
    check_file,
    missing_columns_error,
    normal_ids,
    raw_arrow_schema,
    split_ids,
    to_dense,
)
from recscale.data.readers.text import (
    column_of,
    iter_text_tables,
    read_header,
)
from recscale.data.schema import Schema
from recscale.errors import DataError
from recscale.settings import Settings

KEYS = {"user": "user_id", "item": "item_id"}
# Derived sequence features: name -> whether only ratings >= rating_threshold count.
HISTORIES = {"history": False, "liked_history": True}
# Columns the label and the split need.
RATING, TIMESTAMP = "rating", "timestamp"
EMPTY_IDS = pa.scalar([], pa.list_(pa.string()))


class Options(Settings):
    """``data.options`` for ``format: movielens``."""

    rating_threshold: float = 4.0
    split: Literal["train", "valid", "test", "all"] = "train"
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)

    @model_validator(mode="after")
    def _fractions_sum_to_one(self) -> Options:
        if min(self.fractions) < 0 or abs(sum(self.fractions) - 1) > 1e-6:
            raise ValueError(f"fractions must be >= 0 and sum to 1, got {list(self.fractions)}")
        return self


@dataclass
class AtomicFile:
    """One RecBole atomic file: its path, column names (no ``:type``) and their types."""

    path: Path
    types: dict[str, str]

    @classmethod
    def open(cls, path: Path) -> AtomicFile:
        check_file(path)
        types: dict[str, str] = {}
        for raw in read_header(path, "\t", quote=False):
            name, colon, kind = raw.rpartition(":")
            if not colon or kind not in ("token", "token_seq", "float"):
                raise DataError(
                    f"{path} line 1: column '{raw}' is not name:type with type token, token_seq or float"
                )
            if name in types:
                raise DataError(
                    f"{path} line 1: the header names column '{name}' more than once (with types "
                    f"{types[name]} and {kind}); rename or remove the duplicate so that each column "
                    "name is unique"
                )
            types[name] = kind
        return cls(path, types)


def files_of(path: Path) -> dict[str, AtomicFile]:
    """The dataset's atomic files, keyed inter/user/item (user and item only when present)."""
    if path.is_dir():
        found = sorted(path.glob("*.inter"))
        if len(found) != 1:
            raise DataError(
                f"{path}: expected one .inter file in this directory, found {[f.name for f in found]}; give a "
                "folder of MovieLens atomic files (RecBole's ml-100k.inter, .user, .item) or the .inter file"
            )
        path = found[0]
    elif not path.exists():
        raise DataError(f"{path}: no such file or directory")
    elif path.suffix != ".inter":
        raise DataError(f"{path}: give the MovieLens directory or its .inter file")
    files = {"inter": AtomicFile.open(path)}
    for part in KEYS:
        if path.with_suffix(f".{part}").exists():
            files[part] = AtomicFile.open(path.with_suffix(f".{part}"))
    return files


def read(path: Path, schema: Schema, options: Options, bad: BadRows) -> Iterator[pa.RecordBatch]:
    """Check the files and the schema now; return the chosen split as raw-layout batches."""
    files = files_of(path)
    inter = files["inter"]
    missing = [c for c in (*KEYS.values(), RATING, TIMESTAMP) if c not in inter.types]
    if missing:
        raise missing_columns_error(inter.path, missing, list(inter.types))
    # A token timestamp would sort as text ("10" < "9"): the split and the histories would leak the future.
    for name in (RATING, TIMESTAMP):
        if inter.types[name] != "float":
            raise DataError(
                f"{inter.path} line 1: column '{name}' is {inter.types[name]}, but it must be a float "
                f"column ({name}:float in the header): ratings and timestamps are compared as numbers"
            )
    if schema.label not in ("label", RATING):
        raise DataError(
            f"{inter.path}: the label is rating >= rating_threshold; set the schema label to 'label', "
            f"not '{schema.label}'"
        )
    owner = _owners(files, schema)
    return _batches(files, schema, options, bad, owner)


def _owners(files: dict[str, AtomicFile], schema: Schema) -> dict[str, str]:
    """For each schema feature, the file (inter/user/item) it comes from; checks its type fits."""
    owner: dict[str, str] = {}
    for part, file in files.items():
        for name in file.types:
            owner.setdefault(name, part)
    for f in schema.sparse:
        if f.name in HISTORIES and f.name not in owner:
            if f.max_len is None:
                raise DataError(
                    f"{files['inter'].path}: '{f.name}' is a derived user history; declare it as a sequence: "
                    f"{{name: {f.name}, multi: true, max_len: 50}}"
                )
            owner[f.name] = "history"
    missing = [n for n in [*schema.dense_names, *schema.sparse_names] if n not in owner]
    if missing:
        raise missing_columns_error(files["inter"].path, missing, list(owner))
    wanted = {d.name: "float" for d in schema.dense}
    wanted |= {
        f.name: "token_seq" if f.multi else "token" for f in schema.sparse if owner[f.name] != "history"
    }
    for f in schema.sparse:
        if f.weighted:
            raise DataError(
                f"{files['inter'].path}: MovieLens has no weights; set weighted: false for '{f.name}'"
            )
    for name, kind in wanted.items():
        have = files[owner[name]].types[name]
        if have != kind:
            raise DataError(
                f"{files[owner[name]].path}: column '{name}' is {have}, but the schema needs a {kind} "
                "column there (dense = float, sparse = token, sparse multi = token_seq)"
            )
    return {name: owner[name] for name in [*schema.dense_names, *schema.sparse_names]}


def _load(file: AtomicFile, include: list[str], required: tuple[str, ...], bad: BadRows) -> pa.Table:
    """The ``include`` columns of one atomic file, bad rows dropped: floats parsed, token_seq split."""
    tables = []
    names = list(file.types)
    skip = bad.on_bad_row == "skip"
    chunks = iter_text_tables(
        file.path, names, include, delimiter="\t", quote=False, skip_header=True, skip_undecodable=skip
    )
    for chunk in chunks:
        cells = column_of(chunk.table)
        arrays, problems = [], []
        for name in include:
            kind = file.types[name]
            if kind == "float":
                # Features are float32, which 1e300 overflows; ratings and timestamps are compared in float64.
                dtype = pa.float64() if name in (RATING, TIMESTAMP) else FLOAT32
                values, problem = to_dense(cells(name), name, dtype)
                problems.append(problem)
            elif kind == "token_seq":
                values = split_ids(cells(name), " ")[0]
            else:  # a token is read as every reader reads a text id: 3.0 is 3, as in a CSV export of the rows
                values = normal_ids(cells(name))
            if name in required:
                problems.append(_missing(values, name))
            arrays.append(values)
        keep = bad.keep(chunk.table.num_rows, problems, chunk.locate, chunk.rejected)
        table = pa.table(arrays, names=include)
        tables.append(table if keep is None else table.filter(pa.array(keep)))
    if not tables:
        raise DataError(f"{file.path} has no data rows")
    return pa.concat_tables(tables).combine_chunks()


def _check_unique_keys(path: Path, keys: pa.ChunkedArray) -> None:
    """A user or item listed twice (two ages, say) would be joined by its first row without a word."""
    counts = pc.value_counts(keys)
    twice = pc.filter(counts.field("values"), pc.greater(counts.field("counts"), 1))
    if len(twice):
        listed = ", ".join(repr(k) for k in twice.to_pylist()[:5])
        raise DataError(f"{path}: {len(twice)} key(s) on more than one row ({listed}); keep one row per key")


def _history(ratings: pa.Table, threshold: float, liked: bool, max_len: int) -> tuple[pa.Array, np.ndarray]:
    """Each rating's user history (item ids rated strictly earlier; ``liked``: rated >= threshold),
    oldest first, the last ``max_len`` kept; and a (n,) bool mask of the ratings whose history was cut."""
    users = pc.dictionary_encode(ratings.column("user_id")).combine_chunks().indices.to_numpy()
    times = ratings.column(TIMESTAMP).to_numpy()
    by_user = np.lexsort((np.arange(len(users)), times, users))  # stable: per user, by time
    u, t = users[by_user], times[by_user]
    idx = np.arange(len(u))
    new_user = np.r_[True, u[1:] != u[:-1]]
    new_time = new_user | np.r_[True, t[1:] != t[:-1]]
    first = np.maximum.accumulate(np.where(new_user, idx, 0))  # the user's first rating
    before = np.maximum.accumulate(
        np.where(new_time, idx, 0)
    )  # the first rating at this time: end of history
    counted = idx
    if liked:
        counted = idx[ratings.column(RATING).to_numpy()[by_user] >= threshold]
    lo, hi = np.searchsorted(counted, first), np.searchsorted(counted, before)
    start = np.maximum(lo, hi - max_len)
    lengths = hi - start
    items = ratings.column("item_id").combine_chunks().take(pa.array(by_user))
    pos = counted[np.repeat(start - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))]
    offsets = np.zeros(len(u) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    lists = pa.ListArray.from_arrays(pa.array(offsets), items.take(pa.array(pos)))
    back = np.argsort(by_user)  # user order -> the ratings' (time) order
    return lists.take(pa.array(back)), (hi - lo > max_len)[back]


def _missing(values: pa.Array, name: str) -> Problem | None:
    null = values.is_null().to_numpy(zero_copy_only=False)
    return Problem(null, lambda i: f"{name} is missing") if null.any() else None


def _batches(
    files: dict[str, AtomicFile], schema: Schema, options: Options, bad: BadRows, owner: dict[str, str]
) -> Iterator[pa.RecordBatch]:
    needs = (*KEYS.values(), RATING, TIMESTAMP)
    include = [*needs, *(n for n, part in owner.items() if part == "inter" and n not in needs)]
    inter_bad = BadRows(files["inter"].path, "line", bad.on_bad_row, bad.stats)
    ratings = _load(files["inter"], include, needs, inter_bad)
    order = [(TIMESTAMP, "ascending"), ("user_id", "ascending"), ("item_id", "ascending")]
    ratings = ratings.take(pc.sort_indices(ratings, order))
    histories = {
        f.name: _history(ratings, options.rating_threshold, HISTORIES[f.name], int(f.max_len or 0))
        for f in schema.sparse
        if owner[f.name] == "history"
    }
    n = ratings.num_rows
    f_train, f_valid, _ = options.fractions
    cuts = [0, round(f_train * n), round((f_train + f_valid) * n), n]
    start, stop = {"train": (0, 1), "valid": (1, 2), "test": (2, 3), "all": (0, 3)}[options.split]
    if n and cuts[stop] == cuts[start]:  # else "has no data rows", as if the file were empty
        raise DataError(
            f"{files['inter'].path}: its {options.split} split holds none of its {n} ratings "
            f"(data.options.fractions: {list(options.fractions)}); give every split a fraction that holds one"
        )
    ratings = ratings.slice(cuts[start], cuts[stop] - cuts[start])
    columns = {name: ratings.column(name) for name in ratings.column_names}
    for name, (lists, cut) in histories.items():
        columns[name] = lists.slice(cuts[start], cuts[stop] - cuts[start])
        truncated = int(cut[cuts[start] : cuts[stop]].sum())
        if truncated:
            bad.stats.truncated[name] = bad.stats.truncated.get(name, 0) + truncated
    for part, key in KEYS.items():
        side_names = [name for name, p in owner.items() if p == part]
        if not side_names:
            continue
        side_bad = BadRows(files[part].path, "line", bad.on_bad_row, bad.stats)
        side = _load(files[part], [key, *side_names], (key,), side_bad)
        _check_unique_keys(files[part].path, side.column(key))
        row = pc.index_in(ratings.column(key), value_set=side.column(key))
        columns |= {name: side.column(name).take(row) for name in side_names}
    label = pc.cast(pc.greater_equal(ratings.column(RATING), options.rating_threshold), pa.float32())
    arrays = [label, *(pc.cast(columns[d], pa.float32()) for d in schema.dense_names)]
    arrays += [
        pc.fill_null(columns[f.name], EMPTY_IDS) if f.multi else columns[f.name] for f in schema.sparse
    ]
    table = pa.Table.from_arrays(arrays, schema=raw_arrow_schema(schema))
    yield from table.combine_chunks().to_batches()
