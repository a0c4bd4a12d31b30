"""Data preparation for a run: fit the preprocessing on the training split, materialise each split.

A materialised split (``RUN/data/{split}/``) carries the fingerprint of its source file and of how it
was read and mapped; it is reused only while that fingerprint matches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recscale.config import DataConfig
from recscale.data.dataset import ArrayDataset, materialize, read_meta
from recscale.data.preprocess import Preprocessor
from recscale.data.readers import ReadStats
from recscale.data.sources import open_split, source_fingerprint
from recscale.errors import CheckpointError, RecscaleError, StaleArtifactError


def _syn(data: DataConfig) -> Any:
    return data.synthetic.model_dump() if data.synthetic is not None else None


def prepare_split(
    data: DataConfig, pre: Preprocessor, split: str, path: str | None, out_dir: Path, progress: bool
) -> tuple[ArrayDataset, ReadStats]:
    """Materialise one split under ``out_dir`` unless an identical one is already there."""
    fp = source_fingerprint(
        data.format, path, split, {"options": data.options, "pre": pre.to_json(), "syn": _syn(data)}
    )
    stats = ReadStats()
    meta = read_meta(out_dir)
    if meta is None or meta.get("fingerprint") != fp:
        batches = open_split(
            data.format, path, split, pre.schema, data.options, synthetic=data.synthetic,
            chunk_rows=data.chunk_rows, on_bad_row=data.on_bad_row, stats=stats,
        )  # fmt: skip
        materialize(batches, pre, out_dir, fingerprint=fp, progress=progress)
    return ArrayDataset(out_dir), stats


def train_fingerprint(data: DataConfig) -> str:
    """What the preprocessing is fitted from: the training file's bytes, its reading, the schema."""
    return source_fingerprint(
        data.format, data.train, "train",
        {"options": data.options, "schema": data.schema.model_dump(mode="json"), "syn": _syn(data)},
    )  # fmt: skip


def fit_preprocessor(data: DataConfig) -> Preprocessor:
    """Fit on the training split; its bad rows are counted when the split is materialised."""
    batches = open_split(
        data.format, data.train, "train", data.schema, data.options, synthetic=data.synthetic,
        chunk_rows=data.chunk_rows, on_bad_row=data.on_bad_row,
    )  # fmt: skip
    return Preprocessor.fit(batches, data.schema)


def prepare_run_data(
    data: DataConfig, run_dir: Path, resume: bool, main: bool, progress: bool
) -> tuple[Preprocessor, dict[str, ArrayDataset], dict[str, ReadStats]]:
    """A run's preprocessing and materialised splits (train; valid and test when the config has them;
    with ``data.report_fraction``, valid's held-out rows as "report" and the rest as valid).

    The run's ``preprocess.json`` is reused if it was fitted on the same training data; else it is
    fitted afresh (a resumed run refuses: its tables index that vocabulary). It is written last, by
    rank 0 (``main``), so a failed preparation never leaves an artifact that a later run would take
    for finished work."""
    pre_path = run_dir / "preprocess.json"
    fingerprint = train_fingerprint(data)
    fitted = False
    try:
        pre = Preprocessor.load(pre_path, expect_fingerprint=fingerprint)
    except StaleArtifactError as e:
        if resume:
            raise RecscaleError(
                f"{pre_path}: the training data is not what this run was prepared from ({e}); "
                "resume with the same data, or start a new run with another --out"
            ) from None
        fitted = True  # left by a run that failed, or fitted on other data: fit afresh
    except CheckpointError:
        if pre_path.exists():
            raise
        fitted = True
    if fitted:
        pre = fit_preprocessor(data)
    splits, stats = {}, {}
    for split, path in (("train", data.train), ("valid", data.valid), ("test", data.test)):
        if split == "train" or path is not None or data.format == "synthetic":
            splits[split], stats[split] = prepare_split(
                data, pre, split, path, run_dir / "data" / split, progress
            )
    if data.report_fraction is not None and "valid" in splits:  # valid keeps the selection rows
        splits["valid"], splits["report"] = splits["valid"].hold_out(data.report_fraction)
    if fitted and main:
        pre.save(pre_path, fingerprint=fingerprint)
    return pre, splits, stats
