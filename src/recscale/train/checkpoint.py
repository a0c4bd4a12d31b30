"""Checkpoints: tensors through torch.distributed.checkpoint (DCP), everything else as JSON.

A checkpoint is a directory ``ckpt/step_00000123`` that appears only when complete: it is written
under a temporary name and renamed (``recscale.io.atomic_dir``), so a run killed mid-write leaves
no directory that looks valid. It holds ``.metadata`` (DCP's index, a pickle), the DCP data files
``__<rank>_<n>.distcp``, ``state.json`` (every non-tensor value) and ``sha256.json`` (the sha256 of
each other file, so that a damaged file is found before it loads as wrong weights).

Loading one executes nothing from it: ``.metadata`` goes through ``dcp_safety`` (read that module's
docstring for the security model), ``state.json`` is JSON checked against the structure
``split_state`` writes, the tensors are read by ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from recscale.errors import RESUME, CheckpointError, ResourceError
from recscale.io import atomic_dir, remove_partial_writes
from recscale.train.dcp_safety import (
    CHECKSUMS_FILE,
    METADATA_FILE,
    SafeReader,
    TensorsOnlyPlanner,
    check_sum,
    one_line,
    read_checksums,
    read_regular_file,
    sha256_of,
    tampered,
)
from recscale.train.memory import failed_allocation

STATE_FILE = "state.json"
# state.json holds counters, hyper-parameters, one tensor marker per tensor and ~7 KB of RNG state
# per rank; 64 MiB leaves room for thousands of ranks.
MAX_STATE_BYTES = 64 << 20
_MAX_DEPTH = 64  # split_state nests as deep as the state: a few levels, never dozens


# ---------------------------------------------------------------- tensors vs plain values
def split_state(obj: Any, prefix: str = "") -> tuple[dict[str, Any], Any]:
    """Split a nested state into (flat dict of tensors for DCP, the same structure with tensors as markers)."""
    tensors: dict[str, Any] = {}

    def walk(o: Any, path: str) -> Any:
        if isinstance(o, torch.Tensor):  # also ShardedTensor / DTensor
            tensors[path] = o
            return {"__tensor__": path}
        if isinstance(o, dict):
            return {"__dict__": [[k, walk(v, f"{path}/{k}")] for k, v in o.items()]}
        if isinstance(o, list | tuple):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(o)]
        if o is None or isinstance(o, bool | int | float | str):
            return o
        raise TypeError(f"cannot checkpoint a value of type {type(o).__name__} at {path}")

    return tensors, walk(obj, prefix)


def join_state(plain: Any, tensors: dict[str, Any]) -> Any:
    """Inverse of ``split_state``."""
    if isinstance(plain, dict):
        if "__tensor__" in plain:
            return tensors[plain["__tensor__"]]
        return {k: join_state(v, tensors) for k, v in plain["__dict__"]}
    if isinstance(plain, list):
        return [join_state(v, tensors) for v in plain]
    return plain


def _check_plain(o: Any, depth: int = 0) -> None:
    """Raise ValueError unless ``o`` has the shape ``split_state`` writes (JSON has no other types
    to fear, but ``join_state`` and ``load_checkpoint`` index into it)."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"nested deeper than {_MAX_DEPTH} levels")
    if o is None or type(o) in (bool, int, float, str):
        return
    if type(o) is list:
        for v in o:
            _check_plain(v, depth + 1)
        return
    if type(o) is not dict:
        raise ValueError(f"holds a {type(o).__name__}")
    if o.keys() == {"__tensor__"} and type(o["__tensor__"]) is str:
        return
    if o.keys() != {"__dict__"} or type(o["__dict__"]) is not list:
        raise ValueError(f"holds an object with keys {sorted(o)[:4]}, neither a tensor marker nor a dict")
    for item in o["__dict__"]:
        if type(item) is not list or len(item) != 2 or type(item[0]) not in (str, int):
            raise ValueError("holds a __dict__ item that is not a [key, value] pair")
        _check_plain(item[1], depth + 1)


def _read_state_json(path: Path, sums: dict[str, str] | None = None) -> dict[str, Any]:
    data = read_regular_file(path, MAX_STATE_BYTES)
    try:
        plain = json.loads(data.decode("utf-8"))
        _check_plain(plain)
        if type(plain) is not dict or "__dict__" not in plain:
            raise ValueError("is not the state of a model")
    except Exception as e:  # UnicodeDecodeError, JSONDecodeError, RecursionError, MemoryError, ...
        raise tampered(path, f"is truncated or not recscale's state file ({one_line(e)})") from None
    check_sum(path, sums, data)
    return plain


