"""Data preparation for a run: fit the preprocessing on the training split, materialise each split.

A materialised split (``RUN/data/{split}/``) carries the fingerprint of its source file and of how it
was read and mapped; it is reused only while that fingerprint matches. The training split is fitted
and materialised in one pass. ``recscale data prepare`` writes the same files into a directory of
their own, which runs then read through ``data.prepared`` without writing to it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from recscale.config import DataConfig
from recscale.data.dataset import ArrayDataset, held_out, read_meta
from recscale.data.materialize import materialize
from recscale.data.preprocess import Preprocessor
from recscale.data.readers import ReadStats
from recscale.data.readers.base import data_files, unlabelled, unweighted
from recscale.data.schema import Schema
from recscale.data.sources import changed_files, open_split, source_files, source_fingerprint
from recscale.errors import RUN_DIR, CheckpointError, DataError, RecscaleError, StaleArtifactError
from recscale.io import remove_partial_writes


def _syn(data: DataConfig) -> Any:
    return data.synthetic.model_dump() if data.synthetic is not None else None


def _splits(data: DataConfig) -> list[tuple[str, str | None]]:
    """The (split, path) pairs a run uses: train, and valid and test when the config has them (synthetic
    data: when ``data.synthetic.rows`` has them; ``data.valid_fraction``: valid is rows of the training file)."""
    rows = data.synthetic.rows if data.format == "synthetic" and data.synthetic is not None else {}
    valid = data.train if data.valid_fraction is not None else data.valid
    return [
        (split, path)
        for split, path in (("train", data.train), ("valid", valid), ("test", data.test))
        if split == "train" or path is not None or split in rows
    ]


def _cut(data: DataConfig) -> dict[str, Any]:
    """What the fingerprints add for ``data.valid_fraction`` (nothing without it: older splits stay valid)."""
    return {} if data.valid_fraction is None else {"valid_fraction": data.valid_fraction}


def split_fingerprint(data: DataConfig, pre: Preprocessor, split: str, path: str | None) -> str:
    """What a materialised split is made of: the file's bytes, how it is read, the mapping."""
    extra = {"options": data.options, "pre": pre.digest(), "syn": _syn(data), **_cut(data)}
    return source_fingerprint(data.format, path, split, extra)


def _batches(data: DataConfig, schema: Schema, split: str, path: str | None, stats: ReadStats) -> Any:
    if data.valid_fraction is None or split not in ("train", "valid"):
        return open_split(
            data.format, path, split, schema, data.options, synthetic=data.synthetic,
            chunk_rows=data.chunk_rows, on_bad_row=data.on_bad_row, stats=stats,
        )  # fmt: skip
    return _held_rows(data, schema, split, stats)


def _held_rows(data: DataConfig, schema: Schema, split: str, stats: ReadStats) -> Iterator[pa.RecordBatch]:
    """The training file's rows of ``split`` under ``data.valid_fraction``: one file read as two splits."""
    fraction, held = data.valid_fraction, split == "valid"
    assert fraction is not None
    batches = open_split(
        data.format, data.train, split, schema, data.options, chunk_rows=data.chunk_rows,
        on_bad_row=data.on_bad_row, stats=stats,
        keep=lambda start, n: held_out(n, fraction, salt=2, start=start) == held,
    )  # fmt: skip
    rows = 0
    for batch in batches:
        rows += batch.num_rows
        yield batch
    if held:  # the file's bad rows were dropped by both reads: the training split's count says how many
        stats.skipped, stats.examples = 0, []
    if not rows:
        raise DataError(
            f"data.valid_fraction={fraction} leaves no row of data.train ({data.train}) for the {split} split; "
            f"give a {'larger' if held else 'smaller'} fraction"
        )


