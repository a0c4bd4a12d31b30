"""The training loop: one config in, a trained run directory and a report out.

    prepare data (fit preprocessing on train, materialise splits)
    build model -> TorchRec DistributedModelParallel (tables sharded, fused optimizer in backward)
    for each epoch, for each batch: forward, BCE loss, backward, clip, step; eval; early stop; checkpoint
    restore the best weights, final evaluation, report

Run directory::

    config.yaml         the resolved config
    preprocess.json     the fitted preprocessing artifact
    data/{split}/       materialised splits (a cache; safe to delete)
    metrics.jsonl       one JSON object per logged train window and per evaluation
    tb/                 TensorBoard logs
    ckpt/step_N/        checkpoints (model, optimizers, data position, RNG)
    best/               the best model by the early-stopping metric
    report.json         the final report
"""

from __future__ import annotations

import base64
import json
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from recscale.config import (
    RESUMABLE_KEYS,
    DataConfig,
    DistributedConfig,
    RunConfig,
    apply_overrides,
    load_config,
    read_yaml_mapping,
    resume_changes,
    validate_config,
)
from recscale.data.dataset import ArrayDataset, epoch_batches, iterate, materialize, read_meta
from recscale.data.preprocess import Preprocessor
from recscale.data.readers import ReadStats
from recscale.data.sources import open_split, source_fingerprint
from recscale.distributed import comms
from recscale.distributed.env import DistEnv, init_distributed
from recscale.distributed.gather import eval_batches, gather_scores
from recscale.distributed.sharding import shard_model
from recscale.errors import CheckpointError, ConfigError, DataError, RecscaleError, StaleArtifactError
from recscale.io import atomic_write_text
from recscale.models.embedding import FeatureSet, SparseInput
from recscale.models.registry import build_model
from recscale.train.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    remove_partial_checkpoints,
    save_checkpoint,
)
from recscale.train.metrics import binary_entropy, ctr_metrics
from recscale.train.optim import dense_optimizer_factory, lr_factor, sparse_optimizer

HIGHER_IS_BETTER = {"auc": True, "logloss": False, "ne": False}


# ---------------------------------------------------------------- data
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


def _syn(data: DataConfig) -> Any:
    return data.synthetic.model_dump() if data.synthetic is not None else None


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


def feature_set(pre: Preprocessor) -> FeatureSet:
    sparse = tuple(
        SparseInput(f.name, pre.num_embeddings(f.name), "mean" if f.multi else "sum", f.weighted)
        for f in pre.schema.sparse
    )
    return FeatureSet(sparse=sparse, num_dense=len(pre.schema.dense))


# ---------------------------------------------------------------- model
def count_parameters(model: nn.Module) -> dict[str, int]:
    """Dense and sparse (embedding table) parameter counts of the unsharded model."""
    ebc = model.embedding.ebc
    sparse = sum(c.num_embeddings * c.embedding_dim for c in ebc.embedding_bag_configs())
    table_ids = {id(p) for p in ebc.parameters()}
    dense = sum(p.numel() for p in model.parameters() if id(p) not in table_ids)
    return {"dense": int(dense), "sparse": int(sparse)}


def build_dmp(
    cfg: RunConfig, pre: Preprocessor, env: DistEnv
) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    """The model sharded by TorchRec, and one optimizer over fused (tables) and dense parameters.

    The unsharded model's parameter counts are kept as ``dmp.recscale_parameters``. With a ``dmt``
    section the model is DMT's (towers per host) instead.
    """
    if cfg.dmt is not None:
        from recscale.distributed.dmt.build import build_dmt

        return build_dmt(cfg, feature_set(pre), env)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model.name, feature_set(pre), cfg.model.embedding, cfg.model.params)
    counts = count_parameters(model)
    opt_cls, opt_kw = sparse_optimizer(cfg.train.sparse_optimizer, env.device, cfg.dense_tables())
    table_kw = dict(opt_kw)  # apply_optimizer_in_backward adds its own keys to opt_kw
    apply_optimizer_in_backward(opt_cls, model.embedding.ebc.parameters(), opt_kw)
    dmp, tables = shard_model(model, env, cfg.distributed, (opt_cls, table_kw))
    dense = KeyedOptimizerWrapper(
        {n: q for n, q in in_backward_optimizer_filter(dmp.named_parameters()) if n not in tables.params},
        dense_optimizer_factory(cfg.train.dense_optimizer),
    )
    dmp.recscale_parameters = counts
    return dmp, CombinedOptimizer([tables, dense])


