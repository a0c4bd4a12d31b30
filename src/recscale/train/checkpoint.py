"""Checkpoints: tensors through torch.distributed.checkpoint (DCP), everything else as JSON.

A checkpoint is a directory ``ckpt/step_00000123`` that appears only when complete: it is written
under a temporary name and renamed (``recscale.io.atomic_dir``), so a run killed mid-write leaves
no directory that looks valid.

Safe loading: DCP stores non-tensor values by pickling them and reads its ``.metadata`` file with
``pickle.load``. Here only tensors go to DCP (numbers, strings and lists go to ``state.json``), and
``.metadata`` is read with an unpickler that admits DCP's own metadata classes and nothing else, so
a tampered checkpoint gets a clear error instead of running code.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from recscale.errors import CheckpointError
from recscale.io import atomic_dir

STATE_FILE = "state.json"


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


# ---------------------------------------------------------------- safe DCP metadata
class _MetadataUnpickler(pickle.Unpickler):
    _ALLOWED_TORCH = {"Size", "device", "layout", "memory_format", "strided", "contiguous_format"}

    def find_class(self, module: str, name: str) -> Any:
        if (
            module.startswith("torch.distributed.checkpoint.")
            or module in ("collections",)
            and name == "OrderedDict"
        ):
            return super().find_class(module, name)
        if module == "torch" and (
            name in self._ALLOWED_TORCH or isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        if (module, name) == (
            "torch.serialization",
            "_get_layout",
        ):  # maps a layout name to torch.strided etc.
            return super().find_class(module, name)
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath"):  # DCP records the checkpoint path
            return super().find_class(module, name)
        if module == "builtins" and name in ("set", "frozenset", "slice"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"forbidden object {module}.{name} in checkpoint metadata")


class SafeReader(FileSystemReader):
    """DCP reader whose metadata load admits only DCP's own classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            md = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
            raise CheckpointError(f"{path}: checkpoint metadata is truncated or tampered ({e})") from None
        if not isinstance(md, Metadata):
            raise CheckpointError(f"{path}: checkpoint metadata is not DCP metadata")
        md.storage_meta = getattr(md, "storage_meta", None)
        return md


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
        if rank == 0:
            (tmp / STATE_FILE).write_text(json.dumps(plain))
        if world > 1:
            dist.barrier()
    except BaseException as e:
        if rank == 0:
            ctx.__exit__(type(e), e, e.__traceback__)
        raise
    if rank == 0:
        ctx.__exit__(None, None, None)
    if world > 1:
        dist.barrier()


def load_checkpoint(path: Path, template: dict[str, Any]) -> dict[str, Any]:
    """Load into ``template`` (a state of the same structure, with tensors of the right shapes/sharding).

    Returns the loaded state. A top-level entry holding tensors keeps the template's own structure
    with its tensors filled from DCP: sharded tables and their optimizer state have different keys
    on different ranks and world sizes, and DCP reshards the saved tensors into whatever this rank
    holds now (so a checkpoint saved by N ranks loads on M). An entry without tensors (the
    progress, the RNG states) is returned as state.json saved it.
    """
    path = Path(path)
    state_file = path / STATE_FILE
    if not (path / ".metadata").is_file() or not state_file.is_file():
        raise CheckpointError(f"{path}: not a complete recscale checkpoint")
    try:
        plain = json.loads(state_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{state_file}: truncated or corrupt ({e})") from None
    tensors, _ = split_state(template)
    SafeReader(str(path)).read_metadata()  # fail with our message before DCP wraps it in its own
    try:
        dcp.load(tensors, storage_reader=SafeReader(str(path)))
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP wraps storage errors in a BaseException subclass
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: checkpoint could not be read ({first[:200]})") from None
    try:
        saved = dict(plain["__dict__"])
        out = {}
        for key, value in template.items():
            own_tensors, own_plain = split_state(value, f"/{key}")
            out[key] = join_state(own_plain, tensors) if own_tensors else join_state(saved[key], {})
        return out
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{state_file}: does not match the model's state ({e})") from None


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
    """Clean up after a run killed while writing a checkpoint: drop the temporary directories of
    unfinished writes, and put back a checkpoint that was set aside (``.NAME.old``) to be replaced
    when its replacement never arrived."""
    for parent in (Path(run_dir), Path(run_dir) / "ckpt"):
        if not parent.is_dir():
            continue
        for p in parent.iterdir():
            if p.name.startswith(".") and p.name.endswith(".tmp") and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            elif p.name.startswith(".") and p.name.endswith(".old") and p.is_dir():
                target = p.with_name(p.name[1 : -len(".old")])
                if target.exists():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.rename(target)