# ---------------------------------------------------------------- save / load
def save_checkpoint(path: Path, state: dict[str, Any], rank: int = 0) -> None:
    """Write ``state`` (nested dicts of tensors and plain values) to ``path`` atomically.

    Collective: every rank calls it. Rank 0 owns the directory rename; all ranks write into it.
    """
    import torch.distributed as dist

    tensors, plain = split_state(state)
    world = dist.get_world_size() if dist.is_initialized() else 1
    tmp_holder: list[Any] = [None]
    if rank == 0:
        ctx = atomic_dir(path)
        tmp_holder[0] = str(ctx.__enter__())
    if world > 1:
        dist.broadcast_object_list(tmp_holder, src=0)
    tmp = Path(tmp_holder[0])
    try:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp)))
        # Each rank hashes the data files it wrote (DCP names them __<rank>_<n>.distcp); rank 0 lists all.
        own = {p.name: sha256_of(p) for p in tmp.glob(f"__{dist.get_rank() if world > 1 else 0}_*.distcp")}
        every: list[Any] | None = [own]
        if world > 1:
            every = [None] * world if rank == 0 else None
            dist.gather_object(own, every, dst=0)
        if rank == 0:
            data = json.dumps(plain).encode()
            (tmp / STATE_FILE).write_bytes(data)
            sums = {name: digest for d in every or [] for name, digest in d.items()}
            sums |= {
                STATE_FILE: hashlib.sha256(data).hexdigest(),
                METADATA_FILE: sha256_of(tmp / METADATA_FILE),
            }
            (tmp / CHECKSUMS_FILE).write_text(json.dumps({"sha256": dict(sorted(sums.items()))}, indent=1))
        if world > 1:
            dist.barrier()
    except BaseException as e:
        # DCP's error is a BaseException, which went past the CLI as a traceback; read the disk's free
        # space before the cleanup below frees what the partial checkpoint took.
        error = _write_error(path, e) if isinstance(e, CheckpointException) else None
        if rank == 0:
            ctx.__exit__(type(e), e, e.__traceback__)
        if error is not None:
            raise error from None
        raise
    if rank == 0:
        ctx.__exit__(None, None, None)
    if world > 1:
        dist.barrier()


def _interruption(e: CheckpointException) -> BaseException | None:
    """The Ctrl-C or SIGTERM (``KeyboardInterrupt``, ``Terminated``: no Exceptions) that landed inside DCP, which
    catches every BaseException and reports it as the checkpoint's failure: raised as itself, it stops the
    command as it would anywhere else, not as a full disk or a damaged checkpoint."""
    return next((exc for exc, _ in e.failures.values() if not isinstance(exc, Exception)), None)


def _own_error(e: CheckpointException) -> CheckpointError | None:
    return next((exc for exc, _ in e.failures.values() if isinstance(exc, CheckpointError)), None)


def _out_of_memory(path: Path, e: BaseException) -> ResourceError | None:
    """A read that ran out of memory (DCP reads a whole saved tensor before copying it into its shard): the
    checkpoint is intact, not damaged, and deleting it would lose the run. None for other errors."""
    errors = [exc for exc, _ in e.failures.values()] if isinstance(e, CheckpointException) else [e]
    tried = next((n for n in map(failed_allocation, errors) if n is not None), None)
    if tried is None:
        return None
    return ResourceError(
        f"{path}: out of memory reading the checkpoint"
        + (f" (the allocation that failed: {tried:,} bytes)" if tried else "")
        + "; the checkpoint is not damaged: give the process more memory or run on more ranks (--nproc)"
    )


def _disk_error(path: Path, e: BaseException, keep_name: bool) -> OSError | None:
    """The disk's error (an OSError with an errno) among a DCP call's failures, naming its own file (``keep_name``,
    where it has one) or ``path``; None for other errors. A read's: a file this user may not read, an I/O error;
    the checkpoint is not damaged, and the line must not say so, inviting its deletion."""
    errors = [exc for exc, _ in e.failures.values()] if isinstance(e, CheckpointException) else [e]
    for exc in errors:
        if isinstance(exc, OSError) and exc.errno is not None:
            return OSError(exc.errno, exc.strerror, (keep_name and exc.filename) or str(path))
    return None


def _write_error(path: Path, e: CheckpointException) -> BaseException:
    """What a failed DCP write ends the command with: an interruption as itself, the disk's error (an OSError)
    naming ``path``, else one line with the first rank's error and the disk's free space (torch's zip writer
    reports a full disk as 'unexpected pos')."""
    if (stop := _interruption(e)) is not None:
        return stop
    if (disk := _disk_error(path, e, keep_name=False)) is not None:
        return disk
    errors = [exc for exc, _ in e.failures.values()]
    free = shutil.disk_usage(path.parent).free  # save_checkpoint's atomic_dir created the parent
    # A file-size limit (ulimit -f) fails the write alike, with the same message: no errno reaches here.
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    limited = limit != resource.RLIM_INFINITY
    return CheckpointError(
        f"{path}: the checkpoint could not be written ({one_line(errors[0] if errors else e)}; "
        f"{free:,} bytes free on its disk"
        + (f", files of at most {limit:,} bytes for this process (ulimit -f)" if limited else "")
        + f"); free space{', raise the limit' if limited else ''} or fix the disk, then continue with {RESUME}"
    )


def saved_step(path: Path) -> int | None:
    """The training step the weights in the checkpoint at ``path`` (best/) are from, as its "step" entry
    says; None where ``path`` holds no state.json or it has no such entry (best/ of an older version).
    Reads only state.json, checked as ``load_checkpoint`` checks it."""
    state_file = Path(path) / STATE_FILE
    if not os.path.lexists(state_file):
        return None
    step = dict(_read_state_json(state_file)["__dict__"]).get("step")
    return step if type(step) is int else None