def unwrap(dmp: DistributedModelParallel) -> nn.Module:
    """The user's model inside DMP (and DDP); a DMT model is its own."""
    if not isinstance(dmp, DistributedModelParallel):
        return dmp
    m = dmp.module
    return m.module if hasattr(m, "module") and not hasattr(m, "embedding") else m


def local_tensors(w: torch.Tensor) -> list[torch.Tensor]:
    """A table's tensors on this rank: its local shards, or the (replicated) table itself."""
    return [x.tensor for x in w.local_shards()] if isinstance(w, ShardedTensor) else [w.data]


class EmbeddingL2:
    """``train.embedding_l2``: λ·Σ‖x‖²/B over the embedding vectors X0 of the latest forward (B: this
    rank's samples), added to the loss; it regularises the looked-up rows, frequent ids more. X0 is
    the embedding layer's output, or for a DMT model the parts it names (``x0_sources``: module and
    weight of its squared norm, chosen so the tables get the flat model's gradient)."""

    def __init__(self, model: nn.Module, weight: float) -> None:
        self.weight = weight
        self.parts: dict[int, tuple[torch.Tensor, float]] = {}
        sources = model.x0_sources() if hasattr(model, "x0_sources") else [(model.embedding, 1.0)]
        for i, (module, scale) in enumerate(sources):
            module.register_forward_hook(lambda m, x, out, i=i, s=scale: self.parts.__setitem__(i, (out, s)))

    def __call__(self, batch_size: int) -> torch.Tensor:
        return self.weight * sum(s * x.square().sum() for x, s in self.parts.values()) / batch_size


def trainable_dense(opt: CombinedOptimizer) -> dict[str, torch.Tensor]:
    """The dense optimizer's trainable parameters by name (the tables are in the fused one)."""
    return {k: q for k, q in opt.optimizers[1][1].params.items() if q.requires_grad}