def prepare_split(
    data: DataConfig,
    pre: Preprocessor,
    split: str,
    path: str | None,
    out_dir: Path,
    progress: bool,
    positions: bool = False,
    labelled: bool = True,
    weighted: bool = True,
) -> tuple[ArrayDataset, ReadStats]:
    """Materialise one split under ``out_dir`` unless an identical one is already there (``positions``:
    read it anew, the stats keeping each kept row's position in the file; not ``labelled``: read anew
    from a file without the label column, every label 0, nor row weights; not ``weighted``: read anew
    without the schema's row-weight column, every row weighing 1)."""
    fp = split_fingerprint(data, pre, split, path)
    meta = read_meta(out_dir)
    schema = pre.schema if labelled and weighted else unweighted(pre.schema)
    fresh = positions or not labelled or schema.weight != pre.schema.weight
    if not fresh and meta is not None and meta.get("fingerprint") == fp and not _dropped_against(data, meta):
        return ArrayDataset(out_dir), stats_of(meta)
    stats = ReadStats(positions=[] if positions else None)
    batches = _batches(data, schema if labelled else unlabelled(schema), split, path, stats)
    materialize(
        batches, schema, out_dir, pre=pre, fingerprint=lambda _: fp, progress=progress, stats=stats,
        source=_source(data, path),
    )  # fmt: skip
    return ArrayDataset(out_dir), stats


def _source(data: DataConfig, path: str | None) -> dict[str, list[int]] | None:
    return source_files(data.format, path) if path is not None and data.format != "synthetic" else None


def _changed_since(data: DataConfig, path: str | None, split_dir: Path) -> str | None:
    """Which files of ``path`` changed since the split in ``split_dir`` was written from them, in words; None
    where that split did not list its files (written by an older version) or none changed."""
    before = (read_meta(split_dir) or {}).get("source")
    now = _source(data, path)
    return changed_files(before, now) if isinstance(before, dict) and now is not None else None


def stats_of(meta: dict[str, Any]) -> ReadStats:
    """What the read of a materialised split counted, as its meta.json keeps it (older splits: nothing)."""
    read = meta.get("read") or {}
    return ReadStats(
        rows=int(meta.get("rows", 0)),
        skipped=int(read.get("skipped", 0)),
        examples=list(read.get("examples", [])),
        truncated=dict(read.get("truncated", {})),
    )


def _dropped_against(data: DataConfig, meta: dict[str, Any]) -> int:
    """Bad rows a materialised split dropped (it was read with on_bad_row: skip) that this data section,
    with ``on_bad_row: error``, does not allow to drop; 0 when the split may be used."""
    return stats_of(meta).skipped if data.on_bad_row == "error" else 0


def fit_train_split(
    data: DataConfig, out_dir: Path, progress: bool
) -> tuple[Preprocessor, ArrayDataset, ReadStats]:
    """Fit the preprocessing on the training split while materialising it under ``out_dir``."""
    stats = ReadStats()
    pre = materialize(
        _batches(data, data.schema, "train", data.train, stats), data.schema, out_dir,
        fingerprint=lambda p: split_fingerprint(data, p, "train", data.train), progress=progress, stats=stats,
        source=_source(data, data.train),
    )  # fmt: skip
    return pre, ArrayDataset(out_dir), stats


def train_fingerprint(data: DataConfig) -> str:
    """What the preprocessing is fitted from: the training file's bytes, its reading, the schema."""
    return source_fingerprint(
        data.format, data.train, "train",
        {"options": data.options, "schema": data.schema.model_dump(mode="json"), "syn": _syn(data), **_cut(data)},
    )  # fmt: skip


