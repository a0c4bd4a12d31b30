"""Scaling sweeps: train a grid of model sizes (and lengths, and seeds) on the same data, one CSV row per run.

A sweep file names a base run config, overrides for every run, and per model family the sizes to
train (explicit ``sizes`` and/or the cartesian product of a ``grid``), given as keys of the model
section (dotted for nested ones, e.g. ``embedding.dim``)::

    base: ../demo.yaml                 # relative to the sweep file
    overrides: [data.synthetic.rows.train=2000000]
    out: runs/sweeps/small             # relative to the working directory
    families:
      wukong:
        model: {name: wukong, k: 8}    # shared by the family's runs
        sizes: [{num_layers: 1, n_f: 4}, {num_layers: 2, n_f: 8}]
      dlrm:
        model: {name: dlrm}
        grid: {top_mlp: [[64], [256, 256]]}

Every run trains exactly one epoch (``train.epochs`` is set to 1, as in the Wukong paper's scaling
study) in ``OUT/runs/<run name>``. A family may give ``lengths``, in training rows (whole batches):
each size is then trained once per length, ``length / batch`` steps of one pass, so every step sees
fresh rows and the fit can take the compute-optimal frontier over sizes and lengths. A run reads the
first rows of its seed's shuffle of the training split, so the lengths of one seed nest: a shorter run's
rows are the first rows of a longer one's. ``seeds: [0, 1, 2]`` (top level) trains every (size,
length) point once per seed (``seed``), the point's name then suffixed ``-seed<s>``. The data is read and materialised once, under ``OUT/data/<hash>``,
and linked into each run directory. A family's own ``overrides`` (e.g. ``[train.precision=fp32]``) apply
after the sweep's to its runs alone; every family must still read the same data. A run is finished when its ``result.json`` exists; a restarted
sweep skips finished runs (after checking their config is the one the sweep asks for) and starts
unfinished ones afresh. After each run ``OUT/results.csv`` is rewritten atomically from all results.
"""

from __future__ import annotations

import csv
import gc
import hashlib
import io
import itertools
import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, Field, ValidationError, model_validator

from recscale.config import RunConfig, field_paths, format_validation_error, validate_config
from recscale.config_files import (
    apply_overrides,
    load_raw,
    load_yaml,
    merge,
    not_a_file,
    read_yaml_mapping,
    set_key,
)
from recscale.errors import ConfigError, RecscaleError
from recscale.io import Hold, atomic_write_text
from recscale.models.flops import TRAIN_FLOPS_MULTIPLIER, mflop_text
from recscale.settings import Settings

COLUMNS = [
    "family", "run", "point", "seed", "model", "knobs", "dense_params", "sparse_params", "gflop_per_example",
    "examples", "train_flops", "valid_logloss", "valid_ne", "valid_auc", "bayes_logloss",
    "wall_s", "train_s",
]  # fmt: skip
RESULT = "result.json"
_ROW_NEEDS = ("family", "run", "train_flops", "valid_logloss")  # in every result.json a sweep has written
FAMILY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


class Family(Settings):
    """One model family: its shared model section and the sizes to train."""

    model: dict[str, Any]
    # The family's own overrides of everything but the data, after the sweep's (e.g. train.precision=fp32
    # beside a bf16 family of the same model: one study, one data set, the two precisions side by side).
    overrides: list[str] = []
    sizes: list[dict[str, Any]] = []
    grid: dict[str, list[Any]] = {}
    # Training rows per run (each size once per length); empty: one epoch over the training split.
    lengths: list[Annotated[int, Field(gt=0)]] = []

    @model_validator(mode="after")
    def _has_sizes(self) -> Family:
        if not self.sizes and not self.grid:
            raise ValueError("give the family's sizes (a list of model keys) or a grid (key: [values])")
        if any(not values for values in self.grid.values()):
            raise ValueError("every grid key needs at least one value")
        if len(set(self.lengths)) < len(self.lengths):
            raise ValueError(f"lengths {self.lengths} repeat a length; list each once")
        return self

    def points(self) -> list[dict[str, Any]]:
        keys = list(self.grid)
        product = [dict(zip(keys, vs, strict=True)) for vs in itertools.product(*self.grid.values())]
        return self.sizes + (product if keys else [])