class DenseEMA:
    """``train.ema_decay``: an exponential moving average of the dense weights, updated after every
    step with decay min(decay, (1 + n) / (10 + n)) at step n, so early averages are not dominated by the
    initialisation (n is the run's step count, so a resumed run averages as the uninterrupted one).
    ``applied()`` swaps it into the model (for evaluation and the best checkpoint)."""

    def __init__(self, params: dict[str, torch.Tensor], decay: float) -> None:
        self.params, self.decay = params, decay
        self.shadow = {k: p.detach().clone() for k, p in params.items()}

    @torch.no_grad()
    def update(self, step: int) -> None:
        d = min(self.decay, (1 + step) / (10 + step))
        torch._foreach_lerp_(list(self.shadow.values()), [p.detach() for p in self.params.values()], 1 - d)

    @torch.no_grad()
    def reset(self) -> None:
        """Average from the model's current weights on (after they were replaced, e.g. by the best)."""
        torch._foreach_copy_(list(self.shadow.values()), list(self.params.values()))

    @torch.no_grad()
    def apply(self, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Put the average (or ``weights``) into the model."""
        src = weights or self.shadow
        torch._foreach_copy_(list(self.params.values()), [src[k] for k in self.params])

    @contextmanager
    def applied(self) -> Iterator[None]:
        raw = {k: p.detach().clone() for k, p in self.params.items()}
        self.apply()
        try:
            yield
        finally:
            self.apply(raw)


@torch.no_grad()  # not inference_mode: gloo collectives fail inside it
def predict(
    dmp: DistributedModelParallel, ds: ArrayDataset, batch_size: int, num_workers: int
) -> torch.Tensor:
    """Logits (N,) for every row of ``ds`` in order, on every rank (each rank scores a slice)."""
    was_training = dmp.training
    dmp.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    device = next(dmp.parameters()).device
    for b in iterate(ds, eval_batches(len(ds), batch_size, rank, world), num_workers):
        out.append(dmp(b.dense.to(device), b.sparse.to(device)).float())
    dmp.train(was_training)
    return gather_scores(torch.cat(out), len(ds), batch_size, world).cpu()  # gathered on the device (NCCL)


def evaluate(
    dmp: DistributedModelParallel, ds: ArrayDataset, batch_size: int, num_workers: int
) -> dict[str, float]:
    return ctr_metrics(predict(dmp, ds, batch_size, num_workers), torch.from_numpy(ds.labels().copy()))


# ---------------------------------------------------------------- state
@dataclass
class Progress:
    """Where the run is: enough, with the checkpointed tensors, to continue exactly."""

    epoch: int = 0
    batch: int = 0  # batches of this epoch already trained
    step: int = 0
    best: float | None = None
    best_step: int = 0
    bad_evals: int = 0
    lr_scale: float = 1.0  # reduced on plateau
    train_seconds: float = 0.0
    examples: int = 0
    stopped_early: bool = False


def _rng_state() -> dict[str, str]:
    return {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}


def _set_rng_state(s: dict[str, str]) -> None:
    torch.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(s["torch"]), dtype=np.uint8).copy()))


class Trainer:
    """Trains one config into one run directory."""

    def __init__(self, cfg: RunConfig, run_dir: Path, resume: bool = False) -> None:
        self.cfg, self.dir = cfg, Path(run_dir)
        self.env = init_distributed(cfg.distributed.timeout_s)
        self.main = self.env.is_main
        if cfg.train.batch_size % self.env.world_size:
            raise ConfigError(
                f"train.batch_size {cfg.train.batch_size} must be a multiple of the {self.env.world_size} "
                "ranks: each rank trains on an equal slice of the global batch"
            )
        # Restarted by torchrun (--max-restarts): continue from the last complete checkpoint.
        resume = resume or (self.env.restart_count > 0 and (self.dir / "config.yaml").is_file())
        created = not self.dir.exists()
        try:
            self._setup(resume)
        except BaseException:
            if created and self.main:  # a run that never started leaves no directory behind
                shutil.rmtree(self.dir, ignore_errors=True)
            raise

    def _setup(self, resume: bool) -> None:
        cfg = self.cfg
        self._prepare_dir(resume)
        # Rank 0 preprocesses; the others wait, then find its artifacts and materialised splits.
        if not self.main:
            self._barrier()
        self._prepare_data(resume)
        if self.main:
            self._barrier()
        self.dmp, self.opt = build_dmp(cfg, self.pre, self.env)
        if cfg.train.compile:  # the dense part only: TorchRec's sharded lookups and KJTs do not trace well
            model = unwrap(self.dmp)
            model.interact = torch.compile(model.interact)
        comms.install()
        self.comm = comms.CommMeter(self.env.topology, self.env.rank)
        self.base_lrs = [g["lr"] for g in self.opt.optimizers[1][1].param_groups]
        self.sparse_base_lrs = [g["lr"] for g in self.opt.optimizers[0][1].param_groups]
        # For table_weight_decay: the tables' storage on this rank (shards are views of the fused weights).
        self.table_shards = [x for w in self.opt.optimizers[0][1].params.values() for x in local_tensors(w)]
        self.l2 = (
            EmbeddingL2(unwrap(self.dmp), cfg.train.embedding_l2) if cfg.train.embedding_l2 > 0 else None
        )
        self.ema = DenseEMA(trainable_dense(self.opt), cfg.train.ema_decay) if cfg.train.ema_decay else None
        self.progress = Progress()
        if resume:
            self._resume()
        if self.main:  # a resumed run's (allowed) changes are recorded once its checkpoint has loaded
            text, cfg_path = cfg.to_yaml(), self.dir / "config.yaml"
            if not cfg_path.is_file() or cfg_path.read_text() != text:
                atomic_write_text(cfg_path, text)

    # -------------------------------------------------- setup
    def _prepare_dir(self, resume: bool) -> None:
        cfg_path = self.dir / "config.yaml"
        if self.dir.exists() and not self.dir.is_dir():
            raise RecscaleError(f"--out {self.dir} is a file; name a directory for the run")
        if resume:
            check_resume(self.dir, self.cfg)  # before any file is touched
        elif list_checkpoints(self.dir / "ckpt") or (self.dir / "report.json").exists():
            raise RecscaleError(
                f"{self.dir} already holds a run; pass --resume to continue it or choose another --out"
            )
        if self.main:
            self.dir.mkdir(parents=True, exist_ok=True)
            if not resume:
                atomic_write_text(cfg_path, self.cfg.to_yaml())

    def _prepare_data(self, resume: bool) -> None:
        """Fit the preprocessing (or reuse the run's, if fitted on the same training data) and
        materialise the splits; ``preprocess.json`` is written last, so a failed preparation never
        leaves an artifact that a later run would take for finished work."""
        data, show = self.cfg.data, self.cfg.train.progress and self.main and sys.stderr.isatty()
        pre_path = self.dir / "preprocess.json"
        fingerprint = train_fingerprint(data)
        self.read_stats: dict[str, ReadStats] = {}
        fitted = False
        try:
            self.pre = Preprocessor.load(pre_path, expect_fingerprint=fingerprint)
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
            self.pre = fit_preprocessor(data)
        self.train_ds, self.read_stats["train"] = prepare_split(
            data, self.pre, "train", data.train, self.dir / "data" / "train", show
        )
        self.valid_ds = None
        if data.valid is not None or data.format == "synthetic":
            self.valid_ds, self.read_stats["valid"] = prepare_split(
                data, self.pre, "valid", data.valid, self.dir / "data" / "valid", show
            )
        self.test_ds = None
        if data.test is not None or data.format == "synthetic":
            self.test_ds, self.read_stats["test"] = prepare_split(
                data, self.pre, "test", data.test, self.dir / "data" / "test", show
            )
        if fitted and self.main:
            self.pre.save(pre_path, fingerprint=fingerprint)

    def _barrier(self) -> None:
        if self.env.world_size > 1:
            dist.barrier()

    # -------------------------------------------------- checkpoints
    def _state(self) -> dict[str, Any]:
        rng = [_rng_state()] * self.env.world_size
        if self.env.world_size > 1:  # every rank's generator, so a resume at the same size is exact
            dist.all_gather_object(rng, rng[0])
        return {
            "model": self.dmp.state_dict(),
            "optim": self.opt.state_dict(),
            "progress": asdict(self.progress),
            "rng": rng,
            **({"ema": self.ema.shadow} if self.ema else {}),
        }

    def save(self, path: Path) -> None:
        save_checkpoint(path, self._state(), rank=self.env.rank)

    def _resume(self) -> None:
        ckpts = list_checkpoints(self.dir / "ckpt")
        if ckpts:
            # Adam's state is created lazily; create it so the checkpoint has tensors to load into.
            self.opt.optimizers[1][1].init_state()
            state = load_checkpoint(ckpts[-1], self._state())
            self.opt.load_state_dict(state["optim"])
            self.progress = Progress(**state["progress"])
            if self.env.rank < len(state["rng"]):  # at another world size, new ranks keep their seed
                _set_rng_state(state["rng"][self.env.rank])
            if self.main:
                why = f"restart {self.env.restart_count} after a failed rank: " if self.env.restart_count else ""
                print(f"{why}resumed from {ckpts[-1]} (step {self.progress.step}, epoch {self.progress.epoch})",
                      file=sys.stderr)  # fmt: skip
        elif self.main:
            print(f"{self.dir}: no complete checkpoint yet; training from the start", file=sys.stderr)
        if self.main:  # forget what a killed attempt did after its last checkpoint
            remove_partial_checkpoints(self.dir)
            self._truncate_metrics(self.progress.step)
        self._barrier()

    def _truncate_metrics(self, step: int) -> None:
        path = self.dir / "metrics.jsonl"
        if not path.is_file():
            return
        keep = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line + "\n")
            except json.JSONDecodeError:  # a line cut short by the kill
                continue
        atomic_write_text(path, "".join(keep))

    def load_best(self) -> bool:
        best = self.dir / "best"
        if (best / ".metadata").is_file():
            load_checkpoint(best, {"model": self.dmp.state_dict()})
            return True
        return False

    # -------------------------------------------------- loop
    def _log(self, record: dict[str, Any]) -> None:
        if not self.main:
            return
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, int | float) and k not in ("step", "epoch"):
                    self.tb.add_scalar(f"{record.get('split', 'train')}/{k}", v, record["step"])

    def _evaluate_and_checkpoint(self) -> bool:
        """Evaluate on valid, update early stopping, checkpoint. Returns True when training should stop."""
        p, t = self.progress, self.cfg.train
        es, stop, improved, restore = t.early_stopping, False, False, False
        if self.valid_ds is not None:
            with self.ema.applied() if self.ema else nullcontext():  # the averaged weights are the model
                m = evaluate(self.dmp, self.valid_ds, self._eval_batch(), self.cfg.data.num_workers)
                if es is not None:
                    sign = 1 if HIGHER_IS_BETTER[es.metric] else -1
                    improved = p.best is None or sign * (m[es.metric] - p.best) > es.min_delta
                if improved:
                    save_checkpoint(self.dir / "best", {"model": self.dmp.state_dict()}, rank=self.env.rank)
            self._log({"split": "valid", "step": p.step, "epoch": p.epoch, **m})
            if es is not None:
                if improved:
                    p.best, p.best_step, p.bad_evals = m[es.metric], p.step, 0
                else:
                    p.bad_evals += 1
                    stop = p.bad_evals >= es.patience
                    if es.reduce_lr_factor is not None:
                        p.lr_scale *= es.reduce_lr_factor
                    restore = es.restore_best and not stop
                    p.stopped_early = stop
        if restore and self.load_best() and self.ema:
            self.ema.reset()
        self.save(self.dir / "ckpt" / f"step_{p.step:08d}")
        if self.main:
            prune_checkpoints(self.dir / "ckpt", t.keep_checkpoints)
        return stop

    def _window_totals(self, loss_sum: float, steps: int) -> tuple[float, dict[str, Any]]:
        """The window's mean loss over all ranks and its communication per step; resets the meter."""
        local = torch.cat([torch.tensor([loss_sum], dtype=torch.float64), self.comm.totals().flatten()])
        if self.env.world_size > 1:
            local = local.to(self.env.device)  # NCCL reduces device tensors only
            dist.all_reduce(local)
            local = local.cpu()
        self.comm.reset()
        world = self.env.world_size
        return local[0].item() / (steps * world), comms.summarize(local[1:].view(-1, 2), steps)

    def _eval_batch(self) -> int:
        return max(self.cfg.train.batch_size, 8192)

    def fit(self) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        t, p = self.cfg.train, self.progress
        self.tb = SummaryWriter(str(self.dir / "tb")) if self.main else None
        n = len(self.train_ds)
        steps_per_epoch = n // t.batch_size + (1 if n % t.batch_size and n < t.batch_size else 0)
        if steps_per_epoch == 0:
            raise RecscaleError(f"train.batch_size {t.batch_size} is larger than the training set ({n} rows)")
        total = min(t.epochs * steps_per_epoch, t.max_steps or 10**18)
        # A bar only on a terminal: redirected to a log, it would print a line per refresh.
        bar = tqdm(
            total=total, initial=p.step, desc="train", unit="step",
            disable=not (t.progress and self.main and sys.stderr.isatty()),
        )  # fmt: skip
        try:
            self._train(bar, total, n)
        finally:
            bar.close()  # before any error line, so it does not land on the bar's line
        return self.finish()

    def _train(self, bar: Any, total: int, n: int) -> None:
        cfg, t, p = self.cfg, self.cfg.train, self.progress
        sparse_opt, dense_opt = self.opt.optimizers[0][1], self.opt.optimizers[1][1]
        dense_params = list(trainable_dense(self.opt).values())
        window_loss, window_n, window_t = 0.0, 0, time.perf_counter()
        done = p.step >= total or p.stopped_early
        self.dmp.train()
        while not done and p.epoch < t.epochs:
            batches = epoch_batches(
                n, t.batch_size, shuffle=True, seed=cfg.seed, epoch=p.epoch, drop_last=n >= t.batch_size,
                rank=self.env.rank, world_size=self.env.world_size,
            )  # fmt: skip
            for batch in iterate(self.train_ds, batches[p.batch :], cfg.data.num_workers):
                batch = batch.to(self.env.device)
                t0 = time.perf_counter()
                f = lr_factor(t, p.step, total) * p.lr_scale
                for g, lr in zip(dense_opt.param_groups, self.base_lrs, strict=True):
                    g["lr"] = lr * f
                # The fused optimizer hands its lr to fbgemm in zero_grad(), before this backward.
                for g, lr in zip(sparse_opt.param_groups, self.sparse_base_lrs, strict=True):
                    g["lr"] = lr * p.lr_scale
                with self.comm.recording():
                    logits = self.dmp(batch.dense, batch.sparse)
                    loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
                    objective = loss
                    if self.l2 is not None:
                        objective = loss + self.l2(batch.size)
                    self.opt.zero_grad()
                    objective.backward()
                    if t.grad_clip is not None:
                        torch.nn.utils.clip_grad_norm_(dense_params, t.grad_clip)
                    self.opt.step()
                    if t.table_weight_decay:
                        shrink = 1 - self.sparse_base_lrs[0] * p.lr_scale * t.table_weight_decay
                        for w in self.table_shards:
                            w.mul_(shrink)
                    if self.ema:
                        self.ema.update(p.step + 1)
                p.train_seconds += time.perf_counter() - t0
                p.step += 1
                p.batch += 1
                p.examples += batch.size * self.env.world_size
                window_loss += loss.item()
                window_n += 1
                bar.update(1)
                if p.step % t.log_every == 0:
                    now = time.perf_counter()
                    rate = window_n * t.batch_size / (now - window_t)
                    mean_loss, comm = self._window_totals(window_loss, window_n)
                    self._log({"split": "train", "step": p.step, "epoch": p.epoch, "loss": mean_loss,
                               "lr": dense_opt.param_groups[0]["lr"], "examples_per_s": rate, **comm})  # fmt: skip
                    bar.set_postfix(loss=f"{mean_loss:.4f}")
                    window_loss, window_n, window_t = 0.0, 0, now
                end_of_epoch = p.batch >= len(batches)
                if end_of_epoch:
                    p.epoch, p.batch = p.epoch + 1, 0
                hit_max = p.step >= total
                if (t.eval_every and p.step % t.eval_every == 0) or end_of_epoch or hit_max:
                    if self._evaluate_and_checkpoint() or hit_max:
                        done = True
                        break
                    self.dmp.train()

    def finish(self) -> dict[str, Any]:
        p = self.progress
        if not self.load_best() and self.ema:  # no best kept: report the average, as evaluated
            self.ema.apply()
        model = unwrap(self.dmp)
        report: dict[str, Any] = {
            "run_dir": str(self.dir.resolve()),
            "model": self.cfg.model.name,
            "parameters": self.dmp.recscale_parameters,
            "mflops_per_example": model.flops_per_example() / 1e6,
            "steps": p.step,
            "examples": p.examples,
            "epochs_completed": p.epoch,
            "best_step": p.best_step,
            "stopped_early": p.stopped_early,
            "train_seconds": round(p.train_seconds, 2),
            "examples_per_s": round(p.examples / p.train_seconds, 1) if p.train_seconds else None,
            "skipped_rows": {k: s.skipped for k, s in self.read_stats.items() if s.skipped},
            # A seed reproduces a run bit for bit only at the same thread count: sums in another order
            # can move the epoch early stopping keeps (DHEN on MovieLens: test AUC 0.7113 at 1, 0.7095 at 2).
            "torch_threads": torch.get_num_threads(),
        }
        eb, nw = self._eval_batch(), self.cfg.data.num_workers
        if self.valid_ds is not None:
            report["valid"] = evaluate(self.dmp, self.valid_ds, eb, nw)
        if self.test_ds is not None:
            report["test"] = evaluate(self.dmp, self.test_ds, eb, nw)
        if self.cfg.data.format == "synthetic":
            from recscale.data.synthetic import bayes_logloss

            split = "valid" if self.valid_ds is not None else "train"
            floor = bayes_logloss(self.cfg.data.synthetic, split)
            ctr = float(np.mean((self.valid_ds or self.train_ds).labels()))
            report["bayes_logloss"] = floor
            report["bayes_ne"] = floor / binary_entropy(ctr)
        if self.main:
            atomic_write_text(self.dir / "report.json", json.dumps(report, indent=2))
            if self.tb is not None:
                self.tb.close()
        if dist.is_initialized():
            dist.barrier()
        return report


def run_config(run_dir: Path) -> RunConfig:
    """The resolved config a run directory was trained with."""
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.yaml"
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


def resume_config(run_dir: Path, config: str | None, overrides: list[str]) -> RunConfig:
    """The config a ``--resume`` continues with: the run's own (or ``config``), with ``overrides``;
    refused, before any file is touched, if it changes more than the run may change when resumed."""
    if not (Path(run_dir) / "config.yaml").is_file():
        raise RecscaleError(f"--resume: {run_dir} is not a recscale run directory (no config.yaml)")
    if config is None:
        raw = read_yaml_mapping(Path(run_dir) / "config.yaml", "a run's config.yaml")
        cfg = validate_config(apply_overrides(raw, overrides))
    else:
        cfg = load_config(config, overrides)
    check_resume(run_dir, cfg)
    return cfg


def check_resume(run_dir: Path, cfg: RunConfig) -> None:
    if not (Path(run_dir) / "config.yaml").is_file():
        raise RecscaleError(f"--resume: {run_dir} is not a recscale run directory (no config.yaml)")
    _, refused = resume_changes(run_config(run_dir), cfg)
    if refused:
        more = f" and {len(refused) - 4} more" if len(refused) > 4 else ""
        raise ConfigError(
            f"--resume: the config changes {', '.join(refused[:4])}{more} of the run in {run_dir}; a resumed "
            f"run keeps its model, data and optimizer (it may change {', '.join(RESUMABLE_KEYS)}); "
            "train a new run with another --out instead"
        )


def load_trained(run_dir: Path) -> tuple[RunConfig, Preprocessor, DistributedModelParallel]:
    """The run's config, preprocessing and best (else latest) model, in this process."""
    run_dir = Path(run_dir)
    cfg, pre = load_run(run_dir)
    if cfg.dmt is not None:
        raise CheckpointError(f"{run_dir}: a DMT run's towers load only at its own hosts; use a flat run")
    env = init_distributed()
    # Scores do not depend on the sharding, and a multi-rank run's placements may name ranks this
    # process does not have: the checkpoint loads into the default plan at any world size (replicated
    # tables stay replicated: their optimizer may have no fused kernel).
    plan = DistributedConfig(sharding="data_parallel") if cfg.dense_tables() else DistributedConfig()
    dmp, opt = build_dmp(cfg.model_copy(update={"distributed": plan}), pre, env)
    best = run_dir / "best"
    ckpts = list_checkpoints(run_dir / "ckpt")
    source = best if (best / ".metadata").is_file() else (ckpts[-1] if ckpts else None)
    if source is None:
        raise CheckpointError(f"{run_dir}: no complete checkpoint to evaluate; train the run first")
    load_checkpoint(source, {"model": dmp.state_dict()})
    if source != best and cfg.train.ema_decay:  # a training checkpoint: its dense average is the model
        with torch.no_grad():
            load_checkpoint(source, {"ema": trainable_dense(opt)})
    return cfg, pre, dmp


def eval_run(run_dir: Path, data_path: str, fmt: str | None = None, split: str = "test") -> dict[str, float]:
    """Score the run's best (else latest) model on another file of the same format."""
    import tempfile

    if not Path(data_path).is_file():
        raise DataError(f"--data {data_path}: no such file; give the file to score")
    cfg, pre, dmp = load_trained(run_dir)
    if (fmt or cfg.data.format) == "synthetic":
        raise RecscaleError(
            f"{run_dir} was trained on synthetic data, which has no file format to read --data {data_path} "
            "with; pass --format csv (or parquet) for a file with the run's columns "
            f"({', '.join(pre.schema.column_names()[:4])}, ...)"
        )
    data = cfg.data.model_copy(update={"format": fmt or cfg.data.format})
    with tempfile.TemporaryDirectory(prefix="recscale-eval-") as tmp:
        ds, stats = prepare_split(data, pre, split, data_path, Path(tmp) / "eval", progress=False)
        m = evaluate(dmp, ds, 8192, 0)
    if stats.skipped:
        m["skipped_rows"] = stats.skipped
    return m
