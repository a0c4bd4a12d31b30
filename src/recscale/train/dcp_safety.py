"""Safe reading of DCP checkpoints.

Security model: a checkpoint directory is untrusted input (runs are copied between machines and
people), and loading one must never execute code from it. Loading reads three kinds of file:

- ``.metadata`` is a pickle, read by ``_MetadataUnpickler``: a pure-Python unpickler whose globals
  come from an exact ``(module, name)`` table (``_ALLOWED_GLOBALS``: DCP's metadata dataclasses,
  ``torch.Size``, a few dtypes, ``torch.serialization._get_layout``, ``pathlib.PosixPath``) by plain
  dictionary lookup, never by import or attribute walk, so dotted names cannot reach through a
  module's globals; ``builtins.getattr`` is ``_enum_member``, which names a memory-format enum member
  and nothing else. Only the opcodes DCP's metadata uses are accepted; REDUCE/NEWOBJ call only
  objects from that table and BUILD only sets state on instances of DCP's dataclasses (never on a
  class). The result is then type-checked field by field (``_check_metadata``).
- Every entry must be ``TensorStorageMetadata``: DCP reads ``BytesStorageMetadata`` entries with
  ``torch.load(weights_only=False)``, i.e. a pickle that could run code, and recscale never writes
  them (non-tensors go to state.json). Every chunk must have a storage record, and every record
  must name a ``*.distcp`` file of this directory (no ``/``, no ``..``, a regular file, not a
  symlink) and a non-negative byte range inside it. As a second guard the load planner refuses to
  unpickle bytes at all (``TensorsOnlyPlanner``).
- The tensors themselves DCP reads with ``torch.load(weights_only=True)``, torch's restricted
  unpickler. ``state.json`` is JSON checked against the structure ``split_state`` writes.

Damage is a separate matter: a flipped byte inside a tensor passes every check above and loads as a
wrong weight. ``sha256.json`` (``CHECKSUMS_FILE``) lists the sha256 of every other file; each file is
compared with it after the checks above (so a hostile file meets the same guards whether or not the
list was rewritten with it) and before it is used: a data file before DCP reads from it, by the rank
that reads it. A checkpoint written before the list existed loads unchecked.

The metadata checked is the metadata DCP uses (``SafeReader`` reads it once and caches it), so a
file swapped in after the check is not read. Every fault the checks find (missing, empty,
truncated, oversized, symlinked, not a regular file, malformed, tampered) is a one-line
``CheckpointError`` naming the file, raised before DCP reads any tensor data; a data file that then
fails to decode is a one-line ``CheckpointError`` naming the checkpoint. Loading writes nothing.
Size caps bound the memory a hostile file can cost. The run's other files are checked where they
are read: ``preprocess.json`` by ``Preprocessor.load``, ``config.yaml`` by ``train.runs``.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pathlib
import pickle
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from recscale.errors import CheckpointError

METADATA_FILE = ".metadata"
# DCP's index costs ~300 bytes per tensor chunk: 64 MiB is ~200k chunks, far beyond any model
# sharded over hundreds of ranks, yet small enough that a hostile file cannot exhaust memory.
MAX_METADATA_BYTES = 64 << 20
CHECKSUMS_FILE = "sha256.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")


def one_line(e: object, limit: int = 200) -> str:
    """An error text fit for a one-line message (hostile files can put newlines in names)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def tampered(path: Path, what: str, kind: str = "checkpoint") -> CheckpointError:
    return CheckpointError(
        f"{path}: {one_line(what, 300)}; the {kind} is damaged or was tampered with: "
        "restore it from a good copy or delete it"
    )


def read_regular_file(path: Path, cap: int, kind: str = "checkpoint") -> bytes:
    """The bytes of ``path``, which must be a regular file (not a symlink) of 1..cap bytes of a ``kind``."""
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            raise tampered(path, f"is a symbolic link, and recscale writes none in a {kind}", kind)
        # O_NOFOLLOW: a link swapped in after the check still fails; O_NONBLOCK: a FIFO cannot hang us.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise tampered(path, "is not a regular file", kind)
            data = b"" if st.st_size > cap else f.read(cap + 1)  # +1: it may have grown since
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the {kind} is incomplete: delete it") from None
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EIO):
            # A file this user may not read, or the disk's read error: not known to be damaged, and a line
            # saying so invited deleting an intact checkpoint.
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise tampered(path, f"cannot be read ({e.strerror or e})", kind) from None
    if st.st_size > cap or len(data) > cap:
        raise tampered(path, f"is larger than {cap >> 20} MiB, more than any recscale {kind} writes", kind)
    if not data:
        raise tampered(path, "is empty", kind)
    return data


