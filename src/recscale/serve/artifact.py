"""An exported model on disk: what it holds, how it is written and how it is read back safely.

A model directory (``recscale export``) holds::

    manifest.json         format, version, table/dense precision, where it came from, sha256 + size of each file
    config.yaml           the run's resolved config (the model section builds the network)
    preprocess.json       the fitted vocabularies and dense transforms (``Preprocessor``)
    weights.safetensors   every tensor of the inference model (quantized tables as their raw rows)

It is written atomically (``atomic_dir``) with the manifest last, and read as data only: each file is
read once, its bytes hashed and compared with the manifest, and only those bytes parsed (YAML
safe_load, JSON, safetensors: nothing is unpickled, no code runs). A file changed after export fails
the hash with one line naming it. The hashes catch damage and edits, not a forger who rewrites the
manifest too (there is no signature); such a forger still gets only data parsed by these readers.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from recscale.config import RunConfig, format_validation_error, validate_config
from recscale.config_files import load_yaml
from recscale.data.preprocess import MAX_ARTIFACT_BYTES, Preprocessor
from recscale.errors import CheckpointError, ConfigError
from recscale.io import atomic_dir, committed
from recscale.train.dcp_safety import MANIFEST, manifest_format, one_line, read_regular_file

CONFIG, PREPROCESS, WEIGHTS = (
    "config.yaml",
    "preprocess.json",
    "weights.safetensors",
)
KIND = "model artifact"
_CAPS = {MANIFEST: 1 << 20, CONFIG: 16 << 20, PREPROCESS: MAX_ARTIFACT_BYTES, WEIGHTS: 64 << 30}

TableFormat = Literal["fp32", "fp16", "int8", "int4"]
DenseFormat = Literal["fp32", "bf16", "int8"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FileEntry(_Strict):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=1)


class Manifest(_Strict):
    format: Literal["recscale-model"] = "recscale-model"
    version: Literal[1] = 1
    model: str
    tables: TableFormat
    dense: DenseFormat
    source: str  # the run directory and checkpoint it was exported from, for people
    files: dict[str, FileEntry]


@dataclass
class Artifact:
    manifest: Manifest
    config: RunConfig
    pre: Preprocessor
    tensors: dict[str, torch.Tensor]


def check_out(out: Path, fmt: str, kind: str) -> None:
    """``out`` may receive an artifact of format ``fmt`` (``kind`` names it): it is new, empty, or one of that
    format to replace (never a run directory, another kind of artifact or any other directory, which would
    be deleted)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and manifest_format(out / MANIFEST) != fmt)):
        raise CheckpointError(f"--out {out}: exists and is not {kind}; name a new directory (it is created)")


def check_model_out(out: Path) -> None:
    """``out`` may receive an exported model (``check_out``)."""
    check_out(out, "recscale-model", "an exported model")


def write_artifact(
    out: Path, config: RunConfig, pre: Preprocessor, tensors: dict[str, torch.Tensor], manifest: Manifest
) -> Manifest:
    """Write the model directory ``out`` atomically (an existing model directory is replaced only once
    the new one is complete; any other non-empty directory is refused). Returns the manifest written."""
    out = Path(out)
    check_model_out(out)
    blobs = {
        CONFIG: config.to_yaml().encode(),
        PREPROCESS: json.dumps(pre.to_json()).encode(),
        WEIGHTS: save_safetensors({k: v.contiguous() for k, v in tensors.items()}),
    }
    files = {name: FileEntry(sha256=hashlib.sha256(b).hexdigest(), bytes=len(b)) for name, b in blobs.items()}
    manifest = manifest.model_copy(update={"files": files})
    with atomic_dir(out) as tmp:
        for name, b in blobs.items():
            (tmp / name).write_bytes(b)
        (tmp / MANIFEST).write_text(manifest.model_dump_json(indent=2))
    return manifest


def read_artifact(model_dir: Path) -> Artifact:
    """Read and check a model directory (or the complete one a kill while it was replaced left set aside:
    ``committed``); any fault is one ``CheckpointError`` line naming the file."""
    model_dir = committed(Path(model_dir))
    if not (model_dir / MANIFEST).exists():
        raise CheckpointError(
            f"{model_dir}: not an exported model (no {MANIFEST}); create one with `recscale export RUN_DIR --out DIR`"
        )
    path = model_dir / MANIFEST
    try:
        manifest = Manifest.model_validate_json(read_regular_file(path, _CAPS[MANIFEST], KIND), strict=True)
    except ValidationError as e:
        raise _bad(
            path, f"is not a recscale model manifest ({one_line(format_validation_error(e))})"
        ) from None
    if set(manifest.files) != {CONFIG, PREPROCESS, WEIGHTS}:
        raise _bad(
            path, f"lists files {sorted(manifest.files)}, expected {sorted([CONFIG, PREPROCESS, WEIGHTS])}"
        )
    data = {name: _verified(model_dir / name, entry) for name, entry in manifest.files.items()}
    try:
        raw = load_yaml(data[CONFIG])
        if not isinstance(raw, dict):
            raise ConfigError("it is not a mapping")
        config = validate_config(raw)
    except (yaml.YAMLError, ConfigError) as e:
        raise _bad(model_dir / CONFIG, f"is not a valid run config ({one_line(e)})") from None
    try:
        pre = Preprocessor.from_json(json.loads(data[PREPROCESS]))
    except CheckpointError as e:
        raise CheckpointError(f"{model_dir / PREPROCESS}: {e}") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise _bad(model_dir / PREPROCESS, f"is not JSON ({one_line(e)})") from None
    try:
        tensors = load_safetensors(data[WEIGHTS])
    except (SafetensorError, ValueError) as e:
        raise _bad(model_dir / WEIGHTS, f"is not a safetensors file ({one_line(e)})") from None
    return Artifact(manifest, config, pre, tensors)


def _verified(path: Path, entry: FileEntry) -> bytes:
    return verified_bytes(path, entry, _CAPS[path.name], KIND, "export the model again (recscale export)")


def verified_bytes(path: Path, entry: FileEntry, cap: int, kind: str, fix: str) -> bytes:
    """The bytes of ``path``, checked against its manifest ``entry`` (size at most ``cap``, sha256);
    a fault is one ``CheckpointError`` line ending in ``fix``."""
    if entry.bytes > cap:
        raise CheckpointError(
            f"{path.parent / MANIFEST}: gives {path.name} {entry.bytes:,} bytes, more than recscale writes; {fix}"
        )
    try:  # a regular file of another size than the manifest gives: say so (read_regular_file, capped at that
        # size, would call it larger than anything recscale writes)
        st = os.lstat(path)
    except OSError:
        st = None  # missing or unreadable: read_regular_file says which
    if st is not None and stat.S_ISREG(st.st_mode) and st.st_size != entry.bytes:
        raise CheckpointError(
            f"{path}: {st.st_size:,} bytes where {MANIFEST} gives {entry.bytes:,}: the file was changed or "
            f"damaged after it was saved; {fix}"
        )
    data = read_regular_file(path, entry.bytes, kind)  # the size the manifest gives: a longer file is refused
    if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
        raise CheckpointError(
            f"{path}: its sha256 does not match {MANIFEST}: the file was changed or damaged after it was saved; {fix}"
        )
    return data


def _bad(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}; export the model again (recscale export)")


def artifact_bytes(model_dir: Path) -> dict[str, int]:
    """Bytes on disk of each file of a model directory."""
    return {p.name: p.stat().st_size for p in sorted(Path(model_dir).iterdir()) if p.is_file()}