def prepare_run_data(
    data: DataConfig,
    run_dir: Path,
    resume: bool,
    main: bool,
    progress: bool,
    given: Preprocessor | None = None,
) -> tuple[Preprocessor, dict[str, ArrayDataset], dict[str, ReadStats]]:
    """A run's preprocessing and materialised splits (train; valid and test when the config has them;
    with ``data.report_fraction``, valid's held-out rows as "report" and the rest as valid).

    With ``data.prepared`` they are read from that directory (see ``use_prepared``). Else the run's
    ``preprocess.json`` is reused if it was fitted on the same training data; else it is fitted
    afresh (a resumed run refuses: its tables index that vocabulary), or, for a new run, taken as
    ``given`` (the preprocessing of the run ``train.init_from`` names, whose tables index its vocabularies). It is written
    last, by rank 0 (``main``), so a failed preparation never leaves an artifact that a later run would take
    for finished work."""
    pre_path = run_dir / "preprocess.json"
    fingerprint = train_fingerprint(data)
    if data.prepared is not None:
        if given is not None:
            raise RecscaleError(
                f"data.prepared {data.prepared} holds vocabularies fitted on its own data, and train.init_from "
                "maps the data with its run's: drop data.prepared (the run prepares its data with them)"
            )
        pre, splits, stats = use_prepared(data, Path(data.prepared), fingerprint)
        if resume:
            trained = Preprocessor.load(pre_path)
            if trained.digest() != pre.digest():
                raise RecscaleError(
                    f"data.prepared {data.prepared}: its vocabularies are not the ones this run was trained "
                    f"with (was it prepared again?); resume with that preparation, or start a new run with another {RUN_DIR}"
                )
        elif main:
            pre.save(pre_path, fingerprint=fingerprint)  # the run directory keeps its own copy, for eval
        return pre, _run_splits(data, splits), stats
    if main:  # a split whose write was killed left its temporary directory (as large as the split) behind
        remove_partial_writes(run_dir / "data")
    fitted = False
    try:
        pre = Preprocessor.load(pre_path, expect_fingerprint=fingerprint)
    except StaleArtifactError as e:
        if resume:
            changed = _changed_since(data, data.train, run_dir / "data" / "train")
            if changed is not None:
                raise RecscaleError(
                    f"data.train {data.train}: {changed} since this run read it; resume with the data it started "
                    f"with, or train a new run on the new data from this one's model (train.init_from={run_dir})"
                ) from None
            raise RecscaleError(
                f"{pre_path}: the training data is not what this run was prepared from ({e}); "
                f"resume with the same data, or start a new run with another {RUN_DIR}"
            ) from None
        fitted = True  # left by a run that failed, or fitted on other data: fit afresh
    except CheckpointError:
        if pre_path.exists():
            raise
        fitted = True
    splits, stats = {}, {}
    # A new run from another's weights maps its data with that run's vocabularies, whatever an attempt left.
    if given is not None and not resume and (fitted or pre.digest() != given.digest()):
        pre, fitted, save = given, False, True
    else:
        save = fitted
    if fitted:
        pre, splits["train"], stats["train"] = fit_train_split(data, run_dir / "data" / "train", progress)
    for split, path in _splits(data):
        if resume and split == "valid":
            _check_valid_unchanged(data, pre, path, run_dir / "data" / split)
        if split not in splits:
            splits[split], stats[split] = prepare_split(
                data, pre, split, path, run_dir / "data" / split, progress
            )
    if save and main:
        pre.save(pre_path, fingerprint=fingerprint)
    if main:
        _warn_if_splits_share_files(data)
    return pre, _run_splits(data, splits), stats


def _warn_if_splits_share_files(data: DataConfig) -> None:
    """Warn where data.valid or data.test reads a file data.train reads too (``train: day_*`` beside ``valid:
    day_23``, or one file for both): its metrics, and early stopping on them, are then of rows the model trained on."""
    if data.format in ("synthetic", "movielens") or data.train is None:  # MovieLens splits one file by time
        return
    train = {f.resolve() for f in data_files(data.train, data.format)}
    for split, path in (("valid", data.valid), ("test", data.test)):
        shared = (
            [f for f in data_files(path, data.format) if f.resolve() in train] if path is not None else []
        )
        if shared:
            more = f" and {len(shared) - 1} more" if len(shared) > 1 else ""
            warnings.warn(
                f"data.{split} reads {shared[0]}{more}, which data.train reads too: the {split} metrics are of rows "
                f"the model trained on; give data.{split} files of its own",
                stacklevel=2,
            )


def _check_valid_unchanged(data: DataConfig, pre: Preprocessor, path: str | None, split_dir: Path) -> None:
    """A resumed run compares each evaluation with its best so far, measured on the valid split it started with:
    a file changed since (same path, other bytes) would be read anew and the comparisons mixed."""
    meta = read_meta(split_dir)
    if meta is not None and meta.get("fingerprint") != split_fingerprint(data, pre, "valid", path):
        what = _changed_since(data, path, split_dir) or "the file changed"
        raise RecscaleError(
            f"data.valid {path}: {what} since this run read it (its best so far was measured on the old "
            f"data); resume with the data it started with, or start a new run with another {RUN_DIR}"
        )