# ---------------------------------------------------------------- checksums
def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_checksums(ckpt: Path) -> dict[str, str] | None:
    """File name -> sha256 as checkpoint ``ckpt``'s ``sha256.json`` lists them; None where it has none (a
    checkpoint of a recscale that did not write one)."""
    path = Path(ckpt) / CHECKSUMS_FILE
    if not os.path.lexists(path):
        return None
    data = read_regular_file(path, MAX_METADATA_BYTES)
    try:
        sums = json.loads(data.decode("utf-8"))["sha256"]
        if type(sums) is not dict or not all(
            type(k) is str and type(v) is str and _SHA256.fullmatch(v) for k, v in sums.items()
        ):
            raise ValueError("not a map of file names to sha256 digests")
    except Exception as e:  # UnicodeDecodeError, JSONDecodeError, KeyError, TypeError, ...
        raise tampered(path, f"is not recscale's checksum list ({one_line(e)})") from None
    return sums


def check_sum(path: Path, sums: dict[str, str] | None, data: bytes | None = None) -> None:
    """``path`` (or ``data``, its bytes as already read) against the sha256 ``sums`` lists for it; nothing
    where ``sums`` is None."""
    if sums is None:
        return
    want = sums.get(path.name)
    if want is None:
        raise tampered(path, f"is not listed in {CHECKSUMS_FILE}")
    try:
        have = hashlib.sha256(data).hexdigest() if data is not None else sha256_of(path)
    except OSError as e:  # the disk's error, as read_regular_file has it
        raise OSError(e.errno, e.strerror, str(path)) from None
    if have != want:
        raise tampered(path, f"its sha256 does not match {CHECKSUMS_FILE}: it changed after it was saved")


# ---------------------------------------------------------------- safe DCP metadata
# Everything DCP's .metadata refers to in torch 2.13 (listed from real checkpoints with
# pickletools): exact (module, name) pairs, looked up in this table and never imported.
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16,
           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)  # fmt: skip
_DATACLASSES = (Metadata, TensorStorageMetadata, TensorProperties, ChunkStorageMetadata, MetadataIndex,
                StorageMeta, _StorageInfo, BytesStorageMetadata)  # fmt: skip
_DCP_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    (_DCP_MD, "Metadata"): Metadata,
    (_DCP_MD, "TensorStorageMetadata"): TensorStorageMetadata,
    (_DCP_MD, "TensorProperties"): TensorProperties,
    (_DCP_MD, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_DCP_MD, "MetadataIndex"): MetadataIndex,
    (_DCP_MD, "StorageMeta"): StorageMeta,
    (_DCP_MD, "_MEM_FORMAT_ENCODING"): _MEM_FORMAT_ENCODING,  # TensorProperties' memory format
    # Harmless to build, admitted so that _check_metadata can name the entry it refuses.
    (_DCP_MD, "BytesStorageMetadata"): BytesStorageMetadata,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # "torch.strided" -> layout
    ("torch", "Size"): torch.Size,
    ("pathlib", "PosixPath"): pathlib.PosixPath,  # StorageMeta.checkpoint_id
    **{("torch", str(d).removeprefix("torch.")): d for d in _DTYPES},
}


def _enum_member(*args: Any) -> Any:
    """What ``builtins.getattr`` resolves to: Python 3.11's first releases (3.11.2, Debian 12's) pickle an Enum
    member as ``getattr(EnumClass, name)``, not ``EnumClass(value)`` as later ones do, so every .metadata
    they write names it. It only names a member of TensorProperties' memory-format enum."""
    if len(args) == 2 and args[0] is _MEM_FORMAT_ENCODING and type(args[1]) is str:
        member = _MEM_FORMAT_ENCODING.__members__.get(args[1])
        if member is not None:
            return member
    raise pickle.UnpicklingError(
        f"forbidden global 'builtins' 'getattr' but to name a member of {_MEM_FORMAT_ENCODING.__name__}"
    )