# Model buffers added after checkpoints were first written, whose initial value is what an older model
# computed: a checkpoint without them loads, and they keep the template's value (the identity calibration).
OPTIONAL_ENTRIES = ("calibration.scale", "calibration.bias")


def _check_sizes(path: Path, wanted: dict[str, Any], saved: dict[str, Any]) -> None:
    """A whole tensor whose saved (global) size is not this model's: one line naming it, before DCP's own
    message, which calls an intact checkpoint damaged."""
    for key, tensor in wanted.items():
        size = getattr(saved.get(key), "size", None)
        own = list(tensor.size()) if isinstance(tensor, torch.Tensor) else None
        if size is None or own is None or list(size) == own:
            continue
        why = (
            "row-wise Adagrad keeps one accumulator per row of each column shard, so a column-sharded run "
            "resumes only with the same column shards: its world size and sharding"
            if key.endswith("momentum1")
            else "the checkpoint belongs to another model or config"
        )
        raise CheckpointError(f"{path}: {key} was saved with size {list(size)}, this run has {own}; {why}")


def _complete(path: Path) -> Path:
    if not path.is_dir() or not (
        os.path.lexists(path / METADATA_FILE) and os.path.lexists(path / STATE_FILE)
    ):
        raise CheckpointError(f"{path}: not a complete recscale checkpoint")
    return path


def saved_keys(path: Path) -> set[str]:
    """The keys of the tensors checkpoint ``path`` holds (``/model/…``, as ``split_state`` names them),
    from its checked metadata, before any tensor is read."""
    return set(SafeReader(str(_complete(Path(path)))).read_metadata().state_dict_metadata)


def load_checkpoint(path: Path, template: dict[str, Any]) -> dict[str, Any]:
    """Load into ``template`` (a state of the same structure, with tensors of the right shapes/sharding).

    Returns the loaded state. A top-level entry holding tensors keeps the template's own structure
    with its tensors filled from DCP: sharded tables and their optimizer state have different keys
    on different ranks and world sizes, and DCP reshards the saved tensors into whatever this rank
    holds now (so a checkpoint saved by N ranks loads on M). An entry without tensors (the
    progress, the RNG states) is returned as state.json saved it.

    Every file is checked (module docstring) before DCP reads any tensor data; a bad one is a
    one-line ``CheckpointError`` naming it.
    """
    path = Path(path)
    state_file = _complete(path) / STATE_FILE
    sums = read_checksums(path)
    plain = _read_state_json(state_file, sums)
    reader = SafeReader(str(path), sums)
    saved_keys = reader.read_metadata().state_dict_metadata  # every check first; dcp.load reuses it
    tensors, _ = split_state(template)
    # Entries newer than the checkpoint keep the template's value (see OPTIONAL_ENTRIES).
    wanted = {k: v for k, v in tensors.items() if k in saved_keys or not k.endswith(OPTIONAL_ENTRIES)}
    _check_sizes(path, wanted, saved_keys)
    try:
        dcp.load(wanted, storage_reader=reader, planner=TensorsOnlyPlanner())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP wraps storage errors in a BaseException subclass
        if isinstance(e, CheckpointException) and (stop := _interruption(e)) is not None:
            raise stop from None
        if isinstance(e, CheckpointException) and (own := _own_error(e)) is not None:
            raise own from None  # a data file SafeReader refused: its line names the file
        if (memory := _out_of_memory(path, e)) is not None:
            raise memory from None
        if (unreadable := _disk_error(path, e, keep_name=True)) is not None:
            raise unreadable from None
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path}: could not be read into this model ({one_line(first)}); the checkpoint is damaged, "
            "or belongs to another model or config"
        ) from None
    try:
        saved = dict(plain["__dict__"])
        out = {}
        for key, value in template.items():
            own_tensors, own_plain = split_state(value, f"/{key}")
            out[key] = join_state(own_plain, tensors) if own_tensors else join_state(saved[key], {})
        return out
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"{state_file}: does not match the model's state ({one_line(e)}); "
            "the checkpoint belongs to another model or config"
        ) from None


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints under ``ckpt_dir``, oldest first (temporary dirs start with '.')."""
    if not Path(ckpt_dir).is_dir():
        return []
    return sorted(
        p for p in Path(ckpt_dir).iterdir() if p.name.startswith("step_") and (p / STATE_FILE).is_file()
    )


def prune_checkpoints(ckpt_dir: Path, keep: int) -> None:
    for old in list_checkpoints(ckpt_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def remove_partial_checkpoints(run_dir: Path) -> None:
    """Clean up after a run killed while writing a checkpoint (its data splits: ``prepare_run_data``): drop
    the temporary directories of unfinished writes, and put back a checkpoint that was set aside
    (``.NAME.old``) to be replaced when its replacement never arrived."""
    for parent in (Path(run_dir), Path(run_dir) / "ckpt"):
        remove_partial_writes(parent)