class SweepConfig(Settings):
    base: str
    overrides: list[str] = []
    out: str = "runs/sweep"
    # Seeds (``seed`` of each run) per point; empty: the base config's seed, no name suffix.
    seeds: list[Annotated[int, Field(ge=0)]] = []
    families: dict[str, Family] = Field(min_length=1)

    @model_validator(mode="after")
    def _distinct_seeds(self) -> SweepConfig:
        if len(set(self.seeds)) < len(self.seeds):
            raise ValueError(f"seeds {self.seeds} repeat a seed; list each once")
        return self

    @model_validator(mode="after")
    def _family_names(self) -> SweepConfig:
        # A family's name starts its runs' directory names, which a restarted sweep removes and retrains.
        for name in self.families:
            if not FAMILY_NAME.fullmatch(name):
                raise ValueError(
                    f"family name {name!r}: use letters, digits, '_' and '-', starting with a letter or digit "
                    "(it names the runs' directories)"
                )
        return self


class Run(BaseModel):
    family: str
    name: str
    point: str  # the name without the seed: runs of one point differ only in their seed
    knobs: dict[str, Any]
    length: int | None  # training rows; None: one epoch
    config: RunConfig


def _slug(family: str, knobs: dict[str, Any]) -> str:
    """A readable, filesystem-safe run name from the knobs: ``wukong-num_layers2-fmb_mlp512x512``."""

    def text(v: Any) -> str:
        return "x".join(map(str, v)) if isinstance(v, list) else str(v)

    name = "-".join([family, *(f"{k.rsplit('.', 1)[-1]}{text(v)}" for k, v in knobs.items())])
    name = re.sub(r"[^A-Za-z0-9_.=x-]", "", name)
    if len(name) > 80:
        name = name[:70] + "-" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return name


def _one_epoch(path: Path, where: str, overrides: list[str]) -> None:
    """Every run of a sweep trains one epoch (longer runs: a family's ``lengths``); the sweep sets it after
    the sweep's overrides, and a family's own would have undone it without a word."""
    for item in overrides:
        if item.partition("=")[0].strip() in ("train.epochs", "train"):
            raise ConfigError(f"{path}: {where} set {item!r}; every sweep run trains one epoch "
                              "(a family's lengths train for longer)")  # fmt: skip


_MISSING = object()


def _dotted(raw: Any, key: str) -> Any:
    """The value at dotted ``key`` in ``raw`` (list items by index), or ``_MISSING``."""
    for part in key.split("."):
        if isinstance(raw, dict) and part in raw:
            raw = raw[part]
        elif isinstance(raw, list) and part.isdigit() and int(part) < len(raw):
            raw = raw[int(part)]
        else:
            return _MISSING
    return raw


def _overrides_kept(overrides: list[str], raw: dict) -> None:
    """A family's overrides apply before its model section and its sizes' keys: a model key that one of
    those also sets replaced the override's value without a word."""
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key.split(".")[0] != "model":
            continue
        if _dotted(apply_overrides({}, [item]), key) != _dotted(raw, key):
            raise ConfigError(
                f"the family's override {item!r} is replaced by its model section or this size's keys, which "
                f"also set {key}; set it in one place"
            )


