"""A run directory read back: its config, its preprocessing, its trained model; ``--resume`` checks.

Every file is parsed as data (YAML safe_load, JSON, DCP tensors through ``checkpoint``'s safe
reader) and validated; a bad one is a one-line ``CheckpointError`` naming it.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from recscale.config import (
    DataConfig,
    DistributedConfig,
    ModelConfig,
    RunConfig,
    load_config,
    validate_config,
)
from recscale.config_files import apply_overrides, read_yaml_mapping
from recscale.data.batch import Batch
from recscale.data.dataset import ArrayDataset, read_meta
from recscale.data.preprocess import Preprocessor
from recscale.data.readers import NoRows, holds_column
from recscale.data.readers.base import SKIP_HINT, OnBadRow, ReadStats, data_files, names_data, position_unit
from recscale.data.schema import Schema
from recscale.distributed.dmt.transform import LocalDMT, local_key
from recscale.distributed.env import init_distributed, own_group
from recscale.distributed.topology import Topology
from recscale.errors import RESUME, RUN_DIR, CheckpointError, ConfigError, DataError, RecscaleError
from recscale.io import atomic_write_bytes, check_output, committed, scratch_dir
from recscale.models.base import RecModel
from recscale.models.embedding import EmbeddingLayer
from recscale.models.registry import build_model
from recscale.train.build import Built, build, feature_set
from recscale.train.checkpoint import list_checkpoints, load_checkpoint, saved_keys, saved_step
from recscale.train.data import prepare_split, stats_of
from recscale.train.dcp_safety import MANIFEST, manifest_format
from recscale.train.evaluate import eval_batch_size, predict, scored


def flat_keys(d: Any, prefix: str = "") -> dict[str, Any]:
    """``{"train": {"epochs": 3}}`` -> ``{"train.epochs": 3}`` (lists are values)."""
    if not isinstance(d, dict) or not d:
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out |= flat_keys(v, f"{prefix}.{k}" if prefix else str(k))
    return out


# What a resumed run may change: how long it trains, how often it logs/evaluates/keeps, how it
# reports, the wire's precision (a run of several ranks resumed on one process, which sends nothing
# between ranks, must leave qcomms fp32), which rank trains which sample of a step (distributed.balance:
# every sample is still trained once per step, as when the run resumes on another number of ranks); not
# anything that shapes the model, its state or the data it has seen.
RESUMABLE_KEYS = (
    "train.epochs", "train.max_steps", "train.eval_every", "train.log_every", "train.progress",
    "train.keep_checkpoints", "train.early_stopping.patience", "data.test", "data.num_workers",
    "distributed.timeout_s", "distributed.count_bytes", "distributed.qcomms.forward",
    "distributed.qcomms.backward", "distributed.qcomms.dense", "distributed.balance",
)  # fmt: skip


def resume_changes(saved: RunConfig, new: RunConfig) -> tuple[list[str], list[str]]:
    """(allowed, refused) dotted keys whose values differ between a run's config and a resume's."""
    a = flat_keys(saved.model_dump(mode="json", by_alias=True))
    b = flat_keys(new.model_dump(mode="json", by_alias=True))
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    allowed = [k for k in changed if k in RESUMABLE_KEYS]
    return allowed, [k for k in changed if k not in RESUMABLE_KEYS]


_ARTIFACTS = {"recscale-model": "an exported model", "recscale-retrieval": "a retrieval model"}


def refuse_artifact(run_dir: Path, fix: str) -> None:
    """One line ending in ``fix`` if ``run_dir`` is a model directory (``recscale export``, ``retrieval
    build``) rather than a run."""
    kind = _ARTIFACTS.get(str(manifest_format(Path(run_dir) / MANIFEST)))
    if kind is not None:
        raise CheckpointError(f"{run_dir}: is {kind}; {fix}")


def refuse_inside_data(out: Path, data: DataConfig, fix: str) -> None:
    """One line ending in ``fix`` if ``out`` (a directory a command writes) is inside a split's folder of files,
    or where a split's glob pattern would match files written in it (a ``**`` pattern: anywhere under its
    fixed root; another: the run's own top-level files): the split would read them as its parts, or refuse
    the folder holding a folder."""
    for split in ("train", "valid", "test"):
        path = getattr(data, split)
        if path is None or data.format == "movielens":
            continue
        if Path(path).is_dir():
            if Path(path).resolve() in [out.resolve(), *out.resolve().parents]:
                raise RecscaleError(f"{out} is inside data.{split} {path}, whose files are the split; {fix}")
        elif not Path(path).exists() and glob.has_magic(path) and _pattern_reaches(Path(path), out):
            raise RecscaleError(f"{out}: data.{split} {path} would match files written there as parts; {fix}")


def _pattern_reaches(pattern: Path, out: Path) -> bool:
    """Whether files a run writes in ``out`` (config.yaml, report.json, ... and below) can match ``pattern``."""
    pattern, out = pattern.absolute(), out.absolute()
    if "**" in pattern.parts:  # recursive: any file under the pattern's fixed root
        root = Path(*pattern.parts[: next(i for i, p in enumerate(pattern.parts) if glob.has_magic(p))])
        return root.resolve() in [out.resolve(), *out.resolve().parents]
    own = ("config.yaml", "report.json", "metrics.jsonl", "preprocess.json")
    return any(out.joinpath(name).match(str(pattern)) for name in own)


def run_config(run_dir: Path) -> RunConfig:
    """The resolved config a run directory was trained with."""
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.yaml"
    # An export holds a config.yaml too, but no checkpoint: it read as "no complete checkpoint; train the run".
    refuse_artifact(run_dir, "not a run directory: give a run's (what `recscale train --out` wrote)")
    if not cfg_path.is_file():
        raise CheckpointError(f"{run_dir}: not a recscale run directory (no config.yaml)")
    try:
        return validate_config(read_yaml_mapping(cfg_path, "a run's config.yaml"))
    except ConfigError as e:
        raise CheckpointError(
            f"{cfg_path} is corrupt or was edited by hand ({e}); restore it or train a new run"
        ) from None


def load_run(run_dir: Path) -> tuple[RunConfig, Preprocessor]:
    """The resolved config and preprocessing artifact of a finished or running run."""
    return run_config(run_dir), Preprocessor.load(Path(run_dir) / "preprocess.json")


@dataclass
class InitFrom:
    """What ``train.init_from`` starts a run from: the run's preprocessing and its kept checkpoint."""

    run_dir: Path
    pre: Preprocessor
    checkpoint: Path

    def report(self, train: ArrayDataset) -> dict[str, Any]:
        """report.json's ``init_from``: the run, the checkpoint and its step, and the share of each sparse
        field's ids in ``train`` (the new training split) that the run's vocabularies do not hold."""
        return {
            "run": str(self.run_dir),
            "checkpoint": str(self.checkpoint),
            "step": saved_step(self.checkpoint),
            "oov_share": {k: round(v, 6) for k, v in train.oov_shares().items()},
        }


