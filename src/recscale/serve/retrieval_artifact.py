"""A ``retrieve -> rank`` pipeline on disk: ``manifest.json`` (format, version, the ``RetrievalSpec``,
sha256 + size of the weights) and ``weights.safetensors`` (its state dict: towers, index rows, Bloom
bits, ranker). Written atomically, manifest last; read as data only (JSON, safetensors, nothing
unpickled), the weights checked against the manifest before they are parsed, the module rebuilt from
the spec and loaded strictly.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from recscale.config import format_validation_error
from recscale.errors import CheckpointError
from recscale.io import atomic_dir
from recscale.retrieval.pipeline import RetrievalSpec, RetrieveRank, build
from recscale.serve.artifact import MANIFEST, WEIGHTS, FileEntry, verified_bytes
from recscale.train.dcp_safety import one_line, read_regular_file

KIND = "retrieval model"
FIX = "save the retrieval model again"


class RetrievalManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["recscale-retrieval"] = "recscale-retrieval"
    version: Literal[1] = 1
    spec: RetrievalSpec
    weights: FileEntry


def save_retrieval(out: Path, model: RetrieveRank, spec: RetrievalSpec) -> None:
    """Write ``model`` (built to ``spec``) into the new or replaced directory ``out``."""
    blob = save_safetensors({k: v.contiguous() for k, v in model.state_dict().items()})
    manifest = RetrievalManifest(
        spec=spec, weights=FileEntry(sha256=hashlib.sha256(blob).hexdigest(), bytes=len(blob))
    )
    with atomic_dir(Path(out)) as tmp:
        (tmp / WEIGHTS).write_bytes(blob)
        (tmp / MANIFEST).write_text(manifest.model_dump_json(indent=2))


def load_retrieval(model_dir: Path) -> RetrieveRank:
    """Read, check and rebuild a saved pipeline in eval mode; any fault is one ``CheckpointError`` line."""
    path = Path(model_dir) / MANIFEST
    try:
        manifest = RetrievalManifest.model_validate_json(read_regular_file(path, 1 << 20, KIND))
    except ValidationError as e:
        raise CheckpointError(
            f"{path}: is not a recscale retrieval manifest ({one_line(format_validation_error(e))}); {FIX}"
        ) from None
    data = verified_bytes(path.parent / WEIGHTS, manifest.weights, 64 << 30, KIND, FIX)
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError) as e:
        raise CheckpointError(
            f"{path.parent / WEIGHTS}: is not a safetensors file ({one_line(e)}); {FIX}"
        ) from None
    try:
        model = build(manifest.spec)
        model.load_state_dict(tensors, strict=True)
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(
            f"{path.parent / WEIGHTS}: does not fit its spec ({one_line(e)}); {FIX}"
        ) from None
    return model.eval()