def load_sweep(path: str | Path) -> tuple[SweepConfig, list[Run]]:
    """Read and validate a sweep file and every run config it implies (nothing is trained)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(not_a_file(path, "sweep file"))
    try:
        sweep = SweepConfig.model_validate(read_yaml_mapping(path, "a sweep"))
    except ValidationError as e:
        keys = list(field_paths(SweepConfig))
        raise ConfigError(f"{path}: {format_validation_error(e, keys=keys)}") from None
    base_path = path.parent / sweep.base
    if not base_path.is_file():
        raise ConfigError(f"{path}: {not_a_file(base_path, 'base config')}")
    base = apply_overrides(load_raw(base_path), sweep.overrides)
    _one_epoch(path, "the overrides", sweep.overrides)
    set_key(base, "train.epochs", 1, "train.epochs")
    runs: list[Run] = []
    names: dict[str, tuple[str, dict[str, Any]]] = {}  # a size's run name -> the family and knobs naming it
    seeds: list[int | None] = [*sweep.seeds] or [None]
    for family, spec in sweep.families.items():
        for i, knobs in enumerate(spec.points()):
            try:
                raw = apply_overrides(json.loads(json.dumps(base)), spec.overrides)  # on a deep copy
                _one_epoch(path, f"family {family}'s overrides", spec.overrides)
                # Copies: a knob that sets a list item (top_mlp.0) must not change the family's list for the
                # sizes after it.
                # Merged key by key, as a base: file is: the family's embedding: {init_std: ...} replaced the whole
                # model.embedding the base and the sweep's overrides gave (its dim, storage), without a word.
                raw["model"] = merge(raw.get("model", {}), json.loads(json.dumps(spec.model)))
                for key, value in knobs.items():
                    set_key(raw["model"], key, value, f"model key {key!r}")
                _overrides_kept(spec.overrides, raw)
                cfg = validate_config(raw)
            except ConfigError as e:
                raise ConfigError(f"{path}: family {family}, size {i + 1} {knobs}: {e}") from None
            size = _slug(family, knobs)
            if size in names:
                first, first_knobs = names[size]
                if first == family:
                    raise ConfigError(f"{path}: family {family} lists the size {knobs} twice")
                # Families dlrm-top_mlp64 (size {}) and dlrm (size {top_mlp: [64]}) name one run alike.
                raise ConfigError(
                    f"{path}: family {family}'s size {knobs} and family {first}'s size {first_knobs} would both "
                    f"be run {size}; rename one of the families"
                )
            names[size] = (family, knobs)
            lengths: list[int | None] = [*spec.lengths] or [None]
            for length in lengths:
                _check_length(path, family, length, cfg)
                point = size if length is None else f"{size}-n{length}"
                train = {"max_steps": length // cfg.train.batch_size} if length else {}
                for seed in seeds:
                    run_cfg = cfg.model_copy(
                        update={"train": cfg.train.model_copy(update=train)}
                        | ({} if seed is None else {"seed": seed})
                    )
                    name = point if seed is None else f"{point}-seed{seed}"
                    runs.append(
                        Run(family=family, name=name, point=point, knobs=knobs, length=length, config=run_cfg)
                    )
    # Seed-major order: a study stopped part-way has every family and point at the seeds it reached.
    order = {seed: i for i, seed in enumerate(seeds)}
    runs.sort(key=lambda r: order[r.config.seed if sweep.seeds else None])
    if len({r.config.data.model_dump_json() for r in runs}) > 1:
        raise ConfigError(f"{path}: every run of a sweep must read the same data; families may not set it")
    return sweep, runs


def _check_length(path: Path, family: str, length: int | None, cfg: RunConfig) -> None:
    """A length is whole batches, and (for synthetic data, whose size is known here) fresh rows."""
    if length is None:
        return
    where = f"{path}: family {family}: length {length}"
    if cfg.train.max_steps is not None:  # replaced by length / batch, without a word
        raise ConfigError(
            f"{where} sets each run's steps (length / train.batch_size), and train.max_steps is "
            f"{cfg.train.max_steps}; drop train.max_steps or the family's lengths"
        )
    batch = cfg.train.batch_size
    if length % batch:
        raise ConfigError(
            f"{where} is not a multiple of train.batch_size {batch}; give lengths in whole batches"
        )
    syn = cfg.data.synthetic
    if syn is not None and length > syn.rows.get("train", 0):
        raise ConfigError(
            f"{where} exceeds the {syn.rows.get('train', 0)} training rows; raise data.synthetic.rows.train "
            "to the longest length, so that every step reads fresh rows"
        )


def _shared_data(root: Path, cfg: RunConfig) -> Path:
    """The directory all runs share for preprocessing and materialised splits, keyed by the data config."""
    key = hashlib.sha256(cfg.data.model_dump_json().encode()).hexdigest()[:12]
    shared = root / "data" / key
    shared.mkdir(parents=True, exist_ok=True)
    return shared


def result_row(run: Run, report: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """The CSV row of a finished run, from the trainer's report."""
    gflop = report["mflops_per_example"] / 1e3
    valid = report["valid"]
    return {
        "family": run.family,
        "run": run.name,
        "point": run.point,
        "seed": run.config.seed,
        "model": report["model"],
        "knobs": json.dumps(run.knobs, separators=(",", ":")),
        "dense_params": report["parameters"]["dense"],
        "sparse_params": report["parameters"]["sparse"],
        "gflop_per_example": gflop,
        "examples": report["examples"],
        "train_flops": TRAIN_FLOPS_MULTIPLIER * gflop * 1e9 * report["examples"],
        "valid_logloss": valid["logloss"],
        "valid_ne": valid["ne"],
        "valid_auc": valid["auc"],
        "bayes_logloss": report.get("bayes_logloss", ""),
        "wall_s": round(wall_s, 2),
        "train_s": report["train_seconds"],
    }


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def _finished(run: Run, run_dir: Path) -> dict[str, Any] | None:
    """The stored row of a finished run; None when the run still has to be trained."""
    result = run_dir / RESULT
    if not result.is_file():
        return None
    fix = "remove that directory (the sweep trains it again) or give the sweep another out"
    try:
        stored = read_yaml_mapping(run_dir / "config.yaml", "a run's config")
        row = json.loads(result.read_bytes())
    except (ConfigError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise RecscaleError(f"{run_dir} holds a {RESULT} but cannot be read back ({e}); {fix}") from None
    # A row with other keys would fail the CSV writer, one without them become a blank row in results.csv
    # that `scaling fit` refuses; rows of older sweeps lack later columns (those cells stay blank).
    if not isinstance(row, dict) or not set(row) <= set(COLUMNS) or not set(_ROW_NEEDS) <= set(row):
        raise RecscaleError(
            f"{result}: not a sweep run's result (a JSON object of results.csv's columns); {fix}"
        )
    if stored != load_yaml(run.config.to_yaml()):
        raise RecscaleError(
            f"{run_dir} holds a finished run with another config than the sweep asks for; {fix}"
        )
    return row


def _train(run: Run, run_dir: Path, shared: Path) -> dict[str, Any]:
    from recscale.train.loop import Trainer

    if run_dir.exists():  # an unfinished attempt: start it afresh
        if run_dir.name != run.name or run.name in (".", ".."):  # a name that resolves outside OUT/runs
            raise RecscaleError(f"{run_dir}: not a run directory of the sweep; refusing to remove it")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "data").symlink_to(shared.resolve(), target_is_directory=True)
    pre = shared / "preprocess.json"
    if pre.is_file():
        shutil.copyfile(pre, run_dir / "preprocess.json")
    t0 = time.perf_counter()
    trainer = Trainer(run.config, run_dir)
    if run.length is not None and len(trainer.train_ds) < run.length:
        raise RecscaleError(
            f"{run.name}: length {run.length} exceeds the {len(trainer.train_ds)} training rows; "
            "shorten the sweep's lengths or give it more training data"
        )
    if not pre.is_file():  # the first run fitted the preprocessing: later runs reuse it
        atomic_write_text(pre, (run_dir / "preprocess.json").read_text())
    report = trainer.fit()
    row = result_row(run, report, time.perf_counter() - t0)
    atomic_write_text(run_dir / RESULT, json.dumps(row, indent=2))
    del trainer
    gc.collect()  # the next run's tables should not have to share memory with this one's
    return row