def init_from(cfg: RunConfig, out: Path) -> InitFrom:
    """The run ``cfg.train.init_from`` names, checked to hold a checkpoint of the model ``cfg`` builds, with
    the features ``cfg`` reads; each fault is one line."""
    assert cfg.train.init_from is not None
    src = Path(cfg.train.init_from)
    where = f"train.init_from {src}"
    if src.resolve() == Path(out).resolve():
        raise ConfigError(
            f"{where} is this run's own directory; continue it with `recscale train --resume --out {out}`, "
            "or start the new run in another --out"
        )
    try:
        old, pre = load_run(src)
    except CheckpointError as e:
        raise RecscaleError(f"train.init_from: {e}") from None
    if old.dmt is not None or cfg.dmt is not None:
        which = "is a DMT run" if old.dmt is not None else "and this run is DMT"
        raise ConfigError(f"{where} {which}: a warm start takes flat runs only; drop train.init_from")
    for what, had, has, why in (
        ("model", _model_spec(old.model), _model_spec(cfg.model), "its weights have that model's shapes"),
        ("data.schema", pre.schema.model_dump(mode="json"), cfg.data.schema.model_dump(mode="json"),
         "its tables index those features' vocabularies"),
    ):  # fmt: skip
        if had != has:
            key, was, now = _first_difference(had, has)
            raise ConfigError(
                f"{where} trained with {what}{key} {was!r} and this run sets {now!r}; a run starts from another's "
                f"weights with its {what} ({why}): give that run's {what}"
            )
    best = committed(src / "best")
    ckpts = list_checkpoints(src / "ckpt")
    checkpoint = best if (best / ".metadata").is_file() else (ckpts[-1] if ckpts else None)
    if checkpoint is None:
        raise RecscaleError(f"{where} holds no complete checkpoint to start from; train that run first")
    return InitFrom(src, pre, checkpoint)


def _model_spec(model: ModelConfig) -> dict[str, Any]:
    """What builds a model's weights: its name, embedding section and parameters, defaults resolved (a key
    left at its default equals the same value given); ``model.quant`` left out (it rounds GEMM inputs and
    holds no weights: a warm start may train a full-precision run's model quantized)."""
    return {
        "name": model.name,
        "embedding": model.embedding.model_dump(mode="json"),
        **model.params.model_dump(mode="json"),
    }