def _run_splits(data: DataConfig, splits: dict[str, ArrayDataset]) -> dict[str, ArrayDataset]:
    """The splits a run trains and scores on: valid's report half held out (``data.report_fraction``), the
    training split's negatives downsampled (``data.negative_sampling_rate``)."""
    if data.negative_sampling_rate is not None:
        train = splits["train"]
        kept = (train.labels() > 0) | held_out(len(train), data.negative_sampling_rate, salt=1)
        if not kept.any():
            raise DataError(
                f"data.negative_sampling_rate={data.negative_sampling_rate} keeps no row of the training "
                f"split's {len(train)} (it has no positive): give a larger rate"
            )
        splits["train"] = train.subset(kept)
    if data.report_fraction is not None and "valid" in splits:  # valid keeps the selection rows
        rows = len(splits["valid"])
        splits["valid"], splits["report"] = splits["valid"].hold_out(data.report_fraction)
        # An empty half has nothing to score: evaluation crashed on it after the training data was read.
        for half, left, fix in (
            ("the report", splits["report"], "larger"),
            ("selection", splits["valid"], "smaller"),
        ):
            if len(left) == 0:
                raise DataError(
                    f"data.report_fraction={data.report_fraction} leaves no row of the valid split's {rows} "
                    f"for {half}; give a valid split with more rows, or a {fix} fraction"
                )
    _refuse_weightless(data, splits)
    return splits


def _refuse_weightless(data: DataConfig, splits: dict[str, ArrayDataset]) -> None:
    """A split whose rows all weigh 0 (``schema.weight``) trains nothing (a loss of 0 at every step) or
    scores NaN (each metric's weighted mean divides by the weights' sum): refused before training."""
    column = data.schema_.weight if data.schema_ is not None else None
    for split, ds in splits.items():
        weights = ds.weights()
        if column is None or weights is None or len(ds) == 0 or weights.sum(dtype=np.float64) > 0:
            continue
        where = f"data.{split}"
        if split == "train" and data.negative_sampling_rate is not None:
            where += " (the rows data.negative_sampling_rate kept)"
        elif split == "report":
            where = f"the valid rows data.report_fraction={data.report_fraction} holds out"
        why = "nothing to train on" if split == "train" else "its weighted metrics are undefined"
        raise DataError(
            f"{where}: all {len(ds)} rows weigh 0 in column '{column}' (data.schema.weight): {why}; "
            "give rows of weight above 0"
        )


def use_prepared(
    data: DataConfig, prepared: Path, fingerprint: str
) -> tuple[Preprocessor, dict[str, ArrayDataset], dict[str, ReadStats]]:
    """The preprocessing and splits `recscale data prepare` wrote into ``prepared``, checked against
    this run's data section; nothing there is written. One that does not match is refused."""
    where = f"data.prepared {prepared}"
    again = f"run `recscale data prepare CONFIG --out {prepared}` with this run's data section, or drop data.prepared"
    if not (prepared / "preprocess.json").is_file():
        raise RecscaleError(f"{where} holds no preprocess.json: not a prepared data directory; {again}")
    try:
        pre = Preprocessor.load(prepared / "preprocess.json", expect_fingerprint=fingerprint)
    except StaleArtifactError:
        raise RecscaleError(
            f"{where} was prepared from other training data or settings (format, options, schema, valid_fraction); {again}"
        ) from None
    splits, stats = {}, {}
    for split, path in _splits(data):
        meta = read_meta(prepared / "data" / split)
        if meta is None or meta.get("fingerprint") != split_fingerprint(data, pre, split, path):
            raise RecscaleError(
                f"{where}: its {split} split is missing or was prepared from another file than data.{split}; {again}"
            )
        dropped = _dropped_against(data, meta)
        if dropped:
            first = stats_of(meta).examples[:1]
            raise RecscaleError(
                f"{where}: its {split} split was prepared with data.on_bad_row: skip, which dropped {dropped} bad rows"
                f"{f' (first: {first[0]})' if first else ''}, but this run sets data.on_bad_row: error; "
                f"set data.on_bad_row=skip to train without them, or {again}"
            )
        splits[split] = ArrayDataset(prepared / "data" / split)
        stats[split] = stats_of(meta)
    return pre, splits, stats
