"""A ``retrieve -> rank`` pipeline on disk: ``manifest.json`` (format, version, the ``RetrievalSpec``,
sha256 + size of each file) and ``weights.safetensors`` (its state dict: towers, index rows, Bloom
bits, ranker). Written atomically, manifest last; read as data only (JSON, safetensors, nothing
unpickled), each file checked against the manifest before it is parsed, the module rebuilt from the
spec and loaded strictly.

With a ``Catalog`` (what ``recscale retrieval build`` writes) the directory also answers raw ids: the
users' feature rows are more tensors of the weights file (``catalog.users.<i>``) and ``ids.json`` holds
the raw user and item ids of the table rows.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from recscale.config import format_validation_error
from recscale.errors import CheckpointError, DataError
from recscale.io import atomic_dir, committed
from recscale.retrieval.pipeline import RetrievalSpec, RetrieveRank, build
from recscale.serve.artifact import MANIFEST, WEIGHTS, FileEntry, check_out, manifest_format, verified_bytes
from recscale.train.dcp_safety import one_line, read_regular_file

KIND = "retrieval model"
FIX = "save the retrieval model again"
IDS = "ids.json"
_USERS = "catalog.users."


class RetrievalManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["recscale-retrieval"] = "recscale-retrieval"
    version: Literal[1] = 1
    spec: RetrievalSpec
    weights: FileEntry
    ids: FileEntry | None = None  # with a catalog


class _Ids(BaseModel):
    model_config = ConfigDict(extra="forbid")

    users: list[str]
    items: list[str]


@dataclass
class Catalog:
    """Raw ids of the table rows, and each user's feature row (the user tower's input)."""

    user_keys: list[str]
    item_keys: list[str]
    user_features: list[torch.Tensor]  # one (n_users, L_f) id tensor per user feature

    @functools.cached_property
    def user_row(self) -> dict[str, int]:
        """Raw user id -> table row (built once, not per query)."""
        return {k: r for r, k in enumerate(self.user_keys)}


def _entry(blob: bytes) -> FileEntry:
    return FileEntry(sha256=hashlib.sha256(blob).hexdigest(), bytes=len(blob))


def check_retrieval_out(out: Path) -> None:
    """``out`` may receive a retrieval model (``check_out``)."""
    check_out(out, "recscale-retrieval", "a retrieval model")


def save_retrieval(
    out: Path, model: RetrieveRank, spec: RetrievalSpec, catalog: Catalog | None = None
) -> None:
    """Write ``model`` (built to ``spec``), and ``catalog`` if given, into the new or replaced directory
    ``out`` (``check_retrieval_out``)."""
    check_retrieval_out(out)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    ids = None
    if catalog is not None:
        tensors |= {f"{_USERS}{i}": t.contiguous() for i, t in enumerate(catalog.user_features)}
        ids = _Ids(users=catalog.user_keys, items=catalog.item_keys).model_dump_json().encode()
    blob = save_safetensors(tensors)
    manifest = RetrievalManifest(spec=spec, weights=_entry(blob), ids=None if ids is None else _entry(ids))
    with atomic_dir(Path(out)) as tmp:
        (tmp / WEIGHTS).write_bytes(blob)
        if ids is not None:
            (tmp / IDS).write_bytes(ids)
        (tmp / MANIFEST).write_text(manifest.model_dump_json(indent=2))


def is_retrieval_dir(model_dir: Path) -> bool:
    """Whether ``model_dir``'s manifest names the retrieval format (anything unreadable: False)."""
    return manifest_format(committed(Path(model_dir)) / MANIFEST) == "recscale-retrieval"


def load_retrieval(model_dir: Path) -> RetrieveRank:
    """Read, check and rebuild a saved pipeline in eval mode; any fault is one ``CheckpointError`` line."""
    return _load(Path(model_dir))[0]