def _first_difference(a: Any, b: Any, key: str = "") -> tuple[str, Any, Any]:
    """(dotted key, a's value, b's value) of the first place two nested dicts differ (lists of unequal length:
    their items' names)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in [*a, *(k for k in b if k not in a)]:
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{key}.{k}")
    if isinstance(a, list) and isinstance(b, list):
        if len(a) == len(b):
            i = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            return _first_difference(a[i], b[i], f"{key}[{i}]")

        def names(items: list) -> list:  # a schema's features by name, not by every key they hold
            return [x.get("name", x) if isinstance(x, dict) else x for x in items]

        return key, names(a), names(b)
    return key, a, b


def resume_config(run_dir: Path, config: str | None, overrides: list[str]) -> RunConfig:
    """The config a ``--resume`` continues with: the run's own (or ``config``), with ``overrides``;
    refused, before any file is touched, if it changes more than the run may change when resumed."""
    saved = _resumable(run_dir)
    if config is None:
        cfg = validate_config(apply_overrides(saved.model_dump(mode="json", by_alias=True), overrides))
    else:
        cfg = load_config(config, overrides)
    _refuse_changes(run_dir, saved, cfg)
    _check_data_found(cfg.data)
    return cfg


def _check_data_found(data: DataConfig) -> None:
    """A resume reads its training and valid files again, at the paths it may not change: one not found is
    restored (or the resume run from where a relative path is found), not given another path (the data
    reader's hint, which the resume would refuse)."""
    for split in ("train", "valid"):
        path = getattr(data, split)
        if path is None or Path(path).exists():
            continue
        if not Path(path).is_absolute():
            raise RecscaleError(
                f"{RESUME}: data.{split} {path} is relative to the working directory and not found from "
                f"{Path.cwd()}; resume from the directory the run was started in"
            )
        raise RecscaleError(
            f"{RESUME}: data.{split} {path} is not found; a resumed run reads the data it trained on, unchanged, "
            "at the path its config.yaml names: restore the file there"
        )


def check_resume(run_dir: Path, cfg: RunConfig) -> None:
    _refuse_changes(run_dir, _resumable(run_dir), cfg)


def _resumable(run_dir: Path) -> RunConfig:
    if not (Path(run_dir) / "config.yaml").is_file():
        what = (
            "does not exist"
            if not os.path.lexists(run_dir)
            else "is not a recscale run directory (no config.yaml)"
        )
        raise RecscaleError(
            f"{RESUME}: {run_dir} {what}; name the directory of the run to continue, or start a new run without it"
        )
    return run_config(run_dir)


def _refuse_changes(run_dir: Path, saved: RunConfig, cfg: RunConfig) -> None:
    _, refused = resume_changes(saved, cfg)
    if refused:
        more = f" and {len(refused) - 4} more" if len(refused) > 4 else ""
        raise ConfigError(
            f"{RESUME}: the config changes {', '.join(refused[:4])}{more} of the run in {run_dir}; a resumed "
            f"run keeps its model, data and optimizer (it may change {', '.join(RESUMABLE_KEYS)}); "
            f"train a new run with another {RUN_DIR} instead"
        )


def dmt_hosts(ckpt: Path) -> int:
    """How many hosts trained the DMT model in checkpoint ``ckpt``: each saved its tower as ``towers.T.…``."""
    prefix = "/model/towers."
    return len({k.removeprefix(prefix).split(".")[0] for k in saved_keys(ckpt) if k.startswith(prefix)})


def check_dmt_topology(ckpt: Path, topology: Topology) -> None:
    """A DMT checkpoint resumes only on as many hosts as trained it (one tower per host: on another
    number of hosts the towers, hence the model, differ); the ranks per host may change (DCP reshards)."""
    saved, hosts, local = dmt_hosts(ckpt), topology.num_hosts, topology.local_world_size
    if saved != hosts:
        raise ConfigError(
            f"--resume: {ckpt} was saved by a DMT run on {saved} host{'s' * (saved != 1)} (one tower each) "
            "and this job has "
            f"{hosts} host{'s' * (hosts != 1)} of {local} rank{'s' * (local != 1)}; resume it on {saved} "
            f"host{'s' * (saved != 1)}, e.g. --nproc {saved * local} --local-world-size {local}"
        )


def check_scoring_ranks(cfg: RunConfig, run_dir: Path, ranks: int) -> None:
    """A DMT run is scored in one process: every rank would build all its towers unsharded anyway."""
    if cfg.dmt is not None and ranks > 1:
        raise RecscaleError(
            f"{run_dir} is a DMT run, which is scored in one process (its towers all load there); "
            "leave out --nproc"
        )


def _diverged_at(run_dir: Path) -> int | None:
    """The step where the run's training diverged (its report.json), if it did."""
    try:
        step = json.loads((run_dir / "report.json").read_text()).get("diverged_at_step")
    except (OSError, ValueError, AttributeError):  # no report, or not one of ours
        return None
    return step if isinstance(step, int) else None


def load_trained(
    run_dir: Path, purpose: str = "to evaluate", flat_only: bool = False
) -> tuple[RunConfig, Preprocessor, Built]:
    """The run's config, preprocessing and best (else latest) model, in this process; a DMT run with all
    its hosts' towers (unless ``flat_only``: refused). ``purpose`` ends the error for a run without a
    checkpoint: "no complete checkpoint to evaluate"."""
    run_dir = Path(run_dir)
    cfg, pre = load_run(run_dir)
    if cfg.dmt is not None and flat_only:
        raise CheckpointError(
            f"{run_dir} is a DMT run, which has no flat model {purpose} (flat runs only; "
            "`recscale eval` scores DMT runs too)"
        )
    best = committed(run_dir / "best")  # without it, a kill while best/ was replaced made this the latest
    ckpts = list_checkpoints(run_dir / "ckpt")
    source = best if (best / ".metadata").is_file() else (ckpts[-1] if ckpts else None)
    if source is None:
        step = _diverged_at(run_dir)
        why = (
            f"its training diverged at step {step}, before one was written (report.json); train it again with "
            "lower learning rates"
            if step is not None
            else "train the run first"
        )
        raise CheckpointError(f"{run_dir}: no complete checkpoint {purpose}; {why}")
    env = init_distributed()
    check_scoring_ranks(cfg, run_dir, env.world_size)
    # Scores do not depend on the sharding, and a multi-rank run's placements may name ranks this
    # job does not have: the checkpoint loads into the default plan at any world size (replicated
    # tables stay replicated: their optimizer may have no fused kernel), each rank allocating only its
    # shards (no unsharded copy first: the checkpoint overwrites them). A DMT run's towers all load
    # here, unsharded (``LocalDMT``), whatever the hosts that trained it.
    plan = (
        DistributedConfig(sharding="data_parallel")
        if cfg.dense_tables()
        else DistributedConfig(materialize="shards")
    )
    hosts = dmt_hosts(source) if cfg.dmt is not None else None
    try:
        built = build(cfg.model_copy(update={"distributed": plan}), feature_set(pre), env, dmt_hosts=hosts)
    except ConfigError as e:  # the run's config.yaml does not fit its own features: edited by hand
        raise CheckpointError(f"{run_dir / 'config.yaml'} does not fit the run ({e}); restore it") from None
    entries = {"model": built.module.state_dict()}
    if source != best and cfg.train.ema_decay:  # a training checkpoint: its dense average is the model
        entries["ema"] = built.trainable_dense()
    for entry, tensors in entries.items():
        with torch.no_grad():
            load_checkpoint(source, {entry: tensors if hosts is None else _dmt_names(source, entry, tensors)})
    return cfg, pre, built


def _dmt_names(ckpt: Path, entry: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` of a ``LocalDMT`` under the names a multi-host DMT run saved them with in ``entry``."""
    prefix = f"/{entry}/"
    saved = {k.removeprefix(prefix) for k in saved_keys(ckpt) if k.startswith(prefix)}
    names = {local_key(k): k for k in saved}
    return {names.get(k, k): t for k, t in tensors.items()}


def refuse_without_flat_form(
    run_dir: Path, cfg: RunConfig, purpose: str, hint: str = "`recscale eval` scores it"
) -> None:
    """A DMT run with compressing tower modules is a model with no flat form: a ``CheckpointError`` saying
    so (``purpose`` as for ``load_trained``). A flat run, or a DMT run with identity tower modules (DMT
    then computes exactly the flat model), passes."""
    if cfg.dmt is not None and cfg.dmt.tower_module.type != "identity":
        raise CheckpointError(
            f"{run_dir} is a DMT run with {cfg.dmt.tower_module.type} tower modules, a model with no flat "
            f"form {purpose} (only identity tower modules compute the flat model); {hint}"
        )


def load_flat(
    run_dir: Path, purpose: str, hint: str = "`recscale eval` scores it"
) -> tuple[RunConfig, Preprocessor, RecModel]:
    """The run's best (else latest) model as a flat model, in this process: a flat run's own; a DMT run
    with identity tower modules as the flat model it computes (``LocalDMT.flat_state_dict``, as
    ``recscale export`` writes it); a DMT run with compressing tower modules is refused
    (``refuse_without_flat_form``)."""
    refuse_without_flat_form(run_dir, run_config(run_dir), purpose, hint)
    cfg, pre, built = load_trained(run_dir, purpose)
    if not isinstance(built.model, LocalDMT):
        return cfg, pre, cast(RecModel, built.model)
    flat = build_model(cfg.model.name, feature_set(pre), cfg.model.embedding, cfg.model.params)
    flat.load_state_dict(built.model.flat_state_dict())
    return cfg, pre, flat.eval()


# What a run directory holds of its own (``recscale train`` writes them): no command's output may replace them.
_RUN_OWN = ("config.yaml", "preprocess.json", "report.json", "metrics.jsonl", "best", "ckpt", "data", "tb")


def check_run_output(out: Path, flag: str, run_dir: Path, data_path: str | None) -> None:
    """``recscale.io.check_output`` for a command reading ``run_dir`` and ``data_path`` (a file, or a MovieLens
    directory), and not one of the run's own files either."""
    kind = "directory" if data_path is not None and Path(data_path).is_dir() else "file"
    check_output(out, flag, [(f"the --data {kind}", data_path)])
    if data_path is not None and not Path(data_path).exists() and glob.has_magic(data_path):
        # A pattern's files: written over, one would be lost (the scores replace the rows being scored); matched
        # by the pattern, the output would be read as data by the same command's next run.
        pattern = os.path.abspath(data_path)
        read = {Path(m).resolve() for m in glob.glob(pattern, recursive=True)}
        if out.resolve() in read or Path(os.path.abspath(out)).match(pattern):
            raise RecscaleError(
                f"{flag} {out} matches the --data pattern {data_path}, whose files are read as data; name a "
                "file the pattern does not match"
            )
    where, run = out.resolve(), Path(run_dir).resolve()
    if run in where.parents and where.relative_to(run).parts[0] in _RUN_OWN:
        raise RecscaleError(
            f"{flag} {out} is the run's own {where.relative_to(run)}; name another file to write"
        )


def splits_dir(run_dir: Path, cfg: RunConfig, pre: Preprocessor, fix: str) -> Path:
    """The directory of a run's materialised splits: its own ``data/``, or that of ``data.prepared`` for a run
    trained on a preparation (it wrote none of its own), refused with ``fix`` where that preparation is
    gone or was prepared again since (its vocabularies are no longer the run's)."""
    if cfg.data.prepared is None:
        return run_dir / "data"
    root = Path(cfg.data.prepared)
    prepared = root / "preprocess.json"
    if not prepared.is_file() or Preprocessor.load(prepared).digest() != pre.digest():
        raise RecscaleError(
            f"data.prepared {root}: not the preparation this run was trained on (gone, or prepared again); {fix}"
        )
    return root / "data"


def load_training_sample(
    run_dir: Path, rows: int, purpose: str
) -> tuple[EmbeddingLayer, Batch, Preprocessor]:
    """A trained run's flat model's embedding layer (``load_flat``: a DMT run with identity tower modules
    too), its first ``rows`` training rows and its preprocessing (``purpose`` as for ``load_trained``)."""
    cfg, pre, model = load_flat(run_dir, purpose, "partition a flat run, or one with identity tower modules")
    split = splits_dir(Path(run_dir), cfg, pre, "retrain the run") / "train"
    if not (split / "meta.json").is_file():
        raise RecscaleError(
            f"{split}: the run's materialised training split is gone; retrain or resume the run"
        )
    ds = ArrayDataset(split)
    return model.embedding, ds.gather(np.arange(min(rows, len(ds)))), pre


def write_columns(path: Path, columns: dict[str, Any]) -> None:
    """``columns`` (name -> (N,) array) to ``path``: Parquet where its name ends in .parquet or .pq, else CSV; the
    file appears whole or not at all."""
    table = pa.table(columns)
    sink = pa.BufferOutputStream()
    if path.suffix.lower() in (".parquet", ".pq"):  # SCORES.PARQUET too: not CSV under a Parquet name
        pq.write_table(table, sink)
    else:
        # Compressed as the name says (.gz, .bz2, .zst, .lz4), as the readers decompress it: plain CSV under
        # a .gz name read back as a damaged gzip file.
        try:
            codec = pa.Codec.detect(str(path)).name
        except (TypeError, ValueError):  # no compression's extension
            pacsv.write_csv(table, sink)
        else:
            with pa.CompressedOutputStream(sink, codec) as stream:
                pacsv.write_csv(table, stream)
    atomic_write_bytes(path, sink.getvalue().to_pybytes())


def check_scoring_args(
    run_dir: Path,
    data_path: str | None,
    overrides: list[str] | None,
    out: tuple[Path, str] | None,
    command: str,
) -> None:
    """What ``eval`` or ``predict`` (``command``) is given, checked before the model loads (and before
    --nproc's launch): a run, reader-option overrides only, a --data that exists, an output it may write."""
    run_config(run_dir)  # a directory that is not a run is named first
    for item in overrides or []:
        key = item.partition("=")[0]
        if "=" not in item and data_path is None:  # `recscale predict RUN new.csv`: the file as an override
            raise ConfigError(
                f"{command}: '{item}' is no key=value override; give the file to score with --data {item}"
            )
        if key != "data.options" and not key.startswith("data.options."):
            raise ConfigError(
                f"{command}: override '{item}': {command} takes overrides of the reader's options only, "
                "e.g. \"data.options={delimiter: ','}\" (bad rows: --on-bad-row; the format: --format)"
            )
    # A file, a folder of files or a glob pattern matching some; the readers name a wrong kind of path.
    if data_path is not None and not names_data(data_path):
        raise DataError(f"--data {data_path}: no such file; give the file to score")
    if out is not None:
        check_run_output(out[0], out[1], run_dir, data_path)


def check_group_by(schema: Schema, name: str, where: str, of: str) -> None:
    """A ConfigError unless ``name`` is a single-id sparse feature of ``schema`` (what a group AUC groups by);
    ``where`` names the setting (``train.group_by=user``, ``--group-by user``), ``of`` what has the schema."""
    single = [f.name for f in schema.sparse if not f.multi]
    if name not in single:
        raise ConfigError(f"{where}: not a single-id feature of {of}; group by one of {', '.join(single)}")


def _say_unweighted(data_path: str | None, column: str) -> None:
    """Warn that eval of a run trained with row weights scores a file without their column unweighted: its
    metrics are not those of the run's own (weighted) evaluations, which nothing else in them would say."""
    warnings.warn(
        f"{data_path} has no column '{column}', the row weights the run trained and evaluated with "
        "(data.schema.weight): its rows are scored unweighted, unlike the run's report; give a file with "
        "the column to score them as the run did",
        stacklevel=2,
    )


def eval_run(
    run_dir: Path,
    data_path: str | None,
    fmt: str | None = None,
    split: str = "test",
    on_bad_row: OnBadRow | None = None,
    group_by: str | None = None,
    overrides: list[str] | None = None,
    predictions: Path | None = None,
    own_split: str | None = None,
) -> dict[str, Any]:
    """The metrics (auc, logloss, ne, calibration, rows; weight_sum where rows are weighted: a run trained
    with ``schema.weight`` on a file that has that column; skipped_rows and unknown_id_fields, the sparse
    fields with a vocabulary none of whose ids the file holds, if any) of the run's best (else
    latest) model on the file ``data_path``, read as ``fmt`` (default: the run's format); a run on
    synthetic data, without a file, on its own synthetic ``split``. Bad rows as ``on_bad_row`` says
    (default: as the run read its data). The reader's options are the run's ``data.options`` (another
    ``fmt``'s: its defaults), changed by ``overrides`` of them as train takes them (``data.options.delimiter=';'``
    or ``data.options={delimiter: ','}``). ``group_by``: a single-id feature;
    adds the group AUC over its ids (``evaluate``). ``predictions``: a file (.parquet, else CSV) to write
    each row's label, weight (a weighted read) and predicted probability (``score``) to, in the order read.
    ``own_split`` (train, valid, report or test), in place of a file: the rows of that split as the run
    materialised them (the valid rows of data.valid_fraction, the halves of data.report_fraction)."""
    out = (predictions, "--predictions") if predictions is not None else None
    scores = (
        _own_split_scored(run_dir, own_split, group_by)
        if own_split is not None
        else _scored(run_dir, data_path, fmt, split, on_bad_row, overrides, out, group_by=group_by)
    )
    with own_group(), scores as s:
        group_by = group_by or s.cfg.train.group_by  # the run's own grouping, unless told another
        m: dict[str, Any] = scored(s.logits, s.ds, group_by)
        if predictions is not None:
            # A weighted file's weights beside its labels: the weighted metrics recompute from the file alone.
            weights = s.ds.weights()
            s.write(
                predictions,
                {"label": s.ds.labels().astype(np.int8)} | ({} if weights is None else {"weight": weights}),
            )
        unknown = _unknown_fields(s)
    if group_by is not None:
        m["gauc_by"] = group_by
    if s.stats.skipped:
        m["skipped_rows"] = s.stats.skipped
    if unknown:
        m["unknown_id_fields"] = unknown
    return m


def predict_run(
    run_dir: Path,
    data_path: str | None,
    out: Path,
    fmt: str | None = None,
    on_bad_row: OnBadRow | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Score new rows: each row's predicted probability (``score``) and position in the file, in file
    order, written to ``out`` (.parquet, else CSV) for the file ``data_path`` read as ``eval_run`` reads
    it, except that CSV and Parquet files need no label column (one there is not read). Returns rows,
    and skipped_rows and unknown_id_fields (as ``eval_run``'s) if any."""
    try:
        with (
            own_group(),
            _scored(
                run_dir, data_path, fmt, "test", on_bad_row, overrides, (out, "--out"), labelled=False
            ) as s,
        ):
            s.write(out, {})
            unknown = _unknown_fields(s)
    except NoRows:  # a file of no rows (a day without traffic) is scored by a file of no scores, not an error
        if int(os.environ.get("RANK", 0)) == 0:
            fmt = fmt or run_config(run_dir).data.format
            # The columns a file of rows gets: several files' scores name each row's file (none here).
            parts = (
                {"file": pa.array([], pa.string())}
                if data_path and len(data_files(data_path, fmt)) > 1
                else {}
            )
            write_columns(
                out, {"score": np.zeros(0)} | parts | {position_unit(fmt): np.zeros(0, dtype=np.int64)}
            )
        return {"rows": 0}
    summary: dict[str, Any] = {"rows": len(s.ds)}
    if s.stats.skipped:
        summary["skipped_rows"] = s.stats.skipped
    if unknown:  # ids written otherwise than training's (007 for 7) all score as OOV: said, as eval says it
        summary["unknown_id_fields"] = unknown
    return summary


def _unknown_fields(s: _Scores) -> list[str]:
    """The sparse fields none of whose ids in the scored file the run knows."""
    # A field whose vocabulary is empty (min_count above every id's count) is OOV in training too.
    return [f for f in s.ds.unknown_fields() if s.pre.num_embeddings(f) > 1]


@dataclass
class _Scores:
    """What ``_scored`` yields: the run, the data it read and its model's logits (N,) on every row."""

    cfg: RunConfig
    pre: Preprocessor
    data: DataConfig
    ds: ArrayDataset
    stats: ReadStats
    logits: torch.Tensor

    def write(self, path: Path, columns: dict[str, np.ndarray]) -> None:
        """``columns`` and each row's score and position to ``path`` (rank 0: every rank holds every score).
        Rows a skip dropped leave gaps in the position column (a file's line or Parquet row), which joins
        the scores back to the file; from several files (a folder, a pattern) a ``file`` column names it."""
        if dist.get_rank() != 0:
            return
        probability = torch.sigmoid(self.logits.double()).numpy()  # float64: no two logits merged
        at: dict[str, Any] = {}
        if self.stats.positions:
            files = self.stats.position_files
            if len(set(files)) > 1:  # a folder's or a pattern's files: a row is a line of its file
                counts = [len(p) for p in self.stats.positions]
                at["file"] = pa.array(files).take(pa.array(np.repeat(np.arange(len(files)), counts)))
            at[position_unit(self.data.format)] = np.concatenate(self.stats.positions)
        write_columns(path, columns | {"score": probability} | at)


@contextmanager
def _own_split_scored(run_dir: Path, split: str, group_by: str | None) -> Iterator[_Scores]:
    """The run's model's scores of its own materialised ``split`` (train, valid, report or test), the rows
    its training and report read: valid's selection rows and its report rows under data.report_fraction."""
    cfg, pre, built = load_trained(run_dir)
    if group_by is not None:
        check_group_by(pre.schema, group_by, f"--group-by {group_by}", str(run_dir))
    root = splits_dir(run_dir, cfg, pre, "score a file with --data")
    stored = "valid" if split == "report" else split
    if split == "report" and cfg.data.report_fraction is None:
        raise RecscaleError(
            f"{run_dir} holds no report rows (it set no data.report_fraction); give --split valid"
        )
    meta = read_meta(root / stored)
    if meta is None:
        raise RecscaleError(
            f"{run_dir}: the run has no {split} split ({root / stored} is not there); score a file with --data"
        )
    ds = ArrayDataset(root / stored)
    if stored == "valid" and cfg.data.report_fraction is not None:
        selection, held = ds.hold_out(cfg.data.report_fraction)
        ds = held if split == "report" else selection
    logits = predict(built.module, ds, eval_batch_size(cfg.train.batch_size), 0, cfg.train.precision, False)
    yield _Scores(cfg, pre, cfg.data, ds, stats_of(meta), logits)


@contextmanager
def _scored(
    run_dir: Path,
    data_path: str | None,
    fmt: str | None,
    split: str,
    on_bad_row: OnBadRow | None,
    overrides: list[str] | None,
    out: tuple[Path, str] | None,
    labelled: bool = True,
    group_by: str | None = None,
) -> Iterator[_Scores]:
    """The run's model's scores of a file (or a synthetic run's ``split``), as ``eval_run`` reads it; the
    split lives while the block runs. ``out``: the file the command writes and its flag, checked first;
    ``group_by``: a field eval groups by, checked before the file is read."""
    command = "eval" if labelled else "predict"
    check_scoring_args(run_dir, data_path, overrides, out, command)
    cfg, pre, built = load_trained(run_dir)
    if group_by is not None:
        check_group_by(pre.schema, group_by, f"--group-by {group_by}", str(run_dir))
    if fmt == "synthetic" and cfg.data.format != "synthetic":
        raise RecscaleError(
            f"{run_dir} was trained on {cfg.data.format} data; --format synthetic scores only a run trained "
            "on synthetic data: give the file to score with --data (and its --format if it differs)"
        )
    if (fmt or cfg.data.format) == "synthetic" and data_path is not None:
        raise RecscaleError(
            f"{run_dir} was trained on synthetic data, which has no file format to read --data {data_path} "
            "with; pass --format csv (or parquet) for a file with the run's columns "
            f"({', '.join(pre.schema.column_names()[:4])}, ...)"
        )
    if data_path is None and (fmt or cfg.data.format) != "synthetic":
        more = ", or score the run's own rows with --split valid (or train, report, test)" if labelled else ""
        raise RecscaleError(f"{run_dir}: give the file to score (--data){more}")
    rows = cfg.data.synthetic.rows if data_path is None and cfg.data.synthetic is not None else {}
    if data_path is None and split not in rows:
        raise RecscaleError(
            f"{run_dir} was trained on synthetic data whose data.synthetic.rows has no {split} split "
            f"(it has {', '.join(rows)}); train a run with {split} rows to score one"
        )
    # The run's data.options are its own format's reader's: another --format reads with its defaults.
    other = fmt is not None and fmt != cfg.data.format
    options = dict({} if other else cfg.data.options or {})
    options = apply_overrides({"data": {"options": options}}, list(overrides or []))["data"]["options"]
    if not isinstance(options, dict):
        raise ConfigError(f"{command}: data.options must be a mapping of reader options, got {options!r}")
    data = cfg.data.model_copy(
        update={
            "format": fmt or cfg.data.format,
            "on_bad_row": on_bad_row or cfg.data.on_bad_row,
            "options": options,
        }
    )
    # libsvm places the label first in every line and MovieLens derives it: their files always have one.
    unlabelled = not labelled and data.format in ("csv", "parquet", "criteo")
    # Bars on a terminal, as train and data prepare show them: a file of millions of rows takes minutes.
    progress = sys.stderr.isatty() and dist.get_rank() == 0
    with scratch_dir(f"recscale-{command}-") as tmp:
        try:
            # A run trained with row weights is scored with them where the file has their column, else unweighted.
            weight = pre.schema.weight
            weighted = (
                weight is not None
                and data_path is not None
                and holds_column(data_path, data.format, data.options, weight)
            )
            ds, stats = prepare_split(
                data, pre, split, data_path, Path(tmp) / "split", progress=progress,
                positions=out is not None, labelled=not unlabelled, weighted=weighted,
            )  # fmt: skip
        except DataError as e:  # the readers' hints name config keys, which eval takes no overrides for
            line = str(e).replace(SKIP_HINT, "(pass --on-bad-row skip to drop such rows)")
            raise type(e)(  # NoRows stays NoRows: predict writes no scores for no rows
                line.replace("data.format=", "--format ").replace("data.format", "--format")
            ) from None
        if labelled and weight is not None and not weighted and dist.get_rank() == 0:
            _say_unweighted(data_path, weight)
        # The batches the run's own evaluations used: an fp8 activation's scale is its batch's.
        logits = predict(
            built.module, ds, eval_batch_size(cfg.train.batch_size), 0, cfg.train.precision, progress
        )
        yield _Scores(cfg, pre, data, ds, stats, logits)
