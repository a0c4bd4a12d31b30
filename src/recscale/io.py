"""Atomic file writes: a crash mid-write never leaves a file or directory that looks valid. Output
directories held by one process at a time."""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import resource
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from recscale.errors import RecscaleError, ResourceError


def _umask() -> int:
    """The process's umask, read where Linux shows it: setting it to read it (os.umask) left, for that
    instant, files another thread created writable by everyone."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):  # not Linux, or a kernel before 4.7
        mask = os.umask(0)
        os.umask(mask)
        return mask


# mkstemp/mkdtemp create 0600/0700 (private temporaries); the renamed result gets what open() and
# mkdir() would have given it, so other users and tools (TensorBoard, a serving host) can read runs.
_UMASK = _umask()
FILE_MODE, DIR_MODE = 0o666 & ~_UMASK, 0o777 & ~_UMASK


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_parent(path: Path, is_dir: bool) -> None:
    """Create ``path``'s parent. Errors name ``path``, not a temporary: a directory where a file goes
    (EISDIR), or a file where a directory goes, on the way or at ``path`` (ENOTDIR; mkdir says EEXIST)."""
    if (special := not_a_file(str(path), path)) is not None:
        raise special
    if path.exists() and path.is_dir() != is_dir:
        code = errno.ENOTDIR if is_dir else errno.EISDIR
        raise OSError(code, os.strerror(code), str(path))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path)) from None


def not_a_file(name: str, path: Path) -> RecscaleError | None:
    """The error of an output ``path`` (given as ``name``) that is a device, a pipe or a terminal, or a
    process's open file (/dev/stdout, /dev/fd/N: links into /proc), else None. The rename that ends an atomic
    write replaced the name itself with a regular file: as root, /dev/null, /dev/full or /dev/stdout."""
    path = Path(os.path.abspath(path))
    if not path.exists():  # a file to make (or a name under /proc, which takes none: the write says so)
        return None
    names = [path]  # the name, and the one its link gives (resolved no further: /proc/self/fd/1 -> the file)
    if path.is_symlink():
        names.append(Path(os.path.abspath(path.parent / os.readlink(path))))
    through_proc = any(Path(os.path.realpath(p.parent), p.name).parts[:2] == ("/", "proc") for p in names)
    if not through_proc and (path.is_file() or path.is_dir()):
        return None
    return RecscaleError(
        f"{name} is not a regular file (a device, a pipe, a terminal or a process's open file); name a file "
        "to write: it is written whole, then renamed over that name"
    )


@contextmanager
def naming(path: Path, always: bool = False) -> Iterator[None]:
    """An OSError in the block that names no file (a write to a full disk) names ``path`` instead: a
    one-line error must say where the disk filled. ``always``: one naming a file names ``path`` too (the
    temporary beside it that a directory such as /proc refuses means nothing to the user)."""
    try:
        yield
    except OSError as e:
        if e.errno is None or (e.filename is not None and not always):
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e


def strict_json(obj: Any, indent: int | None = None) -> str:
    """``obj`` as standard JSON, which has no NaN or Infinity: a non-finite float (AUC or NE of labels of
    one class, the loss of a diverged run) is written as null."""

    def finite(x: Any) -> Any:
        if isinstance(x, float):
            return x if math.isfinite(x) else None
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [finite(v) for v in x]
        return x

    return json.dumps(finite(obj), indent=indent, allow_nan=False)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over ``path``."""
    path = Path(path)
    _make_parent(path, is_dir=False)
    with naming(path, always=True):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with naming(path):
            os.fchmod(fd, FILE_MODE)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def committed(path: Path) -> Path:
    """``path``, or the complete previous version of it that a kill between ``atomic_dir``'s two renames
    left set aside as ``.NAME.old`` (``path`` is then missing until it is written again, or a resume puts a
    run's back: ``remove_partial_checkpoints``), for readers that must not change the directory."""
    path = Path(path)
    old = path.with_name(f".{path.name}.old")
    return old if not path.exists() and old.is_dir() else path


@contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Yield a temporary directory beside ``path``; on success it is renamed to ``path``.

    On any exception the temporary directory is removed and ``path`` is left untouched. An existing
    ``path`` is replaced only after the new one is complete.
    """
    path = Path(path)
    _make_parent(path, is_dir=True)
    with naming(path, always=True):
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    # Held while this process lives: a later write to ``path`` takes a temporary whose lock it can get for
    # one a killed writer left (SIGKILL: no ``except`` ran), and removes it.
    held = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        _remove_abandoned(path, tmp)
        with naming(path):
            os.chmod(tmp, DIR_MODE)
            yield tmp
            for root, _, files in os.walk(tmp):
                for name in files:
                    fd = os.open(os.path.join(root, name), os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)
            if path.exists():
                old = path.with_name(f".{path.name}.old")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(path, old)
                os.replace(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, path)
                # A previous version a kill set aside (``committed``) is superseded now.
                shutil.rmtree(path.with_name(f".{path.name}.old"), ignore_errors=True)
            _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(held)


ABANDONED_AFTER_S = 60  # younger temporaries are left alone: their writer may not hold its lock yet


def _remove_abandoned(path: Path, own: Path) -> None:
    """Remove the temporaries of earlier writes to ``path`` (``atomic_dir``'s ``.NAME.XXXXXXXX.tmp``) whose
    writer is gone: no process holds their lock. Exports into one --out left a copy of the model each time
    one was killed."""
    _remove_unheld(path.parent, re.compile(rf"\.{re.escape(path.name)}\.[a-z0-9_]{{8}}\.tmp"), own)


def raise_open_file_limit() -> None:
    """Raise this process's limit of open files (``ulimit -n``) to its hard limit, as its children inherit it.
    A split holds files open per sparse field while it is written (two scratch files per vocabulary field, a
    column file per hashed, multi-id or weighted one) and memory-maps a file per field to read it: with
    Linux's default soft limit of 1024, ~500 sparse fields failed with "Too many open files"."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit is not a count a soft one may take on every system: a large one instead.
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):  # a system capping it lower (macOS: OPEN_MAX): keep the limit as it is
            pass


@contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A temporary directory (``tempfile``'s, ``PREFIXXXXXXXXX``), removed when the block ends, as
    ``TemporaryDirectory``'s, and held by this process until then: on entry, those of earlier commands that
    were killed before they could remove theirs (SIGKILL, the OOM killer) are removed. Each held a copy of
    the file it scored, as large as the file, left in /tmp for good."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    held = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        _remove_unheld(tmp.parent, re.compile(rf"{re.escape(prefix)}[a-z0-9_]{{8}}"), tmp)
        yield tmp
    except OSError as e:
        # The disk of TMPDIR, not of an output the user named: the CLI's hint said "choose another --out",
        # which eval has not.
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        if not full or e.filename is None or not Path(os.fsdecode(e.filename)).is_relative_to(tmp):
            raise
        raise ResourceError(
            f"{e.filename}: {e.strerror}: the file read is copied into a temporary directory in {tmp.parent} "
            "first; free space there, or set TMPDIR to a directory on a disk with room for it"
        ) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(held)


def _remove_unheld(parent: Path, pattern: re.Pattern[str], own: Path) -> None:
    """Remove the directories in ``parent`` named by ``pattern`` (not ``own``) that no process holds the lock
    of (``atomic_dir``, ``scratch_dir``), and are old enough to have been locked by their maker."""
    for p in parent.iterdir():
        if p == own or not pattern.fullmatch(p.name):
            continue
        try:
            if time.time() - p.stat().st_mtime < ABANDONED_AFTER_S:
                continue
            fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:  # gone meanwhile, or not a directory
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(p, ignore_errors=True)
        except BlockingIOError:  # its writer is still at work
            pass
        finally:
            os.close(fd)


def remove_partial_writes(parent: Path) -> None:
    """Clean up after a process killed inside ``atomic_dir`` (SIGKILL, power loss: no ``except`` ran) in
    ``parent``: drop the temporary directories of unfinished writes, and put back a complete directory that
    was set aside (``.NAME.old``) to be replaced when its replacement never arrived."""
    if not parent.is_dir():
        return
    for p in parent.iterdir():
        if p.name.startswith(".") and p.name.endswith(".tmp") and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith(".") and p.name.endswith(".old") and p.is_dir():
            target = p.with_name(p.name[1 : -len(".old")])
            if target.exists():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.rename(target)


class InUse(OSError):
    """Another process holds the directory (``Hold``)."""


class Hold:
    """The directory ``path`` held by this process, so that two commands writing into it at once (two
    trainings of one --out) fail at once instead of mixing their files: another process's ``Hold`` of it
    raises ``InUse`` until this one is released or its process ends, however it ends (a POSIX lock on
    ``path/.lock``, which the kernel drops with the process). This process may hold it again. Where the
    file system has no locks (some network mounts), the directory is used unguarded."""

    def __init__(self, path: Path) -> None:
        lock = Path(path) / ".lock"
        key = _file_key(lock)
        # Held here already: no second descriptor, whose close would drop the lock.
        if key is not None and key in _HELD:
            _HELD[key][1] += 1
            self.release: Callable[[], object] = weakref.finalize(self, _let_go, key)
            return
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EACCES, errno.EAGAIN):
                raise InUse(errno.EBUSY, "in use by another recscale process", str(path)) from None
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            self.release = lambda: None
            return
        st = os.fstat(fd)
        key = st.st_dev, st.st_ino
        _HELD[key] = [fd, 1]
        self.release = weakref.finalize(self, _let_go, key)  # release(): now, else when garbage-collected

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


# The lock files this process holds, by (device, inode), with their descriptor and the number of Holds on
# them: a POSIX lock belongs to the process and the file, and closing any descriptor of the file drops it,
# so a second Hold of a held directory shares the first's descriptor, closed with the last of them.
_HELD: dict[tuple[int, int], list[int]] = {}


def _file_key(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _let_go(key: tuple[int, int]) -> None:
    held = _HELD[key]
    held[1] -= 1
    if held[1] == 0:
        os.close(held[0])
        del _HELD[key]


@contextmanager
def removed_on_failure(path: Path, enabled: bool = True) -> Iterator[None]:
    """Remove the directory ``path`` if the block fails and ``path`` did not exist before it, so a
    failed command leaves nothing half-made behind (unless another process holds it: it is theirs)."""
    created = enabled and not Path(path).exists()
    try:
        yield
    except BaseException as e:
        if created and not isinstance(e, InUse):
            shutil.rmtree(path, ignore_errors=True)
        raise


def check_output(
    out: Path, flag: str, inputs: Iterable[tuple[str, str | Path | None]], what: str = "file"
) -> None:
    """A one-line ``RecscaleError`` unless a command may write ``out`` (given as ``flag``): not a directory, not
    one of the command's ``inputs`` ((role, path) pairs, e.g. ("the --data", its path)) nor inside one that is a
    directory. Checked before the command's work, which the write would otherwise have thrown away (or the
    input it replaced)."""
    if out.is_dir():
        raise RecscaleError(f"{flag} {out} is a directory; name the {what} to write")
    if (special := not_a_file(f"{flag} {out}", out)) is not None:
        raise special
    where = out.resolve()
    above = next(p for p in where.parents if p.exists())  # the directories to make start below it
    if not above.is_dir():
        raise RecscaleError(f"{flag} {out}: {above} is a file, not a directory; name the {what} to write")
    for role, path in inputs:
        if path is None or not Path(path).exists():
            continue
        src = Path(path).resolve()
        if where == src or (src.is_dir() and src in where.parents):
            what = role if where == src else f"inside {role} {path}"
            raise RecscaleError(f"{flag} {out} is {what}; name another file to write")