def load_retriever(model_dir: Path) -> tuple[RetrieveRank, Catalog]:
    """``load_retrieval`` and the directory's catalog (raw ids); one line if it has none."""
    model, catalog = _load(Path(model_dir))
    if catalog is None:
        raise CheckpointError(
            f"{Path(model_dir) / MANIFEST}: this retrieval model has no catalog of raw ids; build it with "
            "recscale retrieval build"
        )
    return model, catalog


def _load(model_dir: Path) -> tuple[RetrieveRank, Catalog | None]:
    # A kill between atomic_dir's two renames (a rebuild into the same --out) left the complete old
    # model set aside as .NAME.old and nothing at NAME: read that, as read_artifact does.
    model_dir = committed(model_dir)
    path = model_dir / MANIFEST
    if not os.path.lexists(path):
        raise CheckpointError(
            f"{model_dir}: not a retrieval model (no {MANIFEST}); build one with "
            "`recscale retrieval build DATA --out DIR`"
        )
    if manifest_format(path) == "recscale-model":
        raise CheckpointError(
            f"{model_dir}: is an exported scoring model, not a retrieval model; serve it with `recscale serve` "
            "(POST /score), or build a retrieval model with `recscale retrieval build`"
        )
    try:
        # strict: a hand-edited `"k": true` or `"dim": "8"` is refused, not read as 1 and 8.
        manifest = RetrievalManifest.model_validate_json(read_regular_file(path, 1 << 20, KIND), strict=True)
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
    if manifest.spec.elements() > len(data):  # checked before build() allocates what the spec asks
        raise CheckpointError(
            f"{path}: its spec gives {manifest.spec.elements():,} weights, more than {WEIGHTS} holds "
            f"({len(data):,} bytes); {FIX}"
        )
    users = [
        tensors.pop(f"{_USERS}{i}") for i in range(len(manifest.spec.user_vocab)) if f"{_USERS}{i}" in tensors
    ]
    try:
        model = build(manifest.spec)
        model.load_state_dict(tensors, strict=True)
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(
            f"{path.parent / WEIGHTS}: does not fit its spec ({one_line(e)}); {FIX}"
        ) from None
    if manifest.ids is None:
        return model.eval(), None
    raw = verified_bytes(path.parent / IDS, manifest.ids, 1 << 30, KIND, FIX)
    try:
        ids = _Ids.model_validate_json(raw, strict=True)
    except ValidationError as e:
        raise CheckpointError(f"{path.parent / IDS}: {one_line(format_validation_error(e))}; {FIX}") from None
    n_users = len(ids.users)
    if (
        len(users) != len(manifest.spec.user_vocab)
        or any(t.dtype != torch.long or t.dim() != 2 or t.shape[0] != n_users for t in users)
        or any(
            int(t.min()) < 0 or int(t.max()) >= v
            for t, v in zip(users, manifest.spec.user_vocab, strict=True)
        )
        or len(ids.items) != manifest.spec.n_items
    ):
        raise CheckpointError(f"{path.parent}: its catalog does not fit its spec; {FIX}")
    return model.eval(), Catalog(ids.users, ids.items, users)


def recommend(model: RetrieveRank, catalog: Catalog, users: list[str]) -> dict[str, list[dict[str, object]]]:
    """Raw user id -> its top items, best first: ``{"item": raw id, "logit": ranker logit}`` each (fewer
    than k when fewer unseen candidates were found). An unknown user is a one-line ``DataError``."""
    row = catalog.user_row
    unknown = [u for u in users if u not in row]
    if unknown:
        raise DataError(
            f"user {one_line(repr(unknown[0]), 60)} is not in the model's catalog ({len(row):,} users, raw ids "
            "as in the training data)"
        )
    rows = torch.tensor([row[u] for u in users], dtype=torch.long)
    logits, ids = model([f[rows] for f in catalog.user_features], rows)
    return {
        u: [
            {"item": catalog.item_keys[i], "logit": round(x, 4)}
            for x, i in zip(lg.tolist(), ix.tolist(), strict=True)
            if i >= 0
        ]
        for u, lg, ix in zip(users, logits, ids, strict=True)
    }