_CALLABLES = (
    torch.Size,
    torch.serialization._get_layout,
    _MEM_FORMAT_ENCODING,
    pathlib.PosixPath,
    _enum_member,
)
_OPCODES = (pickle.PROTO, pickle.FRAME, pickle.STOP, pickle.MARK, pickle.NONE, pickle.NEWTRUE,
            pickle.NEWFALSE, pickle.BININT, pickle.BININT1, pickle.BININT2, pickle.LONG1, pickle.BINFLOAT,
            pickle.SHORT_BINUNICODE, pickle.BINUNICODE, pickle.EMPTY_TUPLE, pickle.TUPLE, pickle.TUPLE1,
            pickle.TUPLE2, pickle.TUPLE3, pickle.EMPTY_LIST, pickle.APPEND, pickle.APPENDS,
            pickle.EMPTY_DICT, pickle.SETITEM, pickle.SETITEMS, pickle.MEMOIZE, pickle.BINPUT,
            pickle.LONG_BINPUT, pickle.BINGET, pickle.LONG_BINGET, pickle.GLOBAL, pickle.STACK_GLOBAL,
            pickle.REDUCE, pickle.NEWOBJ, pickle.BUILD)  # fmt: skip


def _gated(op: bytes, allowed: Callable[[Any], bool], what: str) -> Callable[[Any], None]:
    base = pickle._Unpickler.dispatch[op[0]]

    def load(self: Any) -> None:
        target = self.stack[-2]  # REDUCE/NEWOBJ: (callable, args); BUILD: (instance, state)
        if not allowed(target):
            raise pickle.UnpicklingError(f"{what} a {type(target).__name__} is not allowed")
        base(self)

    return load


class _Dispatch(dict):
    def __missing__(self, code: int) -> Any:
        raise pickle.UnpicklingError(f"pickle opcode {bytes([code])!r} is not used by DCP metadata")


