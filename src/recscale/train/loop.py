"""The training loop: one config in, a trained run directory and a report out.

    prepare the data (fit preprocessing on train, materialise splits)       train.data
    build the model (tables sharded by TorchRec, dense part data-parallel)  train.build
    for each epoch, for each batch: train_step; log; evaluate, early-stop, checkpoint
    restore the best weights, final evaluation, report

Run directory::

    config.yaml         the resolved config
    preprocess.json     the fitted preprocessing artifact (written once the splits are materialised)
    data/{split}/       materialised splits (a cache; safe to delete)
    metrics.jsonl       one JSON object per logged train window and per evaluation (NaN metrics: null)
    tb/                 TensorBoard logs
    ckpt/step_N/        checkpoints (model, optimizers, data position, RNG)
    best/               the best model by the early-stopping metric, and its step (written after ckpt/)
    report.json         the final report (standard JSON too: a NaN metric is null)
    .lock               held while a training writes the run (another is refused: recscale.io.Hold)
"""

from __future__ import annotations

import math
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from recscale.config import FP16_SHRINK, RunConfig
from recscale.data.batch import Batch
from recscale.data.dataset import ArrayDataset, epoch_batches, iterate
from recscale.data.materialize import progress_bar
from recscale.distributed import comms
from recscale.distributed.balance import Balance, CostModel, Padding, balanced_parts
from recscale.distributed.env import heartbeat, init_distributed, shutdown
from recscale.distributed.topology import Topology
from recscale.errors import RESUME, RUN_DIR, CheckpointError, ConfigError, RecscaleError
from recscale.io import Hold, atomic_write_text, removed_on_failure, strict_json
from recscale.models.base import RecModel, TrainableModel
from recscale.models.blocks import Calibration
from recscale.models.blocks.sequence import SequenceEncoder
from recscale.models.flops import module_flops
from recscale.train.build import build, check_model, feature_set, planner_sample
from recscale.train.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    remove_partial_checkpoints,
    save_checkpoint,
    saved_step,
)
from recscale.train.data import prepare_run_data
from recscale.train.evaluate import bayes_floor, eval_batch_size, evaluate, predict, scored
from recscale.train.memory import freed_memory_kept, keep_freed_memory, release_freed_memory
from recscale.train.metrics import rows_are
from recscale.train.optim import lr_factor
from recscale.train.precision import autocast, warn_if_emulated
from recscale.train.regularizers import DenseEMA, EmbeddingL2, TableDecay
from recscale.train.runs import (
    check_dmt_topology,
    check_group_by,
    check_resume,
    init_from,
    refuse_artifact,
    refuse_inside_data,
)
from recscale.train.state import Progress, RunLog, rng_state, set_rng_state, watched_metric


def cost_model(
    balance: Balance, model: TrainableModel, flops_per_example: int, names: list[str]
) -> CostModel:
    """What ``distributed.balance`` predicts a sample costs from its history lengths (sequence features
    ``names``, in that order). ``flops``: the model's forward FLOPs per example (``flops_per_example``)
    less its encoders' at full histories is the fixed part; each encoder gives its per-length terms, and
    its length buckets how it pads (N equal-count buckets depend on the rank's part: not modelled)."""
    if balance == "tokens" or balance == "tokens2":
        return CostModel.tokens(balance, len(names))
    if balance != "flops" or not isinstance(model, RecModel):
        raise ConfigError(f"distributed.balance={balance} needs a flat model with sequence features")
    per_length = model.embedding.sequence_flops()
    encoders = [e for e in (model.embedding.encoders or {}).values() if isinstance(e, SequenceEncoder)]
    fixed = flops_per_example - sum(module_flops(e) for e in encoders)
    buckets = encoders[0].cfg.buckets if encoders else 1
    padding: Padding = "pow2" if buckets == "pow2" else "batch" if buckets == 1 else "jagged"
    return CostModel.flops(fixed, [per_length[n] for n in names], padding)


def check_world_size(cfg: RunConfig, world_size: int) -> None:
    """``cfg`` can train on ``world_size`` ranks: the global batch is split over them (in equal slices, or
    balanced by ``distributed.balance``), and what needs several ranks has them."""
    cfg.distributed.check_world_size(world_size)
    if cfg.train.batch_size % world_size:
        raise ConfigError(
            f"train.batch_size {cfg.train.batch_size} must be a multiple of the {world_size} "
            "ranks: the global batch is split over them"
        )
    if (
        world_size > 1
        and cfg.train.batch_size == world_size
        and getattr(cfg.model.params, "norm", None) == "batch"
    ):
        raise ConfigError(
            f"model.norm=batch normalises over each rank's batch, and train.batch_size {cfg.train.batch_size} "
            f"over {world_size} ranks is 1 row each; train with larger batches or another model.norm"
        )


