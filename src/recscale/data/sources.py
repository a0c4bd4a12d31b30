"""Open a split of a dataset as a stream of raw record batches, whatever its format."""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from recscale.data.readers import ReadStats, RowFilter, read_batches
from recscale.data.readers.base import OnBadRow, check_regular, data_files, names_data
from recscale.data.readers.movielens import files_of
from recscale.data.schema import Schema
from recscale.data.synthetic import SyntheticSpec, synthetic_batches
from recscale.errors import DataError


def open_split(
    fmt: str,
    path: str | None,
    split: str,
    schema: Schema,
    options: dict[str, Any],
    *,
    synthetic: SyntheticSpec | None = None,
    chunk_rows: int = 65536,
    on_bad_row: OnBadRow = "error",
    stats: ReadStats | None = None,
    keep: RowFilter | None = None,
) -> Iterator[pa.RecordBatch]:
    """Raw record batches of ``split`` (train/valid/test). MovieLens picks its split by option; ``keep``
    selects rows of a file (``read_batches``)."""
    if fmt == "synthetic":
        assert synthetic is not None  # DataConfig fills it for format synthetic
        return synthetic_batches(synthetic, split, chunk_rows=chunk_rows)
    if fmt == "movielens":
        options = {**options, "split": split if split in ("train", "valid", "test") else "all"}
    assert path is not None  # file formats: DataConfig requires train; other splits are read only when set
    return read_batches(
        path, fmt, schema, options, chunk_rows=chunk_rows, on_bad_row=on_bad_row, stats=stats, keep=keep
    )


def source_fingerprint(fmt: str, path: str | None, split: str, extra: dict[str, Any]) -> str:
    """Identifies a split's bytes and how they are read, so a materialised cache is reused only if unchanged."""
    info: dict[str, Any] = {"format": fmt, "split": split, **extra}
    if path is not None:
        if Path(path).exists():  # as named: a pipe's /dev/fd/N resolves to no path (pipe:[N])
            check_regular(Path(path))
        if not names_data(path):
            # A relative path is the working directory's, not the config file's: say which it was read from.
            where = (
                ""
                if Path(path).is_absolute()
                else f" (relative paths are read from the working directory, {Path.cwd()})"
            )
            none = "matches no file" if glob.has_magic(str(path)) else "does not exist"
            raise DataError(
                f"data.{split}: {path} {none}{where}; fix the path in the config or set data.{split}=PATH"
            )
        p = Path(path).resolve()
        if fmt == "movielens":
            st = os.stat(p)
            info.update(path=str(p), size=st.st_size, mtime_ns=st.st_mtime_ns)
            # Its data is the .inter file and the .user/.item beside it: a directory's size and mtime do not
            # change when a file in it is rewritten in place, nor the .inter file's when its .user file is.
            stats = {str(f.path): os.stat(f.path) for f in files_of(p).values()}
            info["files"] = {name: [st.st_size, st.st_mtime_ns] for name, st in stats.items()}
        else:
            files = data_files(path, fmt)
            if len(files) == 1:
                st = os.stat(files[0].resolve())
                info.update(path=str(files[0].resolve()), size=st.st_size, mtime_ns=st.st_mtime_ns)
            else:  # a folder's or a pattern's files: each one's, as a directory's own stat misses a rewrite
                info["path"] = str(path)
                info["files"] = source_files(fmt, path)
    return hashlib.sha256(json.dumps(info, sort_keys=True, default=str).encode()).hexdigest()


def source_files(fmt: str, path: str) -> dict[str, list[int]]:
    """Each file a split reads: its resolved path -> [size, modification time in ns] (a MovieLens directory:
    its .inter, .user and .item files)."""
    if fmt == "movielens":
        files = [Path(f.path) for f in files_of(Path(path).resolve()).values()]
    else:
        files = data_files(path, fmt)
    return {str(f.resolve()): [(st := os.stat(f)).st_size, st.st_mtime_ns] for f in files}


def changed_files(before: dict[str, list[int]], now: dict[str, list[int]]) -> str | None:
    """What differs between two ``source_files`` listings, in words (the first three files named), or None."""
    said = [
        f"{f} was rewritten (size or modification time)" for f in before if f in now and now[f] != before[f]
    ]
    said += [f"{f} is gone" for f in before if f not in now]
    said += [f"{f} is new" for f in now if f not in before]
    if not said:
        return None
    return ", ".join(said[:3]) + (f" and {len(said) - 3} more" if len(said) > 3 else "")