class _MetadataUnpickler(pickle._Unpickler):
    """Python's pure-Python unpickler restricted to ``_OPCODES`` and ``_ALLOWED_GLOBALS``. Pure Python
    because only there can BUILD, REDUCE and NEWOBJ be gated: the C unpickler's BUILD would also set
    attributes on an allowed *class*. Costs ~1 s per MB of metadata, ~0.04 s for a typical run."""

    dispatch = _Dispatch({op[0]: pickle._Unpickler.dispatch[op[0]] for op in _OPCODES})
    dispatch[pickle.BUILD[0]] = _gated(
        pickle.BUILD, lambda o: type(o) in _DATACLASSES, "setting the state of"
    )
    dispatch[pickle.REDUCE[0]] = _gated(pickle.REDUCE, lambda f: any(f is c for c in _CALLABLES), "calling")
    dispatch[pickle.NEWOBJ[0]] = _gated(
        pickle.NEWOBJ, lambda c: any(c is d for d in _DATACLASSES), "creating"
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        obj = _ALLOWED_GLOBALS.get((module, name))
        if obj is None:
            raise pickle.UnpicklingError(f"forbidden global {module!r} {name!r}")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not used by DCP metadata")


def _is_count(x: Any) -> bool:
    return type(x) is int and x >= 0


def _is_size(x: Any, ndim: int | None = None) -> bool:
    return type(x) is torch.Size and all(_is_count(v) for v in x) and ndim in (None, len(x))


def _check_metadata(md: Any, path: Path) -> None:
    """Type-check what the unpickler built, so DCP sees only tensor entries and in-bounds reads of
    this directory's own data files. ``path`` is the .metadata file."""
    if type(md) is not Metadata or type(md.state_dict_metadata) is not dict:
        raise tampered(path, "is not DCP checkpoint metadata")
    for key, entry in md.state_dict_metadata.items():
        if type(entry) is not TensorStorageMetadata:
            raise tampered(path, f"entry {one_line(repr(key), 80)} is {type(entry).__name__}, not a tensor: recscale "
                                  "saves only tensors with DCP, and DCP would unpickle it (could run code)")  # fmt: skip
        p, size = entry.properties, entry.size
        if not (type(key) is str and type(p) is TensorProperties and type(entry.chunks) is list
                and type(p.dtype) is torch.dtype and p.dtype in _DTYPES and _is_size(size)):  # fmt: skip
            raise tampered(path, f"entry {one_line(repr(key), 80)} is malformed")
        for c in entry.chunks:
            if not (type(c) is ChunkStorageMetadata and _is_size(c.offsets, len(size))
                    and _is_size(c.sizes, len(size))
                    and all(o + s <= n for o, s, n in zip(c.offsets, c.sizes, size, strict=True))):  # fmt: skip
                raise tampered(path, f"entry {one_line(repr(key), 80)} has a chunk outside the tensor")
    if type(md.storage_data) is not dict:
        raise tampered(path, "has no storage records")
    stored = {(i.fqn, tuple(i.offset or ())) for i in md.storage_data if type(i) is MetadataIndex}
    for key, entry in md.state_dict_metadata.items():
        assert type(entry) is TensorStorageMetadata  # checked in the first loop
        if any((key, tuple(c.offsets)) not in stored for c in entry.chunks):
            raise tampered(path, f"entry {one_line(repr(key), 80)} has a chunk with no storage record")
    file_sizes: dict[str, int] = {}
    for index, info in md.storage_data.items():
        if not (type(index) is MetadataIndex and type(index.fqn) is str
                and (index.offset is None or _is_size(index.offset))
                and (index.index is None or _is_count(index.index))
                and type(info) is _StorageInfo and _is_count(info.offset) and _is_count(info.length)
                and not info.transform_descriptors):  # fmt: skip
            raise tampered(path, f"storage record {one_line(index, 80)} is malformed")
        name = info.relative_path
        # DCP's FileSystemWriter names its files __<rank>_<n>.distcp, side by side with .metadata.
        if type(name) is not str or not name.endswith(".distcp") or any(c in name for c in "/\\\0"):
            raise tampered(
                path, f"storage record names {one_line(repr(name), 80)}, not a data file of this checkpoint"
            )
        if name not in file_sizes:
            st = os.lstat(path.parent / name) if os.path.lexists(path.parent / name) else None
            if st is None or not stat.S_ISREG(st.st_mode):
                raise tampered(path.parent / name, "is missing, a symbolic link or not a regular file")
            file_sizes[name] = st.st_size
        if info.offset + info.length > file_sizes[name]:
            raise tampered(
                path.parent / name, f"is truncated: {one_line(repr(index.fqn), 80)} lies beyond its end"
            )
    pd = md.planner_data
    if pd is not None and not (type(pd) is dict and all(type(k) is str and type(v) is tuple
                                                        and all(type(x) in (str, int) for x in v)
                                                        for k, v in pd.items())):  # fmt: skip
        raise tampered(path, "has malformed planner data")
    sm = md.storage_meta
    if sm is not None and not (type(sm) is StorageMeta and type(sm.modules) is list
                               and type(sm.checkpoint_id) in (type(None), str, pathlib.PosixPath)):  # fmt: skip
        raise tampered(path, "has malformed storage meta")
    if md.version is not None and type(md.version) is not str:
        raise tampered(path, "has a malformed version")


def load_metadata(ckpt: Path, sums: dict[str, str] | None = None) -> Metadata:
    """The checked DCP metadata of checkpoint directory ``ckpt`` (see the module docstring), and checked
    against its ``sums`` (``read_checksums``) where given."""
    path = Path(ckpt) / METADATA_FILE
    data = read_regular_file(path, MAX_METADATA_BYTES)
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
        _check_metadata(md, path)  # objects built without __init__ may lack fields: AttributeError
    except CheckpointError:
        raise
    except Exception as e:  # a hostile pickle can raise anything; none of it may escape as-is
        detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise tampered(path, f"is not readable DCP metadata ({detail})") from None
    check_sum(path, sums, data)
    return md


class SafeReader(FileSystemReader):
    """DCP reader whose metadata is ``load_metadata``'s, read once and reused for the whole load; with
    ``sums``, each data file is checked against them before the first read from it."""

    def __init__(self, path: str | os.PathLike, sums: dict[str, str] | None = None) -> None:
        super().__init__(path)
        self._metadata: Metadata | None = None
        self._sums = sums
        self._checked: set[str] = set()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            self._metadata = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = load_metadata(Path(self.path), self._sums)
        md = self._metadata
        md.storage_meta = md.storage_meta or StorageMeta()  # as FileSystemReader does
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
            if name not in self._checked:  # the files this rank reads, each once
                check_sum(Path(self.path) / name, self._sums)
                self._checked.add(name)
        return super().read_data(plan, planner)


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """Second guard after _check_metadata: never unpickle a bytes entry (DCP does it unrestricted)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is pickled bytes; refused")


MANIFEST = "manifest.json"  # names an artifact directory's kind (exported model, retrieval model)


def manifest_format(manifest_path: Path) -> object:
    """The ``format`` a manifest file names (None if it is unreadable or names none)."""
    try:
        manifest = json.loads(read_regular_file(manifest_path, 1 << 20, "manifest"))
    except (CheckpointError, OSError, ValueError):
        return None
    return manifest.get("format") if type(manifest) is dict else None