def check_run_dir(run_dir: Path, cfg: RunConfig, resume: bool, topology: Topology) -> None:
    """``run_dir`` can take this run: a new run's directory holds no run; a resumed one matches ``cfg``
    (and a DMT one was trained on as many hosts as ``topology`` has)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RecscaleError(f"{RUN_DIR} {run_dir} is a file; name a directory for the run")
    refuse_inside_data(run_dir, cfg.data, f"choose a {RUN_DIR} outside it")
    if resume:
        check_resume(run_dir, cfg)
        ckpts = list_checkpoints(run_dir / "ckpt")
        if cfg.dmt is not None and ckpts:
            check_dmt_topology(ckpts[-1], topology)
        return
    # A run written into a model directory would overwrite its config.yaml and break both.
    refuse_artifact(run_dir, f"choose another {RUN_DIR} for the run")
    if list_checkpoints(run_dir / "ckpt") or (run_dir / "report.json").exists():
        raise RecscaleError(
            f"{run_dir} already holds a run; pass {RESUME} to continue it or choose another {RUN_DIR}"
        )


# The training rows' mean weight beyond which the loss's scale (sum(w * l) / rows) is taken as a mistake.
WEIGHT_SCALE = (1e-4, 1e4)


def _warn_if_unknown(train: ArrayDataset, source: Path) -> None:
    """A warm start maps its data with another run's vocabularies: a field none of whose ids they hold (ids
    written another way, another id space) trains its OOV row only."""
    unknown = train.unknown_fields()
    if unknown:
        warnings.warn(
            f"train.init_from {source}: no id of {', '.join(unknown)} in the training split is in that run's "
            "vocabularies (all map to the out-of-vocabulary row): are they written as that run's data wrote them?",
            stacklevel=2,
        )


def _warn_if_weights_far_from_one(train: ArrayDataset, column: str | None) -> None:
    """Warn where the training rows' mean row weight is far from 1. The loss is sum(w * l) / rows, so it and its
    gradients scale with the weights: that moves SGD's step, and far enough stalls training without a word
    (Adam's and Adagrad's eps swamp tiny gradients; squared gradients of weights near 1e19 overflow float32, the
    optimizer state turns inf and every update 0: weights of 1e30 left AUC at 0.48 where 1 reached 0.79)."""
    weights = train.weights()
    if weights is None or not len(weights):
        return
    mean = float(weights.mean(dtype=np.float64))
    low, high = WEIGHT_SCALE
    if low <= mean <= high or mean == 0:  # a split of no weight is refused before (_refuse_weightless)
        return
    warnings.warn(
        f"data.schema.weight: the training rows' weights (column '{column}') "
        f"average {mean:.3g}: the loss is sum(w * logloss) / rows, so it and its gradients scale with them, which "
        f"moves SGD's steps, and a mean outside [{low:g}, {high:g}] risks stopping training without an error "
        "(gradients under Adam's and Adagrad's eps, or their squares overflowing float32); divide the weights by "
        "their mean (the metrics do not change)",
        stacklevel=3,
    )


class Trainer:
    """Trains one config into one run directory: ``Trainer(cfg, run_dir).fit()`` returns the report.

    What it sets up for itself ends when ``fit`` returns or raises (or the constructor raises, or ``close``
    is called on a Trainer that never trains: ``with Trainer(cfg, run, resume=True) as t:`` to score one): the
    process group it started (a group of one outside torchrun, torchrun's group under it) is destroyed,
    and ``train.reuse_memory``'s malloc tuning (``train.memory``) is undone. A group the caller made
    first (``recscale.distributed.env.init_distributed()``) stays up, as does malloc tuning already in
    effect: a caller that scores ``trainer.module`` after ``fit`` (``predict`` runs collectives) starts
    the group itself. The global torch RNG is reseeded from ``cfg.seed``. Thread counts and warnings
    filters are not touched (only the CLI silences upstream warnings).
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, resume: bool = False) -> None:
        self.cfg, self.dir = cfg, Path(run_dir)
        self._own_group, self._own_malloc = not dist.is_initialized(), False
        try:
            self.env = init_distributed(cfg.distributed.timeout_s)
            self.main = self.env.is_main
            check_world_size(cfg, self.env.world_size)
            check_model(cfg)  # before the data is prepared and a file is written
            # Restarted by torchrun (--max-restarts): continue from the last complete checkpoint. Rank 0's
            # view of the directory decides for every rank: an attempt that died before rank 0 wrote config.yaml
            # could otherwise have ranks that checked before and after its write disagree (their collectives
            # then out of step).
            if not resume and self.env.restart_count > 0:
                found = [(self.dir / "config.yaml").is_file()]
                if self.env.world_size > 1:
                    dist.broadcast_object_list(found, src=0)
                resume = bool(found[0])
            with removed_on_failure(
                self.dir, enabled=self.main
            ):  # a run that never started leaves no directory
                self._setup(resume)
        except BaseException:
            self._release(failed=True)
            raise

    def close(self) -> None:
        """End this Trainer without training (``fit`` ends it itself): its log, the run directory's hold
        (another process may then train into it) and what it set up process-wide (the class docstring)."""
        self.log.close()
        if self.main:
            self.hold.release()
        self._release()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _release(self, failed: bool = False) -> None:
        """Undo what this Trainer set up process-wide (see the class docstring); once. ``failed``: the
        heartbeat store is kept, so the error's one line can still name a rank that hung (``lost_peer``)."""
        if self._own_malloc:
            release_freed_memory()
            self._own_malloc = False
        if self._own_group:
            if not failed:
                shutdown()  # joins gloo's threads now, and forgets the group's heartbeat
            elif dist.is_initialized():
                dist.destroy_process_group()
            self._own_group = False

    def _setup(self, resume: bool) -> None:
        cfg, t = self.cfg, self.cfg.train
        self._prepare_dir(resume)
        # A warm start reads another run's preprocessing and kept model; a resume with a checkpoint of its own
        # needs neither (that run may be gone by then).
        warm = t.init_from is not None and not (resume and list_checkpoints(self.dir / "ckpt"))
        self.init = init_from(cfg, self.dir) if warm else None
        # Rank 0 preprocesses; the others wait, then find its artifacts and materialised splits.
        if not self.main:
            self._barrier()
        self._prepare_data(resume)
        if self.main:
            self._barrier()
        if t.group_by is not None:
            check_group_by(self.pre.schema, t.group_by, f"train.group_by={t.group_by}", "the data")
        self.built = build(cfg, feature_set(self.pre), self.env, planner_sample(cfg, self.train_ds))
        self.module, self.opt = self.built.module, self.built.opt
        if self.init is not None:  # DCP reshards the other run's tables into this run's plan
            # A resume before this run's first checkpoint, of a source trained again since: its tables index others.
            if self.pre.digest() != self.init.pre.digest():
                raise RecscaleError(
                    f"train.init_from {self.init.run_dir}: its vocabularies are no longer the ones this run "
                    f"prepared its data with (was that run trained again?); start a new run with another {RUN_DIR}"
                )
            load_checkpoint(self.init.checkpoint, {"model": self.module.state_dict()})
            self._uncalibrate()
        if self.main:
            warn_if_emulated(t.precision, self.env.device)
        if t.reuse_memory and not freed_memory_kept():  # tuning the caller set up stays the caller's
            self._own_malloc = keep_freed_memory()
        if cfg.distributed.count_bytes:
            comms.install()
        self.comm = comms.CommMeter(self.env.topology, self.env.rank)
        self.base_lrs = [g["lr"] for g in self.built.dense.param_groups]
        self.sparse_base_lrs = [g["lr"] for g in self.built.tables.param_groups]
        self.dense_params = list(self.built.trainable_dense().values())
        self.l2 = EmbeddingL2(self.built.model, t.embedding_l2) if t.embedding_l2 > 0 else None
        self.decay = (
            TableDecay(self.built.table_shards(), t.table_weight_decay) if t.table_weight_decay else None
        )
        self.ema = DenseEMA(self.built.trainable_dense(), t.ema_decay) if t.ema_decay else None
        n = len(self.train_ds)
        if n < self.env.world_size:
            raise ConfigError(
                f"the training split has {n} row{'s' * (n != 1)}, fewer than the {self.env.world_size} "
                "ranks: each rank trains on a part of every batch; train on fewer ranks or more rows"
            )
        if (
            n < t.batch_size
            and n // self.env.world_size < 2
            and getattr(cfg.model.params, "norm", None) == "batch"
        ):
            # The one batch of a split under train.batch_size: torch's 'Expected more than 1 value per channel'
            # at the first step, an internal error (check_world_size sees only the configured batch).
            w = self.env.world_size
            each = f", which leaves one of the {w} ranks 1 row" if w > 1 else ""
            raise ConfigError(
                f"model.norm=batch normalises over the batch, and the training split has {n} row{'s' * (n != 1)}, "
                f"its one batch (train.batch_size {t.batch_size} is larger){each}; train on more rows or use "
                "another model.norm"
            )
        self.steps_per_epoch = n // t.batch_size + (1 if n % t.batch_size and n < t.batch_size else 0)
        self.total_steps = min(t.epochs * self.steps_per_epoch, t.max_steps or 10**18)
        self.decay_resolved = True  # fp16 tables' decay: see _warn_if_decay_rounds_away
        # Negatives kept at rate w make the training rows' odds 1/w times the data's: the loss sees the
        # logits shifted by log(1/w), so the model's own logits are the unsampled data's.
        rate = cfg.data.negative_sampling_rate
        self.logit_offset = -math.log(rate) if rate is not None else 0.0
        self.said_watched = False  # early stopping's LogLoss in place of an undefined AUC/NE, said once
        self.diverged_at: int | None = None  # the step whose training loss was first seen NaN or inf
        if cfg.distributed.balance != "none" and self.env.world_size == 1:
            warnings.warn(
                f"distributed.balance={cfg.distributed.balance} splits each global batch across ranks, and this run "
                "has one: it changes nothing here; launch ranks (--nproc N) or set distributed.balance=none",
                stacklevel=2,
            )
        if t.early_stopping is not None and self.valid_ds is None and self.main:
            warnings.warn(
                "train.early_stopping watches the valid split, which this run has none of: it trains every "
                "epoch and keeps the last step's weights; give data.valid or data.valid_fraction (or set "
                "train.early_stopping=null)",
                stacklevel=2,
            )
        stop = t.early_stopping
        if (
            self.main
            and t.ema_decay
            and stop is not None
            and stop.min_delta == 0
            and self.valid_ds is not None
        ):
            warnings.warn(
                "train.ema_decay: an average of the weights can gain a little at every evaluation once the learning "
                "rate is low (Frappe's Wukong: 1e-6 of AUC an evaluation for 500 steps), and early stopping with "
                "min_delta 0 counts each gain, so it may train until train.epochs ends; set "
                "train.early_stopping.min_delta, e.g. 1.0e-5",
                stacklevel=2,
            )
        if self.main:
            _warn_if_weights_far_from_one(self.train_ds, self.pre.schema.weight)
        if self.main and self.init is not None:
            _warn_if_unknown(self.train_ds, self.init.run_dir)
        if t.warmup_steps > self.total_steps and self.main:
            warnings.warn(
                f"train.warmup_steps={t.warmup_steps} is longer than the run's {self.total_steps} steps: the "
                "learning rates never reach their set values; shorten the warm-up",
                stacklevel=2,
            )
        self.progress = Progress()
        if resume:
            self._resume()
        if resume and self.main:  # a resumed run's (allowed) changes, once its checkpoint has loaded
            text, cfg_path = cfg.to_yaml(), self.dir / "config.yaml"
            if not cfg_path.is_file() or cfg_path.read_text() != text:
                atomic_write_text(cfg_path, text)
        self.log = RunLog(self.dir, self.main, self.progress.step if resume else None)
        if resume:
            self.log.truncate(self.progress.step)

    # -------------------------------------------------- setup
    def _prepare_dir(self, resume: bool) -> None:
        check_run_dir(self.dir, self.cfg, resume, self.env.topology)  # before any file is touched
        if self.main:
            self.dir.mkdir(parents=True, exist_ok=True)
            # Until the run ends: a second training into this directory now fails (InUse) rather than mix
            # its config, checkpoints and metrics with this one's.
            self.hold = Hold(self.dir)
            if not resume and (self.dir / "config.yaml").is_file():
                self._discard_attempt()
            if not resume:
                atomic_write_text(self.dir / "config.yaml", self.cfg.to_yaml())

    def _discard_attempt(self) -> None:
        """A new run in the directory of an attempt that never wrote a checkpoint (killed, or failed): its
        logs and kept model go, so the new run's metrics.jsonl, tb/ and best/ hold only the new run."""
        remove_partial_checkpoints(self.dir)
        (self.dir / "metrics.jsonl").unlink(missing_ok=True)
        for name in ("tb", "best"):
            shutil.rmtree(self.dir / name, ignore_errors=True)

    def _prepare_data(self, resume: bool) -> None:
        show = self.cfg.train.progress and self.main and sys.stderr.isatty()
        given = self.init.pre if self.init is not None else None
        self.pre, splits, self.read_stats = prepare_run_data(
            self.cfg.data, self.dir, resume, self.main, show, given=given
        )
        self.train_ds, self.valid_ds, self.test_ds = splits["train"], splits.get("valid"), splits.get("test")
        self.report_ds = splits.get("report")

    def _barrier(self) -> None:
        if self.env.world_size > 1:
            dist.barrier()

    # -------------------------------------------------- checkpoints
    def _state(self) -> dict[str, Any]:
        rng = [rng_state()] * self.env.world_size
        if self.env.world_size > 1:  # every rank's generator, so a resume at the same size is exact
            dist.all_gather_object(rng, rng[0])
        progress = asdict(self.progress)
        if self.env.world_size > 1:  # each rank resumes with the window's loss over all ranks (see fit)
            loss = torch.tensor([progress["window_loss"]], dtype=torch.float64, device=self.env.device)
            dist.all_reduce(loss)
            progress["window_loss"] = loss.item() / self.env.world_size
        return {
            "model": self.module.state_dict(),
            "optim": self.opt.state_dict(),
            "progress": progress,
            "rng": rng,
            **({"ema": self.ema.shadow} if self.ema else {}),
        }

    def save(self, path: Path) -> None:
        save_checkpoint(path, self._state(), rank=self.env.rank)

    def _resume(self) -> None:
        ckpts = list_checkpoints(self.dir / "ckpt")
        if ckpts:
            # Adam's state is created lazily; create it so the checkpoint has tensors to load into.
            self.built.dense.init_state()
            state = load_checkpoint(ckpts[-1], self._state())
            try:  # state.json passed its schema; its values may still not fit (edited by hand)
                self.opt.load_state_dict(state["optim"])
                self.progress = Progress(**state["progress"])
                if self.env.rank < len(state["rng"]):  # at another world size, new ranks keep their seed
                    set_rng_state(state["rng"][self.env.rank])
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                raise CheckpointError(
                    f"{ckpts[-1] / 'state.json'}: does not fit this run ({type(e).__name__}: {str(e)[:120]}); "
                    "the checkpoint is damaged: restore it or delete it"
                ) from None
            if self.progress.step > self.total_steps:  # it would train nothing and report the old model
                t = self.cfg.train
                raise ConfigError(
                    f"the run is at step {self.progress.step}, past the {self.total_steps} steps "
                    f"train.max_steps={t.max_steps} and train.epochs={t.epochs} give; a resume only "
                    "continues a run: give a larger train.max_steps or train.epochs"
                )
            if self.main:
                p, why = self.progress, f"restart {self.env.restart_count} after a failed rank: "
                print(f"{why if self.env.restart_count else ''}resumed from {ckpts[-1]} "
                      f"(step {p.step}, epoch {p.epoch})", file=sys.stderr)  # fmt: skip
        elif self.main:
            print(f"{self.dir}: no complete checkpoint yet; training from the start", file=sys.stderr)
        if self.main:  # forget what a killed attempt did after its last checkpoint; put a set-aside one back
            remove_partial_checkpoints(self.dir)
        self._barrier()
        if ckpts:
            self._catch_up_best()
            self._repatience()

    def _catch_up_best(self) -> None:
        """Write best/ from the checkpoint just loaded if that checkpoint is the best evaluation's and best/
        is not from its step: a kill between the two writes of an improving evaluation (the checkpoint,
        then best/) left it behind. The checkpoint holds the weights best/ would have held."""
        p = self.progress
        if self.cfg.train.early_stopping is None or p.best_step != p.step:
            return
        if saved_step(self.dir / "best") != p.step:
            with self._as_evaluated():
                self._keep_best(p.step)

    def _repatience(self) -> None:
        """Early stopping under the resumed config's patience (a key a resume may change): a run that stopped
        early trains on while it has had fewer evaluations without improvement than the new patience (back
        at its best weights first with ``restore_best``, as that evaluation would have done), and one that has
        had as many stops."""
        p, es = self.progress, self.cfg.train.early_stopping
        if es is None or p.stopped_early == (p.bad_evals >= es.patience):
            return
        p.stopped_early = not p.stopped_early
        if self.main:
            what = "stops" if p.stopped_early else "trains on"
            print(f"early stopping: {p.bad_evals} evaluation(s) without improvement since step {p.best_step}, "
                  f"train.early_stopping.patience={es.patience}: the run {what}", file=sys.stderr)  # fmt: skip
        if not p.stopped_early and es.restore_best and self.load_best() and self.ema:
            self.ema.reset()

    def _keep_best(self, step: int) -> None:
        """Write the model as it is now to best/, as the weights of training step ``step``."""
        save_checkpoint(
            self.dir / "best", {"model": self.module.state_dict(), "step": step}, rank=self.env.rank
        )

    def _as_evaluated(self) -> AbstractContextManager[None]:
        """The model as it evaluates and is kept: with the dense average applied (``train.ema_decay``)."""
        return self.ema.applied() if self.ema else nullcontext()

    def load_best(self) -> bool:
        """Load the best model by the early-stopping metric; False when the run keeps none. Without early
        stopping best/ holds only what ``_calibrate`` wrote at an earlier finish (the weights of then), so a
        resumed run must not go back to it; with it, the model comes back uncalibrated (``_calibrate`` refits)."""
        best = self.dir / "best"
        if self.cfg.train.early_stopping is not None and (best / ".metadata").is_file():
            load_checkpoint(best, {"model": self.module.state_dict()})
            self._uncalibrate()  # an earlier finish's Platt scaling: training goes on without it
            return True
        return False

    def _init_report(self) -> dict[str, Any]:
        """A warm start's source (after a resume from its own checkpoint, which reads none, the run named only)."""
        return self.init.report(self.train_ds) if self.init else {"run": self.cfg.train.init_from}

    def _uncalibrate(self) -> None:
        """Drop the Platt scaling a finished run stored in the model: weights trained on are uncalibrated."""
        for c in self.module.modules():
            if isinstance(c, Calibration):
                c.set(1.0, 0.0)

    # -------------------------------------------------- the step
    def _recording(self) -> AbstractContextManager[None]:
        return self.comm.recording() if self.cfg.distributed.count_bytes else nullcontext()

    def train_step(self, batch: Batch, global_size: int | None = None) -> torch.Tensor:
        """One optimisation step on this rank's part of the global batch (already on the device):
        learning rates for the step, forward, loss (+ embedding L2), backward, dense clipping, both
        optimizers, table decay, the dense average; advances the step counters. Returns the loss, each
        row's weighted by ``batch.weights`` if it has them.

        ``global_size``: the global batch's size when ranks hold unequal parts of it (balanced): the
        loss is then this rank's sum × world / global_size, so the ranks' mean (DDP) is the global mean,
        as with equal slices; None: equal slices, the loss is this rank's mean."""
        t, p = self.cfg.train, self.progress
        t0 = time.perf_counter()
        f = lr_factor(t, p.step, self.total_steps) * p.lr_scale
        for g, lr in zip(self.built.dense.param_groups, self.base_lrs, strict=True):
            g["lr"] = lr * f
        # The fused optimizer hands its lr to fbgemm in zero_grad(), and fbgemm's CPU kernel takes it at the
        # forward, not the backward: zeroed after the forward, a step updated the tables with the previous
        # step's lr (after a resume, the configured lr, not the reduced one the run was at).
        for g, lr in zip(self.built.tables.param_groups, self.sparse_base_lrs, strict=True):
            g["lr"] = lr * p.lr_scale
        self.opt.zero_grad()
        with self._recording():
            with autocast(t.precision, self.env.device):
                logits = self.module(batch.dense, batch.sparse).float()
            if self.logit_offset:  # negative downsampling's shift, in the loss only
                logits = logits + self.logit_offset
            # Row weights scale each row's loss and keep the denominator the rows: sum(w * l) / rows, so weights
            # of 1 are the unweighted loss bit for bit, and a row of weight 2 counts as that row twice.
            bce = nn.functional.binary_cross_entropy_with_logits
            if global_size is None:
                per_rank: float = batch.size
                loss = bce(logits, batch.labels, weight=batch.weights)
            else:
                per_rank = global_size / self.env.world_size
                loss = bce(logits, batch.labels, weight=batch.weights, reduction="sum") / per_rank
            objective = loss if self.l2 is None else loss + self.l2(per_rank)
            objective.backward()
            if t.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(self.dense_params, t.grad_clip)
            self.opt.step()
            if self.decay is not None:
                self.decay(self.sparse_base_lrs[0] * p.lr_scale)
            if self.ema:
                self.ema.update(p.step + 1)
        p.train_seconds += time.perf_counter() - t0
        p.step += 1
        p.examples += batch.size * self.env.world_size if global_size is None else global_size
        return loss.detach()

    # -------------------------------------------------- the loop
    def fit(self) -> dict[str, Any]:
        try:
            report = self._fit()
        except BaseException:
            self._release(failed=True)
            raise
        self._release()
        return report

    def _fit(self) -> dict[str, Any]:
        t, p = self.cfg.train, self.progress
        if self.steps_per_epoch == 0:
            raise RecscaleError(
                f"train.batch_size {t.batch_size} is larger than the training set ({len(self.train_ds)} rows)"
            )
        # A bar only on a terminal: redirected to a log, it would print a line per refresh.
        shown = t.progress and self.main and sys.stderr.isatty()
        bar = progress_bar(shown, "train", "step", self.total_steps, initial=p.step, leave=True)
        try:
            # The log window may have begun before a resume (Progress.window_*); the byte counters have
            # counted only the steps of this process since the last log (``counted``).
            counted, last = 0, time.perf_counter()
            done = p.step >= self.total_steps or p.stopped_early
            self.module.train()
            while not done and p.epoch < t.epochs:
                for batch, global_size in self._epoch():
                    # After a resume every rank holds the window's loss so far over all ranks (_state): their
                    # sum over ranks, divided by the world size, is still the sum of the steps' mean losses.
                    p.window_loss += self.train_step(batch.to(self.env.device), global_size).item()
                    now = time.perf_counter()
                    p.window_steps, p.window_seconds = p.window_steps + 1, p.window_seconds + now - last
                    counted, last = counted + 1, now
                    p.batch += 1
                    if bar is not None:
                        bar.update(1)
                    heartbeat(p.step)  # lets a peer that times out name this rank if it hangs
                    if p.step % t.log_every == 0:
                        loss = self._log_window(counted)
                        if bar is not None:
                            bar.set_postfix(loss=f"{loss:.4f}")
                        counted = 0
                        if not math.isfinite(loss):
                            self.diverged_at = p.step
                    if p.batch >= self.steps_per_epoch:  # end of epoch
                        p.epoch, p.batch = p.epoch + 1, 0
                    hit_max = p.step >= self.total_steps
                    evaluates = (t.eval_every and p.step % t.eval_every == 0) or p.batch == 0 or hit_max
                    if evaluates and self.diverged_at is None and not self._window_finite():
                        self.diverged_at = p.step
                    if self.diverged_at is not None:  # no checkpoint of NaN weights: the last one stays good
                        done = True
                        break
                    if evaluates:
                        if self._evaluate_and_checkpoint() or hit_max:
                            done = True
                            break
                        self.module.train()
                        last = time.perf_counter()  # a window's rate is training's: evaluation left out
        finally:
            if bar is not None:
                bar.close()  # before any error line, so it does not land on the bar's line
        return self.finish()

    def _epoch(self) -> Iterator[tuple[Batch, int | None]]:
        """This rank's batches of the current epoch, from the position the run is at, each with the
        global batch's size when the ranks' parts are balanced (unequal), else None."""
        t, p, env = self.cfg.train, self.progress, self.env
        n, balance = len(self.train_ds), self.cfg.distributed.balance
        balanced = balance != "none" and env.world_size > 1
        batches = epoch_batches(
            n, t.batch_size, seed=self.cfg.seed, epoch=p.epoch, drop_last=n >= t.batch_size,
            rank=0 if balanced else env.rank, world_size=1 if balanced else env.world_size,
        )[p.batch :]  # fmt: skip
        # A training split smaller than the global batch is one batch the ranks hold unequal parts of:
        # like a balanced one, it needs its global size for the loss to be the global mean.
        partial = n < t.batch_size and env.world_size > 1
        sizes: list[int | None] = [len(b) if balanced else (n if partial else None) for b in batches]
        if balanced:
            names = [f.name for f in self.pre.schema.sparse if f.sequence]
            cost = cost_model(balance, self.built.model, self.built.flops_per_example, names)
            batches = [
                b[balanced_parts(self.train_ds.lengths(b, names), cost, env.world_size)[env.rank]]
                for b in batches
            ]
        return zip(iterate(self.train_ds, batches, self.cfg.data.num_workers), sizes, strict=True)

    def _window_finite(self) -> bool:
        """Whether the loss of the open log window is finite on every rank (a diverged run's is NaN or inf).
        Asked where every rank is (before an evaluation), so the ranks stop together."""
        loss = torch.tensor([self.progress.window_loss], dtype=torch.float64)
        if self.env.world_size > 1:
            loss = loss.to(self.env.device)
            dist.all_reduce(loss)
        return math.isfinite(loss.item())

    def _log_window(self, counted: int) -> float:
        """Log the window of steps that ends now (``Progress.window_*``): mean loss over all ranks,
        examples/s, bytes per step of the ``counted`` steps the byte counters saw; returns the loss."""
        p = self.progress
        local = torch.cat([torch.tensor([p.window_loss], dtype=torch.float64), self.comm.totals().flatten()])
        if self.env.world_size > 1:
            local = local.to(self.env.device)  # NCCL reduces device tensors only
            dist.all_reduce(local)
            local = local.cpu()
        self.comm.reset()
        steps = p.window_steps
        mean_loss = local[0].item() / (steps * self.env.world_size)
        per_step = min(self.cfg.train.batch_size, len(self.train_ds))  # a training split under one batch
        record = {"split": "train", "step": p.step, "epoch": p.epoch, "loss": mean_loss,
                  "lr": self.built.dense.param_groups[0]["lr"],
                  "examples_per_s": steps * per_step / p.window_seconds}  # fmt: skip
        if self.cfg.distributed.count_bytes:
            record |= comms.summarize(local[1:].view(-1, 2), counted)
        self.log(record)
        p.window_loss, p.window_steps, p.window_seconds = 0.0, 0, 0.0
        return mean_loss

    def _evaluate_and_checkpoint(self) -> bool:
        """Evaluate on valid, update early stopping, checkpoint. Returns True when training should stop."""
        p, t = self.progress, self.cfg.train
        es, stop, improved, restore = t.early_stopping, False, False, False
        if self.valid_ds is not None:
            with self._as_evaluated():
                m = self._evaluate(self.valid_ds)
            improved = es is not None and p.improves(m, es)
            self.log({"split": "valid", "step": p.step, "epoch": p.epoch, **m})
            if es is not None:
                if self.main and not self.said_watched and watched_metric(m, es) != es.metric:
                    self.said_watched = True
                    why = (
                        f"no {t.group_by} of its rows the run knows holds both classes"
                        if es.metric == "gauc"
                        else f"whose {rows_are(int(m['rows']))} of one class"
                    )
                    warnings.warn(
                        f"train.early_stopping.metric={es.metric} is undefined on the valid split, {why}: early "
                        "stopping compares LogLoss instead; give valid rows of both classes to stop on the "
                        "metric asked for",
                        stacklevel=2,
                    )
                restore = p.record_eval(m, improved, es)
                stop = p.stopped_early
                if self.main and not stop:
                    self._warn_if_decay_rounds_away()
        if restore and self.load_best() and self.ema:
            self.ema.reset()
        self.save(self.dir / "ckpt" / f"step_{p.step:08d}")
        # best/ after the checkpoint, never before: a kill between the two then leaves best/ behind the
        # progress of the checkpoint a resume starts from, which brings it up to date (_catch_up_best).
        # Written first, best/ got ahead of it: a resume went back to weights its progress knew nothing of.
        if improved:
            with self._as_evaluated():
                self._keep_best(p.step)
        if self.main:
            prune_checkpoints(self.dir / "ckpt", t.keep_checkpoints)
        return stop

    def _warn_if_decay_rounds_away(self) -> None:
        """Once, when an LR drop takes fp16 tables' decay under what they resolve (the config's check sees
        only the configured LR)."""
        t, was = self.cfg.train, self.decay_resolved
        shrink = self.sparse_base_lrs[0] * self.progress.lr_scale * t.table_weight_decay
        self.decay_resolved = self.cfg.model.embedding.storage != "fp16" or not 0 < shrink < FP16_SHRINK
        if was and not self.decay_resolved:
            warnings.warn(
                f"train.table_weight_decay: after the learning-rate drop at step {self.progress.step} the "
                f"shrink per step is {shrink:.2g}, under what fp16 tables resolve ({FP16_SHRINK:.2g}): "
                "from here on it rounds away; use model.embedding.storage=fp32 to keep decaying",
                stacklevel=2,
            )

    def _evaluate(self, ds: ArrayDataset) -> dict[str, float]:
        t = self.cfg.train
        return evaluate(
            self.module, ds, eval_batch_size(t.batch_size), self.cfg.data.num_workers, t.precision, t.group_by
        )

    def _calibrate(self, step: int) -> tuple[dict[str, float], dict[str, float]]:
        """Fit the kept model's Platt scaling on the valid split and keep it in best/ (``train.calibrate``),
        as the weights of ``step``; returns it and the calibrated model's valid metrics (from the same
        logits: valid is scored once)."""
        assert self.valid_ds is not None  # the config requires a valid split (RunConfig)
        layers = [m for m in self.module.modules() if isinstance(m, Calibration)]
        for c in layers:  # from the identity, also when a finished run is finished again
            c.set(1.0, 0.0)
        t = self.cfg.train
        logits = predict(self.module, self.valid_ds, eval_batch_size(t.batch_size), self.cfg.data.num_workers,
                         t.precision)  # fmt: skip
        labels = torch.from_numpy(self.valid_ds.labels().copy())
        weights = self.valid_ds.weights()
        a, b = layers[0].fit(logits, labels, None if weights is None else torch.from_numpy(weights.copy()))
        for c in layers[1:]:
            c.set(a, b)
        self._keep_best(step)
        calibrated = scored(layers[0](logits), self.valid_ds, t.group_by)
        fitted_on = {"rows": len(self.valid_ds)} | (
            {} if weights is None else {"weight_sum": float(weights.sum(dtype=np.float64))}
        )
        return {"scale": a, "bias": b, **fitted_on}, calibrated

    def finish(self) -> dict[str, Any]:
        p = self.progress
        kept = self.load_best()
        if not kept and self.ema:  # no best kept: report the average, as evaluated
            self.ema.apply()
        # Not of diverged weights: best/ would keep a NaN model as the one to ship.
        calibrate = self.cfg.train.calibrate and (kept or self.diverged_at is None)
        calibration, calibrated_valid = (
            self._calibrate(p.best_step if kept else p.step) if calibrate else (None, None)
        )
        report: dict[str, Any] = {
            "run_dir": str(self.dir.resolve()),
            "model": self.cfg.model.name,
            "parameters": self.built.parameters,
            "mflops_per_example": self.built.flops_per_example / 1e6,
            "steps": p.step,
            "examples": p.examples,
            "epochs_completed": p.epoch,
            # The step of the model the report scores: the last one where no best is kept (no valid split, or
            # no early stopping), not the 0 the progress starts from.
            "best_step": p.best_step if kept else p.step,
            "stopped_early": p.stopped_early,
            "train_seconds": round(p.train_seconds, 2),
            "examples_per_s": round(p.examples / p.train_seconds, 1) if p.train_seconds else None,
            **({"init_from": self._init_report()} if self.cfg.train.init_from else {}),
            "skipped_rows": {k: s.skipped for k, s in self.read_stats.items() if s.skipped},
            # Rows whose sequence features were cut to max_len (the most recent ids kept), per split.
            "truncated_sequences": {k: s.truncated for k, s in self.read_stats.items() if s.truncated},
            # A seed reproduces a run bit for bit only at the same thread count: sums in another
            # order can move the step early stopping keeps.
            "torch_threads": torch.get_num_threads(),
        }
        if self.diverged_at is not None:  # training stopped there: its loss was NaN or infinite
            report["diverged_at_step"] = self.diverged_at
        if calibration is not None:
            report["calibration"] = calibration
        if (
            self.cfg.data.negative_sampling_rate is not None
        ):  # the rows trained on: every positive, w of negatives
            weights = self.train_ds.weights()
            report["negative_sampling"] = {
                "rate": self.cfg.data.negative_sampling_rate,
                "train_rows": len(self.train_ds),
                **({} if weights is None else {"train_weight_sum": float(weights.sum(dtype=np.float64))}),
            }
        if self.valid_ds is not None:
            report["valid"] = calibrated_valid or self._evaluate(self.valid_ds)
        if self.report_ds is not None:  # valid rows no selection decision saw
            report["report"] = self._evaluate(self.report_ds)
        if self.test_ds is not None:
            report["test"] = self._evaluate(self.test_ds)
        if self.cfg.data.format == "synthetic" and self.cfg.data.synthetic is not None:
            split = "valid" if self.valid_ds is not None else "train"
            # Its NE on the whole split its LogLoss is over: not valid's selection half, nor the rows
            # negative sampling kept (whose CTR is higher).
            whole = ArrayDataset((self.valid_ds or self.train_ds).dir)
            report |= bayes_floor(self.cfg.data.synthetic, split, whole)
        if self.main:
            atomic_write_text(self.dir / "report.json", strict_json(report, indent=2))
        self.log.close()
        if self.main:
            self.hold.release()
        if dist.is_initialized():
            dist.barrier()
        return report