def run_sweep(path: str | Path, out: str | Path | None = None, log: Callable[[str], None] = print) -> Path:
    """Train every unfinished run of the sweep; returns the path of the results CSV."""
    sweep, runs = load_sweep(path)
    root = Path(out if out is not None else sweep.out)
    root.mkdir(parents=True, exist_ok=True)
    with Hold(root):  # a second sweep into OUT would start afresh (remove) the run this one is training
        return _run_all(runs, root, log)


def _run_all(runs: list[Run], root: Path, log: Callable[[str], None]) -> Path:
    shared = _shared_data(root, runs[0].config)
    rows: list[dict[str, Any]] = []
    for i, run in enumerate(runs, 1):
        run_dir = root / "runs" / run.name
        row = _finished(run, run_dir)
        if row is not None:
            log(f"[{i}/{len(runs)}] {run.name}: finished before, skipped")
        else:
            log(f"[{i}/{len(runs)}] {run.name}: training")
            row = _train(run, run_dir, shared)
            log(f"[{i}/{len(runs)}] {run.name}: valid logloss {row['valid_logloss']:.5f}, "
                f"{mflop_text(row['gflop_per_example'] * 1e3)}/example, {row['wall_s']:.0f} s")  # fmt: skip
        rows.append(row)
        write_csv(root / "results.csv", rows)
    return root / "results.csv"
