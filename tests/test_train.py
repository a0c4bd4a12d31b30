import json
import math
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pytest
import torch

from recscale.cli import main
from recscale.config import load_config
from recscale.errors import ConfigError, RecscaleError
from recscale.train.checkpoint import load_checkpoint, remove_partial_checkpoints
from recscale.train.loop import Trainer
from recscale.train.runs import check_run_output, eval_run

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SMALL_SYNTH = [
    "data.synthetic.rows.train=6000",
    "data.synthetic.rows.valid=2000",
    "data.synthetic.rows.test=2000",
    "data.synthetic.num_sparse=6",
    "data.synthetic.vocab_sizes=200",
    "data.num_workers=0",
    "train.batch_size=256",
    "train.log_every=1",
    "train.progress=false",
    "model.embedding.dim=8",
]


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    # With a moving average of the dense weights too: its state must resume exactly as well.
    common = [
        *SMALL_SYNTH,
        "train.eval_every=10",
        "train.epochs=3",
        "model.dropout=0.1",
        "train.ema_decay=0.9",
    ]
    full = load_config(CONFIGS / "demo.yaml", [*common, "train.max_steps=40"])
    uninterrupted = Trainer(full, tmp_path / "a").fit()
    # The same run, stopped at step 20 (a checkpoint), then resumed to step 40.
    Trainer(load_config(CONFIGS / "demo.yaml", [*common, "train.max_steps=20"]), tmp_path / "b").fit()
    report = Trainer(full, tmp_path / "b", resume=True).fit()
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert report["steps"] == 40
    assert report["torch_threads"] == torch.get_num_threads()  # bit-exact reruns need the same count
    assert [a[s] for s in range(21, 41)] == [b[s] for s in range(21, 41)]
    assert report["valid"] == uninterrupted["valid"]


def test_the_first_log_window_after_a_resume_is_the_uninterrupted_runs(tmp_path):
    """Resumed from the checkpoint at step 7, the run logged at step 10 the mean loss of steps 8-10 only
    (an uninterrupted run: steps 6-10); the open window is checkpointed and continues instead."""
    common = [*SMALL_SYNTH, "train.log_every=5", "train.eval_every=7", "train.early_stopping=null"]
    full = load_config(CONFIGS / "demo.yaml", [*common, "train.max_steps=10"])
    Trainer(full, tmp_path / "a").fit()
    Trainer(load_config(CONFIGS / "demo.yaml", [*common, "train.max_steps=7"]), tmp_path / "b").fit()
    Trainer(full, tmp_path / "b", resume=True).fit()
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert list(a) == list(b) == [5, 10] and a == b
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["examples_per_s"] > 0 for r in rows if r["split"] == "train")


def test_a_log_windows_rate_leaves_out_evaluation(tmp_path, monkeypatch):
    """An evaluation inside a log window counted in its examples/s (such a window read up to 100x slower):
    the clock here jumps 1000 s per evaluation, which no window's rate may see."""
    import recscale.train.loop as loop

    clock = {"offset": 0.0}
    real_clock, real_eval = loop.time.perf_counter, Trainer._evaluate_and_checkpoint

    def slow_eval(self: Trainer) -> bool:
        clock["offset"] += 1000.0
        return real_eval(self)

    monkeypatch.setattr(loop.time, "perf_counter", lambda: real_clock() + clock["offset"])
    monkeypatch.setattr(Trainer, "_evaluate_and_checkpoint", slow_eval)
    common = [*SMALL_SYNTH, "train.log_every=4", "train.eval_every=2", "train.max_steps=8"]
    Trainer(load_config(CONFIGS / "demo.yaml", common), tmp_path / "run").fit()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = [r["examples_per_s"] for r in rows if r["split"] == "train"]
    assert len(rates) == 2 and min(rates) > 256 * 4 / 100  # 4 steps of 256 in under 100 s


def test_a_log_windows_rate_counts_the_rows_of_a_training_split_under_one_batch(tmp_path, monkeypatch):
    """A 64-row training split under a batch of 256 trains 64 examples a step; its windows' examples/s
    counted 256. The clock here jumps 1000 s per step: 64 examples per 1000 s."""
    import recscale.train.loop as loop

    clock = {"offset": 0.0}
    real_clock, real_step = loop.time.perf_counter, Trainer.train_step

    def slow_step(self: Trainer, *args: object) -> torch.Tensor:
        clock["offset"] += 1000.0
        return real_step(self, *args)

    monkeypatch.setattr(loop.time, "perf_counter", lambda: real_clock() + clock["offset"])
    monkeypatch.setattr(Trainer, "train_step", slow_step)
    rows = "data.synthetic.rows={train: 64, valid: 100}"
    common = [*SMALL_SYNTH, rows, "train.log_every=2", "train.max_steps=4", "train.epochs=4"]
    Trainer(load_config(CONFIGS / "demo.yaml", common), tmp_path / "run").fit()
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = [r["examples_per_s"] for r in records if r["split"] == "train"]
    assert len(rates) == 2 and rates == pytest.approx([64 / 1000] * 2, rel=0.01)


def test_batch_norm_over_a_training_split_of_one_row_is_refused(tmp_path):
    """A 1-row training split under train.batch_size 4 is one batch of one row: with model.norm=batch it was
    'internal error ValueError: Expected more than 1 value per channel' at the first step (the config's
    check sees only train.batch_size). Found feeding the CLI a 1-row CSV."""
    rows = "data.synthetic.rows={train: 1, valid: 100}"
    common = [*SMALL_SYNTH, rows, "train.batch_size=4", "train.max_steps=1"]
    with pytest.raises(ConfigError, match="the training split has 1 row, its one batch"):
        Trainer(load_config(CONFIGS / "demo.yaml", [*common, "model.norm=batch"]), tmp_path / "bn")
    two = "data.synthetic.rows={train: 2, valid: 100}"
    Trainer(load_config(CONFIGS / "demo.yaml", [*common, two, "model.norm=batch"]), tmp_path / "two").fit()
    Trainer(load_config(CONFIGS / "demo.yaml", common), tmp_path / "none").fit()


def test_aborted_run_leaves_nothing_to_trust(tmp_path, monkeypatch):
    import recscale.train.checkpoint as ck

    cfg = load_config(CONFIGS / "demo.yaml", [*SMALL_SYNTH, "train.max_steps=5"])

    def crash(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ck.dcp, "save", crash)
    with pytest.raises(RuntimeError):
        Trainer(cfg, tmp_path / "r").fit()
    assert ck.list_checkpoints(tmp_path / "r" / "ckpt") == []
    assert not (tmp_path / "r" / "best").exists()
    assert not (tmp_path / "r" / "report.json").exists()


def test_a_new_run_over_an_attempt_without_a_checkpoint_starts_clean_logs(tmp_path):
    """An attempt killed before its first checkpoint leaves config.yaml, metrics.jsonl, tb/ (and maybe
    best/); a new run in that directory (no --resume) replaces them instead of appending to them."""
    run = tmp_path / "r"
    cfg = load_config(CONFIGS / "demo.yaml", [*SMALL_SYNTH, "train.max_steps=6", "train.eval_every=3"])
    Trainer(cfg, run).fit()
    shutil.rmtree(run / "ckpt")
    (run / "report.json").unlink()  # what a kill before the first checkpoint would have left
    (run / "tb" / "stale.tfevents").write_text("")
    Trainer(cfg, run).fit()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and len(steps) == len(set(steps)) + 2  # train and valid records at 3, 6
    assert not (run / "tb" / "stale.tfevents").exists()


@pytest.mark.parametrize("setting", ["data.synthetic.rows={train: 2000}", "train.early_stopping=null"])
def test_a_run_that_keeps_no_best_reports_its_last_step(tmp_path, setting):
    """Without a valid split or early stopping the report scores the last step's model: best_step said 0."""
    cfg = load_config(
        CONFIGS / "demo.yaml", [*SMALL_SYNTH, "train.max_steps=3", "train.eval_every=2", setting]
    )
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert Trainer(cfg, tmp_path / "r").fit()["best_step"] == 3
    # Early stopping set (the demo's) without a valid split was ignored without a word.
    stops = [str(w.message) for w in said if "train.early_stopping watches the valid split" in str(w.message)]
    assert len(stops) == (setting != "train.early_stopping=null")


def test_eval_scores_the_best_model_that_a_kill_left_set_aside(tmp_path):
    """A run killed while best/ was replaced (between atomic_dir's two renames) has .best.old and no best/:
    eval and export scored the latest training checkpoint instead of the kept model; a resume put it back."""
    es = "train.early_stopping={metric: logloss, patience: 5, min_delta: 1.0}"  # only the first eval improves
    cfg = load_config(CONFIGS / "demo.yaml", [*SMALL_SYNTH, "train.max_steps=4", "train.eval_every=2", es])
    run = tmp_path / "r"
    report = Trainer(cfg, run).fit()
    assert report["best_step"] == 2
    best = eval_run(run, None, split="valid")
    (run / "best").rename(run / ".best.old")
    assert eval_run(run, None, split="valid") == best
    remove_partial_checkpoints(run)  # what a resume does first: best/ is back
    assert (run / "best").is_dir() and not (run / ".best.old").exists()


class _Killed(BaseException):
    """A kill: nothing after it runs (a BaseException, so no handler on the way turns it into an error)."""


def test_a_kill_between_an_evaluations_two_writes_leaves_a_best_the_resume_knows(tmp_path, monkeypatch):
    """An improving evaluation writes its checkpoint and best/. best/ used to go first: killed between the
    two, best/ held step 4's weights while the resume started from step 2, whose progress names step 2 as
    the best (a resume that did not retrain step 4 exactly went back to weights it knew nothing of). Now
    best/ follows the checkpoint, and the resume from step 4 writes it from there."""
    import recscale.train.loop as loop
    from recscale.train.state import Progress

    monkeypatch.setattr(Progress, "improves", lambda *_: True)  # both evaluations (steps 2, 4) improve
    writes, real_save = [], loop.save_checkpoint

    def save(path, state, rank=0):
        writes.append(path)
        if len(writes) == 4:  # the second write of step 4's evaluation
            raise _Killed
        real_save(path, state, rank)

    monkeypatch.setattr(loop, "save_checkpoint", save)
    cfg = load_config(CONFIGS / "demo.yaml", [*SMALL_SYNTH, "train.max_steps=4", "train.eval_every=2"])
    run = tmp_path / "r"
    with pytest.raises(_Killed):
        Trainer(cfg, run).fit()
    monkeypatch.setattr(loop, "save_checkpoint", real_save)
    trainer = Trainer(cfg, run, resume=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = next(r for r in rows if r["split"] == "valid" and r["step"] == trainer.progress.best_step)
    kept = eval_run(run, None, split="valid")  # best/'s weights
    assert kept["logloss"] == pytest.approx(logged["logloss"], rel=1e-6)
    assert Trainer(cfg, run, resume=True).fit()["best_step"] == 4


def test_tensorboard_hides_what_a_killed_attempt_logged_after_its_checkpoint(tmp_path, monkeypatch):
    """Killed while writing step 8's checkpoint, the attempt had logged steps 6-8; the resume from step 5
    drops them from metrics.jsonl, but TensorBoard showed them beside the resumed run's own."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import recscale.train.loop as loop

    real_save = loop.save_checkpoint

    def save(path, state, rank=0):
        if path.name == "step_00000008":
            raise _Killed
        real_save(path, state, rank)

    monkeypatch.setattr(loop, "save_checkpoint", save)
    common = [*SMALL_SYNTH, "train.max_steps=8", "train.eval_every=5", "train.early_stopping=null"]
    run = tmp_path / "r"
    with pytest.raises(_Killed):
        Trainer(load_config(CONFIGS / "demo.yaml", common), run).fit()
    monkeypatch.setattr(loop, "save_checkpoint", real_save)
    Trainer(load_config(CONFIGS / "demo.yaml", [*common, "train.log_every=2"]), run, resume=True).fit()
    tb = EventAccumulator(str(run / "tb"))
    tb.Reload()
    shown = {e.step: e.value for e in tb.Scalars("train/loss")}
    assert list(shown) == [1, 2, 3, 4, 5, 6, 8]
    assert shown == pytest.approx(losses(run))


def test_a_resume_removes_a_split_a_kill_left_half_written(tmp_path):
    """A kill while a data split was written left RUN/data/.valid.XXXX.tmp behind for good."""
    cfg = load_config(CONFIGS / "demo.yaml", [*SMALL_SYNTH, "train.max_steps=2"])
    Trainer(cfg, tmp_path / "r").fit()
    (tmp_path / "r" / "data" / ".valid.k1ll.tmp").mkdir()
    Trainer(cfg, tmp_path / "r", resume=True)
    assert (
        not (tmp_path / "r" / "data" / ".valid.k1ll.tmp").exists()
        and (tmp_path / "r" / "data" / "valid").is_dir()
    )


def test_synthetic_data_trains_on_the_splits_its_rows_name(tmp_path):
    """data.synthetic.rows with a train split only: a run without valid and test (it was an internal
    KeyError), and eval without --data names the split the run has no rows of."""
    rows = "data.synthetic.rows={train: 2000}"
    cfg = load_config(CONFIGS / "demo.yaml", [*SMALL_SYNTH, rows, "train.max_steps=3"])
    report = Trainer(cfg, tmp_path / "r").fit()
    assert report["steps"] == 3 and "valid" not in report and "test" not in report
    with pytest.raises(RecscaleError, match="has no test split"):
        eval_run(tmp_path / "r", None)


@pytest.mark.slow
def test_frappe_slice_beats_logistic_regression(tmp_path, shared_data):
    """Wukong on 100k Frappe rows reaches a validation AUC clearly above LR trained the same way."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 100_000), ("valid", 20_000)):
        table = pacsv.read_csv(shared_data / "frappe" / f"{split}.csv")
        pacsv.write_csv(table.take(rng.choice(table.num_rows, n, replace=False)), tmp_path / f"{split}.csv")
    over = [f"data.train={tmp_path / 'train.csv'}", f"data.valid={tmp_path / 'valid.csv'}", "train.progress=false",
            "train.epochs=10", "train.batch_size=1024", "data.num_workers=0"]  # fmt: skip
    auc = {}
    for name in ("lr", "wukong"):
        cfg = load_config(CONFIGS / "frappe.yaml", [*over, f"model.name={name}"])
        auc[name] = Trainer(cfg, tmp_path / name).fit()["valid"]["auc"]
    print("frappe slice AUC", auc)
    assert auc["lr"] > 0.85  # LR itself learns (published full-data LR: 0.9356)
    assert auc["wukong"] > auc["lr"] + 0.02, auc
    # `recscale eval` scores the run on another file and agrees with the run's own validation.
    m = eval_run(tmp_path / "wukong", str(tmp_path / "valid.csv"))
    assert m["rows"] == 20_000 and m["auc"] == pytest.approx(auc["wukong"], abs=1e-6)


def test_tables_are_trained_by_the_fused_sparse_optimizer(tmp_path):
    """Every table is sharded with the fused kernel; none leaks into the dense optimizer."""
    cfg = load_config(CONFIGS / "demo.yaml", [*SMALL_SYNTH, "train.max_steps=1"])
    tr = Trainer(cfg, tmp_path / "r")
    fused, dense = tr.built.tables, tr.built.dense
    tables = {f"embedding.ebc.embedding_bags.t_{f.name}.weight" for f in tr.pre.schema.sparse}
    assert set(fused.params) == tables
    assert not any("ebc" in name for name in dense.params)
    assert all(s.sharding_type == "table_wise" and s.compute_kernel == "fused"
               for s in tr.module.plan.plan["embedding.ebc"].values())  # fmt: skip


@pytest.mark.parametrize("wd", [0.0, 1.0])
def test_replicated_tables_take_a_torch_optimizer_with_whole_table_l2(tmp_path, wd):
    """With every table data_parallel, Adam (no fused CPU kernel) trains the tables and its coupled weight
    decay reaches every row: after one step the OOV row 0, never looked up, moved by Adam's first step
    on the gradient λw alone (≈ lr·sign(w)) with decay, and not at all without (FuxiCTR's embedding_regularizer under Adam)."""
    lr = 0.01
    cfg = load_config(CONFIGS / "demo.yaml", [*SMALL_SYNTH, "train.max_steps=1", "distributed.sharding=data_parallel",
                                              f"train.sparse_optimizer={{name: adam, lr: {lr}, weight_decay: {wd}}}"])  # fmt: skip
    tr = Trainer(cfg, tmp_path / "r")
    tables = {k: v for k, v in tr.module.state_dict().items() if ".ebc." in k}
    before = {k: v.clone() for k, v in tables.items()}
    replicas = tr.built.tables
    assert set(replicas.params) == set(tables) and not any("ebc" in n for n in tr.built.dense.params)
    report = tr.fit()
    for k, w in tables.items():
        # The row's whole gradient is the decay's; Adam's first step is lr·g/(|g| + eps).
        g = wd * before[k][0]
        torch.testing.assert_close(w[0], before[k][0] - lr * g / (g.abs() + 1e-8), rtol=0, atol=1e-7)
        assert not torch.equal(w[1:], before[k][1:])  # looked-up rows trained
    # `recscale eval` loads such a run (its optimizer has no fused kernel) and scores it the same.
    again = eval_run(tmp_path / "r", None, split="valid")
    assert again["auc"] == pytest.approx(report["valid"]["auc"])


def test_table_weight_decay_needs_replicated_tables():
    with pytest.raises(ConfigError, match="data_parallel"):
        load_config(
            CONFIGS / "demo.yaml", ["train.sparse_optimizer={name: adam, lr: 1e-3, weight_decay: 0.1}"]
        )


def test_table_weight_decay_below_what_fp16_tables_resolve_is_refused():
    """Tables stored in fp16 rounded a per-step shrink under 2^-11 away (demo: lr 0.05 x 1e-3): the
    decay did nothing, without a word. A shrink fp16 resolves (0.05 x 0.02 = 1e-3) is taken."""
    demo, fp16 = CONFIGS / "demo.yaml", "model.embedding.storage=fp16"
    with pytest.raises(ConfigError) as e:
        load_config(demo, [fp16, "train.table_weight_decay=1e-3"])
    assert "table lr x decay = 5e-05 a step, under what model.embedding.storage=fp16 resolves" in str(e.value)
    assert "\n" not in str(e.value)
    assert load_config(demo, [fp16, "train.table_weight_decay=0.02"]).train.table_weight_decay == 0.02
    assert load_config(demo, ["train.table_weight_decay=1e-3"]).train.table_weight_decay == 1e-3  # fp32


def test_an_lr_drop_that_takes_fp16_tables_decay_under_their_resolution_warns(tmp_path):
    """The check above sees the configured LR only: a plateau's LR drop (0.05 x 0.02 = 1e-3, then 1e-4 from the second evaluation)
    later rounded the decay away without a word."""
    es = "train.early_stopping={metric: logloss, patience: 10, min_delta: 1.0, reduce_lr_factor: 0.1}"
    over = [*SMALL_SYNTH, "model.embedding.storage=fp16", "distributed.sharding=table_wise", es]
    over += ["train.table_weight_decay=0.02", "train.eval_every=2", "train.max_steps=6"]
    with pytest.warns(UserWarning, match=r"drop at step 4 the shrink per step is 0.0001, under") as seen:
        Trainer(load_config(CONFIGS / "demo.yaml", over), tmp_path / "r").fit()
    assert len([w for w in seen if "table_weight_decay" in str(w.message)]) == 1  # once, not per drop


def _tables_after(tmp_path: Path, overrides: list[str]) -> dict[str, torch.Tensor]:
    """The demo model's tables (this rank's shards) after training with ``overrides``."""
    tr = Trainer(load_config(CONFIGS / "demo.yaml", [*SMALL_SYNTH, *overrides]), tmp_path)
    tr.fit()
    return {k: v.local_shards()[0].tensor.clone() for k, v in tr.module.state_dict().items() if ".ebc." in k}


@pytest.mark.slow
def test_embedding_l2_shrinks_the_tables(tmp_path):
    """train.embedding_l2 reaches the fused tables (fbgemm's own weight decay does not, on CPU)."""
    norms = {
        l2: sum(
            w.norm().item()
            for w in _tables_after(
                tmp_path / f"l2_{l2}", ["train.max_steps=15", f"train.embedding_l2={l2}"]
            ).values()
        )
        for l2 in (0.0, 1.0)
    }
    assert norms[1.0] < 0.8 * norms[0.0], norms


def test_table_weight_decay_shrinks_every_row_after_the_step(tmp_path):
    """After one step the whole table (rows looked up or not) is the undecayed run's times
    1 - table lr x table_weight_decay: the decay reaches the fused kernels' storage."""
    tables = {
        wd: _tables_after(tmp_path / f"wd_{wd}", ["train.max_steps=1", f"train.table_weight_decay={wd}"])
        for wd in (0.0, 2.0)
    }
    shrink = 1 - load_config(CONFIGS / "demo.yaml").train.sparse_optimizer.lr * 2.0
    assert tables[2.0] and tables[2.0].keys() == tables[0.0].keys()  # the loop below checks every table
    for k, w in tables[2.0].items():
        torch.testing.assert_close(w, tables[0.0][k] * shrink)


@pytest.mark.slow
def test_learning_rates_drop_on_plateau(tmp_path):
    es = "train.early_stopping={metric: logloss, patience: 10, min_delta: 1.0, reduce_lr_factor: 0.5}"
    cfg = load_config(CONFIGS / "demo.yaml", [*SMALL_SYNTH, "train.eval_every=5", "train.max_steps=15", es])
    tr = Trainer(cfg, tmp_path / "r")
    tr.fit()
    assert tr.progress.lr_scale == 0.25  # evaluations at steps 10 and 15 did not improve
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["lr"] for r in rows if r["split"] == "train"}
    base = cfg.train.dense_optimizer.lr
    assert lr[10] == pytest.approx(base) and lr[11] == pytest.approx(base * 0.5)
    sparse = tr.built.tables.param_groups[0]["lr"]
    assert sparse == pytest.approx(cfg.train.sparse_optimizer.lr * 0.5)


def test_a_steps_table_update_uses_that_steps_learning_rate(tmp_path):
    """fbgemm's CPU kernel takes the tables' lr at the forward; handed to it after the forward, a step updated
    the tables with the previous step's lr: a resumed run's first step with the configured lr, not the one
    early stopping had cut it to (its losses then left the uninterrupted run's). Cut to 0, nothing moves."""
    cfg = load_config(CONFIGS / "demo.yaml", [*SMALL_SYNTH, "train.max_steps=2"])
    with Trainer(cfg, tmp_path / "r") as tr:
        tr.progress.lr_scale = 0.0
        before = [w.clone() for w in tr.built.table_shards()]
        batch, size = next(iter(tr._epoch()))
        tr.train_step(batch.to(tr.env.device), size)
        assert all(torch.equal(a, b) for a, b in zip(before, tr.built.table_shards(), strict=True))


def test_a_warmup_longer_than_the_run_warns(tmp_path):
    cfg = load_config(CONFIGS / "demo.yaml", [*SMALL_SYNTH, "train.max_steps=10", "train.warmup_steps=11"])
    with pytest.warns(UserWarning, match="warmup_steps=11 is longer than the run's 10 steps"):
        Trainer(cfg, tmp_path / "r")


@pytest.mark.parametrize("restore", [True, False])
def test_restore_best_on_plateau(tmp_path, restore):
    """With restore_best, an evaluation without improvement puts the best weights back before training
    goes on: the checkpoint written right after it (step 10) holds the best model (step 5)."""

    es = f"train.early_stopping={{metric: logloss, patience: 10, min_delta: 1.0, restore_best: {restore}}}"
    cfg = load_config(CONFIGS / "demo.yaml", [*SMALL_SYNTH, "train.eval_every=5", "train.max_steps=10", es])
    tr = Trainer(cfg, tmp_path / "r")
    tr.fit()  # ends with the best weights loaded
    assert tr.progress.best_step == 5

    def weights() -> dict[str, torch.Tensor]:  # tables as this rank's shards
        return {k: (v.local_shards()[0].tensor if hasattr(v, "local_shards") else v).clone()
                for k, v in tr.module.state_dict().items()}  # fmt: skip

    best = weights()
    load_checkpoint(tmp_path / "r" / "ckpt" / "step_00000010", {"model": tr.module.state_dict()})
    after = weights()
    assert any(".ebc." in k for k in best)
    assert all(torch.equal(after[k], best[k]) for k in best) == restore


def test_a_resume_with_more_patience_continues_a_run_that_stopped_early(tmp_path):
    """train.early_stopping.patience may change on resume: a run stopped after 1 evaluation without
    improvement trains on under patience 3 until it has had 3, and one resumed with patience 1 again stays."""
    es = "train.early_stopping={metric: logloss, patience: 1, min_delta: 1.0}"  # only the first eval improves
    base = [*SMALL_SYNTH, "train.eval_every=5", "train.max_steps=40", es]
    first = Trainer(load_config(CONFIGS / "demo.yaml", base), tmp_path / "r").fit()
    assert (first["steps"], first["stopped_early"]) == (10, True)
    same = Trainer(load_config(CONFIGS / "demo.yaml", base), tmp_path / "r", resume=True).fit()
    assert (same["steps"], same["stopped_early"]) == (10, True)
    more = load_config(CONFIGS / "demo.yaml", [*base, "train.early_stopping.patience=3"])
    report = Trainer(more, tmp_path / "r", resume=True).fit()
    assert (report["steps"], report["stopped_early"], report["best_step"]) == (20, True, 5)


@pytest.mark.parametrize("metric", ["auc", "logloss"])
def test_a_nan_metric_is_worse_than_any_number(metric):
    """A first evaluation whose metric is NaN (AUC of a one-class split, a diverged loss) was kept as the
    best; every comparison with NaN is false, so no later evaluation could improve on it. NaN never
    improves (NaN after NaN neither); a plateau of NaNs drops the LR and restores the best as any other."""
    from recscale.config import EarlyStopping
    from recscale.train.state import Progress

    es = EarlyStopping(metric=metric, patience=3, reduce_lr_factor=0.5, restore_best=True)
    p, nan = Progress(), float("nan")
    improved, restore = [], []

    def m(value: float) -> dict[str, float]:  # NaN: a diverged model, whose LogLoss is NaN too
        return {"auc": value, "logloss": value} if math.isnan(value) else {"logloss": 0.3, metric: value}

    for step, value in enumerate([nan, nan, 0.5, nan, 0.6 if metric == "auc" else 0.4], start=1):
        p.step = step
        improved.append(p.improves(m(value), es))
        restore.append(p.record_eval(m(value), improved[-1], es))
    assert improved == [False, False, True, False, True]
    assert restore == [True, True, False, True, False] and not p.stopped_early
    assert (p.best_step, p.bad_evals, p.lr_scale) == (5, 0, 0.5**3)
    old = Progress(best=nan)  # what a checkpoint written before the fix holds
    assert old.improves(m(0.5), es) and not old.improves(m(nan), es)


@pytest.mark.parametrize("metric", ["auc", "ne", "gauc"])
def test_early_stopping_compares_logloss_where_the_metric_is_undefined(metric):
    """AUC and NE of a valid split of one class are NaN at every evaluation: the run stopped after
    `patience` evaluations with best_step 0, whatever the model learnt. Early stopping compares their
    LogLoss instead (which is defined)."""
    from recscale.config import EarlyStopping
    from recscale.train.state import Progress, watched_metric

    es, p, nan = EarlyStopping(metric=metric, patience=2), Progress(), float("nan")
    for step, logloss in enumerate([0.6, 0.5, 0.55, 0.4, 0.45, 0.41], start=1):
        p.step = step
        evaluation = {"auc": nan, "logloss": logloss, "ne": nan, "gauc": nan}
        assert watched_metric(evaluation, es) == "logloss"
        p.record_eval(evaluation, p.improves(evaluation, es), es)
    assert (p.best, p.best_step, p.bad_evals, p.stopped_early) == (0.4, 4, 2, True)


@pytest.mark.slow
def test_ema_reports_the_average_of_the_dense_weights(tmp_path):
    """train.ema_decay: the model kept and reported is the bias-corrected moving average of the raw
    dense weights (decay min(0.5, (1+n)/(10+n)) after n steps), which training itself never sees."""
    common = [*SMALL_SYNTH, "train.max_steps=2", "train.early_stopping=null", "train.keep_checkpoints=5",
              "train.eval_every=1"]  # fmt: skip

    def dense(tr: Trainer) -> dict[str, torch.Tensor]:
        return {k: q.detach().clone() for k, q in tr.ema.params.items()} if tr.ema else {
            k: q.detach().clone() for k, q in tr.built.trainable_dense().items()}  # fmt: skip

    raw = Trainer(load_config(CONFIGS / "demo.yaml", common), tmp_path / "raw")
    w = [dense(raw)]
    raw.fit()
    for step in (1, 2):
        load_checkpoint(tmp_path / "raw" / "ckpt" / f"step_{step:08d}", {"model": raw.module.state_dict()})
        w.append(dense(raw))
    tr = Trainer(load_config(CONFIGS / "demo.yaml", [*common, "train.ema_decay=0.5"]), tmp_path / "ema")
    report = tr.fit()
    d1, d2 = 2 / 11, 0.25
    for k in w[0]:
        s1 = d1 * w[0][k] + (1 - d1) * w[1][k]
        torch.testing.assert_close(tr.ema.params[k], d2 * s1 + (1 - d2) * w[2][k])
    assert not torch.equal(tr.ema.params[k], w[2][k])
    # `recscale eval` scores the same average from the training checkpoint.
    again = eval_run(tmp_path / "ema", None, split="valid")
    assert again["auc"] == pytest.approx(report["valid"]["auc"])


def test_ema_trains_with_fsdp_dense_and_resumes(tmp_path):
    """train.ema_decay with distributed.dense=fsdp: swapping the average in for an evaluation used
    ``_foreach_copy_``, which FSDP2's DTensor parameters lack ("internal error NotImplementedError")."""
    common = [*SMALL_SYNTH, "train.eval_every=2", "train.early_stopping=null", "train.ema_decay=0.5",
              "distributed.sharding=row_wise", "distributed.dense=fsdp"]  # fmt: skip
    Trainer(load_config(CONFIGS / "demo.yaml", [*common, "train.max_steps=2"]), tmp_path / "r").fit()
    report = Trainer(
        load_config(CONFIGS / "demo.yaml", [*common, "train.max_steps=4"]), tmp_path / "r", resume=True
    ).fit()
    assert report["steps"] == 4 and math.isfinite(report["valid"]["logloss"])


def test_report_fraction_holds_valid_rows_out_of_every_selection(tmp_path):
    """data.report_fraction: early stopping sees only the selection rows of valid; the held-out rows are
    scored once, at the end, and they are the same rows for every seed."""
    from recscale.data.dataset import held_out

    over = [*SMALL_SYNTH, "train.max_steps=6", "train.eval_every=3", "data.report_fraction=0.3"]
    tr = Trainer(load_config(CONFIGS / "demo.yaml", over), tmp_path / "r")
    report = tr.fit()
    selected, reported = report["valid"]["rows"], report["report"]["rows"]
    assert selected + reported == 2000 and 500 < reported < 700
    assert tr.valid_ds.index is not None and tr.report_ds is not None
    assert not set(tr.valid_ds.index) & set(tr.report_ds.index)
    logged = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert {r["rows"] for r in logged if r["split"] == "valid"} == {selected}
    # The view gathers the rows it names: its labels are the split's labels at those rows.
    full = tr.report_ds.subset(np.ones(reported, bool))
    assert np.array_equal(full.labels(), tr.report_ds.labels())
    assert np.array_equal(tr.report_ds.gather(np.arange(5)).labels.numpy(), tr.report_ds.labels()[:5])
    # A fixed hash of the row index: the same rows again, and a prefix of a longer file's.
    assert np.array_equal(held_out(2000, 0.3), held_out(5000, 0.3)[:2000])
    other = Trainer(load_config(CONFIGS / "demo.yaml", [*over, "seed=1"]), tmp_path / "s")
    assert other.report_ds is not None and np.array_equal(other.report_ds.index, tr.report_ds.index)


def one_class_valid_run(tmp_path: Path, train: str) -> None:
    """tmp_path/run.yaml: LR on 64 CSV rows of both classes, validated on the same rows all labelled 0;
    ``train``: more keys of its train section."""
    rows = [f"{i % 2},{i % 7},{i % 11}" for i in range(64)]
    (tmp_path / "train.csv").write_text("\n".join(["label,user,item", *rows]) + "\n")
    (tmp_path / "valid.csv").write_text("\n".join(["label,user,item", *(f"0,{r[2:]}" for r in rows)]) + "\n")
    (tmp_path / "run.yaml").write_text(
        f"data:\n  format: csv\n  train: {tmp_path / 'train.csv'}\n  valid: {tmp_path / 'valid.csv'}\n"
        "  schema: {label: label, sparse: [{name: user}, {name: item}]}\n  num_workers: 0\n"
        "model: {name: lr}\n"
        f"train: {{batch_size: 16, eval_every: 1, log_every: 1, progress: false, {train}}}\n"
    )


def test_a_valid_split_of_one_class_stops_early_on_logloss(tmp_path):
    """Early stopping on AUC with a valid split of one class stopped after `patience` evaluations at
    best_step 0 (AUC undefined at each); it compares LogLoss, and says so once."""
    one_class_valid_run(tmp_path, "max_steps: 3, early_stopping: {metric: auc, patience: 2}")
    with pytest.warns(UserWarning, match="metric=auc is undefined on the valid split") as said:
        report = Trainer(load_config(tmp_path / "run.yaml"), tmp_path / "r").fit()
    assert len([w for w in said if "undefined" in str(w.message)]) == 1
    assert report["best_step"] >= 1 and (tmp_path / "r" / "best").is_dir()


def test_nan_metrics_are_written_as_json_null(tmp_path, capsys):
    """AUC, NE and calibration of a valid set of one class are NaN: metrics.jsonl and report.json wrote
    them as bare NaN, which is not JSON (jq, JSON.parse and strict parsers refuse the file)."""
    one_class_valid_run(tmp_path, "max_steps: 2")
    report = Trainer(load_config(tmp_path / "run.yaml"), tmp_path / "r").fit()
    assert np.isnan(report["valid"]["auc"])  # the returned report (the printed summary) keeps its NaN

    def strict(text: str) -> dict:
        def refuse(constant: str) -> None:
            raise AssertionError(f"{constant} is not JSON")

        return json.loads(text, parse_constant=refuse)

    logged = [strict(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in logged if r["split"] == "valid"]
    assert len(evals) == 2 and all(r["auc"] is r["ne"] is r["calibration"] is None for r in evals)
    assert all(isinstance(r["logloss"], float) for r in evals)
    assert [r["step"] for r in logged if r["split"] == "train"] == [1, 2]
    valid = strict((tmp_path / "r" / "report.json").read_text())["valid"]
    assert valid["auc"] is valid["ne"] is valid["calibration"] is None and valid["rows"] == 64
    # recscale eval prints the same metrics as one JSON line
    assert main(["eval", str(tmp_path / "r"), "--data", str(tmp_path / "valid.csv")]) == 0
    printed = strict(capsys.readouterr().out)
    assert printed["auc"] is None and printed["rows"] == 64

    from recscale.io import strict_json

    nested = {"a": [1.0, float("inf"), (float("-inf"), 2)], "b": {"c": float("nan")}, "s": "NaN"}
    assert json.loads(strict_json(nested)) == {"a": [1.0, None, [None, 2]], "b": {"c": None}, "s": "NaN"}


def test_a_diverged_training_stops_fails_and_keeps_no_nan_weights(tmp_path, capsys):
    """A learning rate that blows the loss up to NaN trained on to the last step, saved NaN checkpoints, kept
    a calibrated NaN model in best/ and exited 0 with null metrics. It stops at the first NaN window, writes
    no checkpoint of those weights, and the command fails naming the step and the fix."""
    out = tmp_path / "r"
    args = ["train", str(CONFIGS / "demo.yaml"), "--out", str(out), *SMALL_SYNTH, "train.max_steps=20",
            "train.eval_every=5", "train.calibrate=true", "train.dense_optimizer.lr=1e30",
            "train.sparse_optimizer.lr=1e30"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    step = report["diverged_at_step"]
    assert step < 5 and report["steps"] == step  # stopped at once, before the first evaluation
    assert f"error: training diverged: its loss was NaN or infinite by step {step}, where it stopped" in err
    assert "(nothing usable was kept); lower the learning rates" in err
    assert not (out / "ckpt").exists() and not (out / "best").exists()
    assert report["valid"]["auc"] is None
    assert main(["eval", str(out)]) == 2  # nothing to score, and why: not "train the run first"
    assert capsys.readouterr().err == (
        f"error: {out}: no complete checkpoint to evaluate; its training diverged at step {step}, before one was "
        "written (report.json); train it again with lower learning rates\n"
    )


def test_a_run_that_diverges_after_a_kept_best_reports_that_model(tmp_path, monkeypatch):
    """The ranks stop together where a window's loss is NaN, also between two log lines (checked before
    an evaluation): the kept best model is the one the report scores."""
    cfg = load_config(CONFIGS / "demo.yaml", [*SMALL_SYNTH, "train.log_every=7", "train.eval_every=4",
                                              "train.max_steps=40"])  # fmt: skip
    step_once = Trainer.train_step

    def nan_from_step_9(self, batch, global_size=None):
        loss = step_once(self, batch, global_size)
        return loss * math.nan if self.progress.step >= 9 else loss

    monkeypatch.setattr(Trainer, "train_step", nan_from_step_9)
    report = Trainer(cfg, tmp_path / "r").fit()
    assert report["diverged_at_step"] == 12 and report["steps"] == 12  # the check before step 12's evaluation
    assert report["best_step"] == 8 and math.isfinite(report["valid"]["auc"])
    assert sorted(p.name for p in (tmp_path / "r" / "ckpt").iterdir()) == ["step_00000004", "step_00000008"]
    from recscale.cli import diverged_line

    assert "(the report scores the best model, of step 8)" in diverged_line(report)


def test_fp16_table_storage_trains_resumes_and_is_refused_for_replicated_tables(tmp_path):
    """model.embedding.storage=fp16: fbgemm's fused kernel stores and updates fp16 rows (its row-wise
    Adagrad state stays fp32), the checkpoint holds fp16 tables and resumes; replicated tables refuse it."""
    over = [
        *SMALL_SYNTH,
        "model.embedding.storage=fp16",
        "distributed.sharding=table_wise",
        "train.max_steps=4",
    ]
    tr = Trainer(load_config(CONFIGS / "demo.yaml", over), tmp_path / "r")
    tables = [v for k, v in tr.module.state_dict().items() if ".ebc.embedding_bags." in k]
    assert tables and all(t.local_shards()[0].tensor.dtype == torch.float16 for t in tables)
    state = [v for v in tr.built.tables.state_dict()["state"].values()]
    assert state and all(t.dtype == torch.float32 for s in state for t in s.values() if torch.is_tensor(t))
    before = tables[0].local_shards()[0].tensor.clone()
    report = tr.fit()
    assert report["steps"] == 4 and not torch.equal(before, tables[0].local_shards()[0].tensor)
    resumed = Trainer(
        load_config(CONFIGS / "demo.yaml", [*over, "train.max_steps=6"]), tmp_path / "r", resume=True
    )
    assert resumed.fit()["steps"] == 6
    with pytest.raises(ConfigError, match="storage=fp16 needs tables sharded"):
        load_config(
            CONFIGS / "demo.yaml", ["model.embedding.storage=fp16", "distributed.sharding=data_parallel"]
        )


def test_bf16_warns_where_it_is_emulated(monkeypatch):
    import warnings

    from recscale.train import precision

    cpu = torch.device("cpu")
    monkeypatch.setattr(precision, "native_bf16", lambda device: False)
    with pytest.warns(UserWarning, match="emulated and much slower"):
        precision.warn_if_emulated("bf16", cpu)
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        precision.warn_if_emulated("bf16", cpu)
        precision.warn_if_emulated("fp32", cpu)


def test_bf16_computes_in_bf16_and_keeps_fp32_masters(tmp_path):
    """train.precision=bf16: the dense network's matmuls run in bf16 (autocast), while weights, their
    gradients, Adam's state, the loss and the logits the metrics see stay fp32; training follows fp32's."""
    over = [*SMALL_SYNTH, "train.max_steps=8", "model.dropout=0", "train.early_stopping=null"]
    reports = {}
    for p in ("fp32", "bf16"):
        trainer = Trainer(load_config(CONFIGS / "demo.yaml", [*over, f"train.precision={p}"]), tmp_path / p)
        seen: list[torch.dtype] = []
        linear = next(m for m in trainer.module.modules() if isinstance(m, torch.nn.Linear))
        linear.register_forward_hook(lambda _m, _i, out, seen=seen: seen.append(out.dtype))
        reports[p] = trainer.fit()
        assert seen[0] == (torch.bfloat16 if p == "bf16" else torch.float32)
        dense = trainer.built.dense
        assert all(q.dtype == torch.float32 for g in dense.param_groups for q in g["params"])
        assert all(v.dtype == torch.float32 for s in dense.state.values() for v in s.values() if v.dim())
    fp32, bf16 = (losses(tmp_path / p) for p in ("fp32", "bf16"))
    assert list(fp32) == list(bf16) == list(range(1, 9))
    assert max(abs(fp32[s] - bf16[s]) for s in fp32) < 2e-2
    assert fp32 != bf16  # it did compute in another precision
    assert abs(reports["fp32"]["valid"]["auc"] - reports["bf16"]["valid"]["auc"]) < 0.02


_MMAPPED_BLOCKS = """
import ctypes, sys, torch
from recscale.train.memory import keep_freed_memory
class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
if sys.argv[1] == "keep":
    assert keep_freed_memory()
before = libc.mallinfo2().hblks  # importing torch mmaps a few blocks of its own
x = torch.empty(64 << 20, dtype=torch.uint8)  # 64 MiB: above any mmap threshold glibc adapts to
print(libc.mallinfo2().hblks - before)
"""


@pytest.mark.skipif(not Path("/lib/x86_64-linux-gnu/libc.so.6").exists(), reason="glibc only")
@pytest.mark.parametrize(("mode", "mmapped"), [("system", 1), ("keep", 0)])
def test_reuse_memory_serves_large_blocks_from_the_heap(mode, mmapped):
    """train.reuse_memory: glibc serves a 64 MiB tensor with its own mmap by default (unmapped again on free,
    so the next step page-faults it back in); after keep_freed_memory() it comes from the heap, reused."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _MMAPPED_BLOCKS, mode], capture_output=True, text=True, check=True
    )
    assert int(out.stdout.split()[-1]) == mmapped


def _in_a_fresh_process(test):
    """Run ``test`` (a test function) alone in a new pytest process: ``_mmapped_blocks`` reads process-wide
    glibc state that earlier tests in a long-lived worker disturb (the likely cause: the main thread moved off
    glibc's main arena, where a huge block is mmapped whatever the tuning; not proven). These tests failed in
    full-suite runs with the tuning in effect and passed alone."""
    import functools
    import os

    @functools.wraps(test)
    def alone(*args: object, **kwargs: object) -> None:
        if os.environ.get("RECSCALE_TEST_ALONE") == "1":
            test(*args, **kwargs)
            return
        node = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
        env = {**os.environ, "RECSCALE_TEST_ALONE": "1"}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", node]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=CONFIGS.parent, timeout=300)
        assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]

    return alone


def _mmapped_blocks() -> int:
    """How many mmapped blocks glibc serves a large tensor with, in this process: 1 by default, 0 while
    train.reuse_memory's tuning is in effect. (1 GiB more than the heap's free bytes: larger than any free
    block earlier tests in this process left, which glibc would serve it from; never written to, so it
    costs address space only.)"""
    import ctypes

    class Info(ctypes.Structure):  # glibc's struct mallinfo2
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    info = libc.mallinfo2()
    before = info.hblks
    x = torch.empty((1 << 30) + info.fordblks, dtype=torch.uint8)
    blocks = libc.mallinfo2().hblks - before
    del x
    return blocks


@pytest.mark.skipif(not Path("/lib/x86_64-linux-gnu/libc.so.6").exists(), reason="glibc only")
@pytest.mark.parametrize("fails", [False, True])
@_in_a_fresh_process
def test_fit_undoes_its_process_group_and_malloc_tuning(tmp_path, monkeypatch, fails):
    """train.reuse_memory's malloc tuning and the group of one the Trainer started outlasted fit(): the
    rest of the process ran with glibc's mmap off, and with a process group nobody would destroy. Nor does
    a run without a progress bar start tqdm's monitor thread (a disabled tqdm bar did)."""
    import torch.distributed as dist
    import tqdm

    from recscale.distributed.env import shutdown
    from recscale.train.memory import release_freed_memory

    # What an earlier test's Trainer that never ran fit() left set up: this Trainer sets up its own.
    shutdown()
    release_freed_memory()
    monkeypatch.setattr(tqdm.tqdm, "monitor", None)  # tqdm's one monitor, started by the first bar
    tr = Trainer(load_config(CONFIGS / "demo.yaml", [*SMALL_SYNTH, "train.max_steps=2"]), tmp_path / "r")
    assert dist.is_initialized() and _mmapped_blocks() == 0  # in effect while it trains
    if fails:

        def broken(*args: object) -> torch.Tensor:
            raise RuntimeError("a step failed")

        tr.train_step = broken  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="a step failed"):
            tr.fit()
    else:
        assert tr.fit()["steps"] == 2
    assert _mmapped_blocks() == 1  # glibc mmaps large blocks again
    assert not dist.is_initialized()
    assert tqdm.tqdm.monitor is None


@pytest.mark.skipif(not Path("/lib/x86_64-linux-gnu/libc.so.6").exists(), reason="glibc only")
@_in_a_fresh_process
def test_fit_leaves_the_callers_process_group_and_malloc_tuning_alone(tmp_path):
    """A group the caller started (to score trainer.module after fit) and malloc tuning it set up stay."""
    import torch.distributed as dist

    from recscale.distributed.env import init_distributed, shutdown
    from recscale.train.evaluate import predict
    from recscale.train.memory import keep_freed_memory, release_freed_memory

    init_distributed()
    assert keep_freed_memory()
    try:
        tr = Trainer(load_config(CONFIGS / "demo.yaml", [*SMALL_SYNTH, "train.max_steps=2"]), tmp_path / "r")
        tr.fit()
        assert dist.is_initialized() and _mmapped_blocks() == 0
        assert tr.test_ds is not None and len(predict(tr.module, tr.test_ds, 512, 0)) == len(tr.test_ds)
    finally:
        release_freed_memory()
        shutdown()
    assert _mmapped_blocks() == 1


@pytest.mark.skipif(not Path("/lib/x86_64-linux-gnu/libc.so.6").exists(), reason="glibc only")
@_in_a_fresh_process
def test_a_trainer_that_never_trains_is_closed_by_its_with_block(tmp_path):
    """A Trainer built to score a run (resume=True, no fit) kept its process group, malloc tuning and the
    run directory's lock until the process ended: nothing undid them."""
    import torch.distributed as dist

    from recscale.distributed.env import shutdown
    from recscale.train.evaluate import predict
    from recscale.train.memory import release_freed_memory

    cfg = load_config(CONFIGS / "demo.yaml", [*SMALL_SYNTH, "train.max_steps=2"])
    Trainer(cfg, tmp_path / "r").fit()
    shutdown()  # what an earlier test left set up: this Trainer sets up its own
    release_freed_memory()
    lock = f"import fcntl, os; fcntl.lockf(os.open({str(tmp_path / 'r' / '.lock')!r}, os.O_RDWR), fcntl.LOCK_EX | fcntl.LOCK_NB)"
    with Trainer(cfg, tmp_path / "r", resume=True) as tr:
        assert dist.is_initialized() and _mmapped_blocks() == 0
        assert tr.test_ds is not None and len(predict(tr.module, tr.test_ds, 512, 0)) == len(tr.test_ds)
        assert subprocess.run([sys.executable, "-c", lock], capture_output=True).returncode != 0  # held
    assert not dist.is_initialized() and _mmapped_blocks() == 1
    assert subprocess.run([sys.executable, "-c", lock], capture_output=True).returncode == 0


def test_a_resume_below_the_runs_step_is_refused(tmp_path):
    """Resumed at step 8 with max_steps=4 it trained nothing, exited 0 with an examples/s of nothing, and
    rewrote config.yaml with max_steps 4."""
    common = [*SMALL_SYNTH, "train.eval_every=4"]
    Trainer(load_config(CONFIGS / "demo.yaml", [*common, "train.max_steps=8"]), tmp_path / "r").fit()
    before = (tmp_path / "r" / "config.yaml").read_text()
    with pytest.raises(ConfigError, match="the run is at step 8, past the 4 steps train.max_steps=4"):
        Trainer(
            load_config(CONFIGS / "demo.yaml", [*common, "train.max_steps=4"]), tmp_path / "r", resume=True
        )
    assert (tmp_path / "r" / "config.yaml").read_text() == before


def test_a_resume_refuses_a_valid_file_changed_since_the_run_read_it(tmp_path):
    """The resume read the changed file anew and went on comparing its evaluations with a best measured on the
    old one (restore_best could go back to weights chosen on other data)."""
    lines = ["label,user,item", *(f"{i % 3 == 0:d},{i % 7},{i % 11}" for i in range(300))]
    (tmp_path / "train.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "valid.csv").write_text("\n".join(lines[:101]) + "\n")
    data = f"data: {{format: csv, train: {tmp_path / 'train.csv'}, valid: {tmp_path / 'valid.csv'}, num_workers: 0, "
    (tmp_path / "run.yaml").write_text(
        data + "schema: {label: label, sparse: [{name: user}, {name: item}]}}\n"
        "model: {name: fm}\ntrain: {batch_size: 32, max_steps: 4, eval_every: 2, progress: false}\n"
    )
    Trainer(load_config(tmp_path / "run.yaml"), tmp_path / "r").fit()
    more = load_config(tmp_path / "run.yaml", ["train.max_steps=6"])
    (tmp_path / "valid.csv").write_text("\n".join(lines[:51]) + "\n")
    valid = tmp_path / "valid.csv"
    with pytest.raises(
        RecscaleError, match=rf"data.valid {valid}: {valid} was rewritten \(size or modification time\) since"
    ):
        Trainer(more, tmp_path / "r", resume=True)


def test_a_resume_refused_for_changed_parts_names_them(tmp_path):
    """A run over a folder of parts, resumed after one was rewritten and one added, was refused with "the training
    data is not what this run was prepared from": which of its thousand parts, it did not say."""
    lines = ["label,user,item", *(f"{i % 3 == 0:d},{i % 7},{i % 11}" for i in range(300))]
    parts = tmp_path / "days"
    parts.mkdir()
    for day in (1, 2, 3):
        (parts / f"day{day}.csv").write_text("\n".join(lines[:1] + lines[day * 50 : day * 50 + 100]) + "\n")
    (tmp_path / "run.yaml").write_text(
        f"data: {{format: csv, train: {parts}, num_workers: 0, schema: {{label: label, sparse: [{{name: user}}, "
        "{name: item}]}}\nmodel: {name: fm}\ntrain: {batch_size: 32, max_steps: 4, progress: false, early_stopping: null}\n"
    )
    Trainer(load_config(tmp_path / "run.yaml"), tmp_path / "r").fit()
    (parts / "day2.csv").write_text("\n".join(lines[:60]) + "\n")
    (parts / "day4.csv").write_text("\n".join(lines[:1] + lines[200:]) + "\n")
    with pytest.raises(RecscaleError) as e:
        Trainer(load_config(tmp_path / "run.yaml", ["train.max_steps=6"]), tmp_path / "r", resume=True)
    assert str(e.value) == (
        f"data.train {parts}: {parts / 'day2.csv'} was rewritten (size or modification time), {parts / 'day4.csv'} "
        "is new since this run read it; resume with the data it started with, or train a new run on the new data "
        f"from this one's model (train.init_from={tmp_path / 'r'})"
    )


def test_a_resume_not_finding_its_data_says_what_to_do_rather_than_what_it_refuses(
    tmp_path, monkeypatch, capsys
):
    """A run trained on relative data paths, resumed from another directory, was told "data.train: train.csv
    does not exist; fix the path in the config or set data.train=PATH", and a resume with data.train=PATH was
    refused (a resumed run keeps its data)."""
    lines = ["label,user,item", *(f"{i % 3 == 0:d},{i % 7},{i % 11}" for i in range(300))]
    (tmp_path / "train.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "run.yaml").write_text(
        "data: {format: csv, train: train.csv, num_workers: 0, schema: {label: label, sparse: [{name: user}]}}\n"
        "model: {name: fm}\ntrain: {batch_size: 32, max_steps: 2, progress: false}\n"
    )
    monkeypatch.chdir(tmp_path)
    Trainer(load_config(tmp_path / "run.yaml"), tmp_path / "r").fit()
    monkeypatch.chdir(tmp_path / "r")
    assert main(["train", "--resume", "--out", str(tmp_path / "r"), "train.max_steps=4"]) == 2
    assert capsys.readouterr().err == (
        f"error: resume=True (CLI: --resume): data.train train.csv is relative to the working directory and not "
        f"found from {tmp_path / 'r'}; resume from the directory the run was started in\n"
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.csv").rename(tmp_path / "moved.csv")
    saved = tmp_path / "r" / "config.yaml"
    saved.write_text(saved.read_text().replace("train: train.csv", f"train: {tmp_path / 'train.csv'}"))
    assert main(["train", "--resume", "--out", str(tmp_path / "r"), "train.max_steps=4"]) == 2
    assert capsys.readouterr().err.endswith(
        "is not found; a resumed run reads the data it trained on, unchanged, at the path its config.yaml "
        "names: restore the file there\n"
    )


def test_trainer_errors_name_the_trainers_arguments_and_the_clis_options(tmp_path):
    """From Python they said "pass --resume" and "another --out", options only the CLI has."""
    cfg = load_config(CONFIGS / "demo.yaml", SMALL_SYNTH)
    run = tmp_path / "r"
    (run / "ckpt").mkdir(parents=True)
    (run / "report.json").write_text("{}")
    with pytest.raises(RecscaleError) as e:
        Trainer(cfg, run)
    assert "pass resume=True (CLI: --resume) to continue it or choose another run_dir (CLI: --out)" in str(
        e.value
    )
    with pytest.raises(
        RecscaleError, match=r"^resume=True \(CLI: --resume\): .* does not exist; name the directory"
    ):
        Trainer(cfg, tmp_path / "none", resume=True)
    assert not (tmp_path / "none").exists()


def test_a_qcomms_run_resumes_on_one_process_with_qcomms_fp32(tmp_path):
    """One process refuses qcomms, and a resume refused any change of them: a run of several ranks with
    qcomms could not continue on one process at all."""
    common = [*SMALL_SYNTH, "train.eval_every=2"]
    Trainer(load_config(CONFIGS / "demo.yaml", [*common, "train.max_steps=2"]), tmp_path / "r").fit()
    saved = tmp_path / "r" / "config.yaml"  # as a 2-rank run with quantized collectives writes it
    saved.write_text(saved.read_text().replace("forward: fp32", "forward: int8"))
    longer = [*common, "train.max_steps=4", "distributed.qcomms.forward=int8"]
    with pytest.raises(ConfigError, match="this run is one process"):
        Trainer(load_config(CONFIGS / "demo.yaml", longer), tmp_path / "r", resume=True)
    report = Trainer(load_config(CONFIGS / "demo.yaml", longer[:-1]), tmp_path / "r", resume=True).fit()
    assert report["steps"] == 4


def test_eval_group_by_scores_the_group_auc_of_known_ids(tmp_path, capsys):
    """`recscale eval --group-by user`: the group AUC over the users the run knows, from the same logits
    as the AUC; a user unseen in training (OOV) is in no group; a multi-id or unknown field is one line."""
    from recscale.data.dataset import ArrayDataset
    from recscale.train.evaluate import predict
    from recscale.train.metrics import group_auc
    from recscale.train.runs import load_trained

    rng = np.random.default_rng(0)
    rows = [f"{int(rng.random() < 0.4)},{i % 9},{i % 13},{i % 5}|{i % 3}" for i in range(400)]
    header = "label,user,item,tags"
    (tmp_path / "train.csv").write_text("\n".join([header, *rows]) + "\n")
    unseen = [f"{i % 2},u{i % 4},{i % 13},1" for i in range(40)]  # users training never saw
    (tmp_path / "valid.csv").write_text("\n".join([header, *rows[:200], *unseen]) + "\n")
    (tmp_path / "run.yaml").write_text(
        f"data:\n  format: csv\n  train: {tmp_path / 'train.csv'}\n"
        "  schema: {label: label, sparse: [{name: user}, {name: item}, {name: tags, multi: true, sep: '|'}]}\n"
        "  num_workers: 0\nmodel: {name: fm}\ntrain: {batch_size: 32, max_steps: 20, progress: false}\n"
    )
    Trainer(load_config(tmp_path / "run.yaml"), tmp_path / "r").fit()
    m = eval_run(tmp_path / "r", str(tmp_path / "valid.csv"), group_by="user")
    plain = eval_run(tmp_path / "r", str(tmp_path / "valid.csv"))
    assert {k: m[k] for k in plain} == plain and m["rows"] == 240
    assert m["gauc_rows"] == 200 and m["gauc_groups"] == 9  # the 40 unseen users' rows are left out
    # The same figure from the first 200 rows' own logits, grouped by their user ids.
    built = load_trained(tmp_path / "r")[2]
    ds = ArrayDataset(tmp_path / "r" / "data" / "train")  # valid.csv's first 200 rows are its first 200
    logits = predict(built.module, ds, 8192, 0)
    want = group_auc(
        logits[:200], torch.from_numpy(ds.labels()[:200].copy()), torch.from_numpy(ds.ids("user")[:200])
    )
    assert m["gauc"] == pytest.approx(want["gauc"], abs=1e-6)
    (tmp_path / "one.csv").write_text(f"{header}\n{rows[0]}\n")  # one row: its user holds one class
    assert main(["eval", str(tmp_path / "r"), "--data", str(tmp_path / "one.csv"), "--group-by", "user"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["gauc"] is None and "gauc is null: no user id the run knows holds both" in err
    for field in ("tags", "nope"):
        assert (
            main(["eval", str(tmp_path / "r"), "--data", str(tmp_path / "valid.csv"), "--group-by", field])
            == 2
        )
        assert capsys.readouterr().err == (
            f"error: --group-by {field}: not a single-id feature of {tmp_path / 'r'}; group by one of user, item\n"
        )


def test_training_reports_and_stops_on_the_group_auc(tmp_path):
    """train.group_by: every evaluation logs the group AUC too, early_stopping.metric=gauc keeps the step
    where it peaked, and `recscale eval` scores it over the run's own grouping without being told."""
    rng = np.random.default_rng(1)
    header = "label,user,item"
    rows = [f"{int(rng.random() < 0.3 + 0.05 * (i % 7))},{i % 11},{i % 17}" for i in range(600)]
    (tmp_path / "train.csv").write_text("\n".join([header, *rows[:480]]) + "\n")
    (tmp_path / "valid.csv").write_text("\n".join([header, *rows[480:]]) + "\n")
    text = (
        f"data:\n  format: csv\n  train: {tmp_path / 'train.csv'}\n  valid: {tmp_path / 'valid.csv'}\n"
        "  schema: {label: label, sparse: [{name: user}, {name: item}]}\n  num_workers: 0\nmodel: {name: fm}\n"
        "train: {batch_size: 32, max_steps: 40, eval_every: 5, progress: false, group_by: user,\n"
        "        early_stopping: {metric: gauc, patience: 100}}\n"
    )
    (tmp_path / "run.yaml").write_text(text)
    report = Trainer(load_config(tmp_path / "run.yaml"), tmp_path / "r").fit()
    valid = [r for r in map(json.loads, (tmp_path / "r" / "metrics.jsonl").read_text().splitlines())
             if r["split"] == "valid"]  # fmt: skip
    assert len(valid) == 8 and all(r["gauc_groups"] == 11 and r["gauc_rows"] == 120 for r in valid)
    peak = max(valid, key=lambda r: r["gauc"])  # the first of equal peaks: a tie is no improvement
    assert len({r["gauc"] for r in valid}) > 1 and report["best_step"] == peak["step"]
    assert report["valid"]["gauc"] == pytest.approx(peak["gauc"], abs=1e-9)  # the kept model's
    m = eval_run(tmp_path / "r", str(tmp_path / "valid.csv"))
    assert m["gauc_by"] == "user" and m["gauc"] == pytest.approx(peak["gauc"], abs=1e-6)
    with pytest.raises(ConfigError, match="early_stopping.metric=gauc is the group AUC over train.group_by"):
        load_config(tmp_path / "run.yaml", ["train.group_by=null"])
    with pytest.raises(
        ConfigError, match=r"^train.group_by=nope: not a single-id feature of the data; group by"
    ):
        Trainer(load_config(tmp_path / "run.yaml", ["train.group_by=nope"]), tmp_path / "r2")
    assert not (tmp_path / "r2").exists()


def test_negative_downsampling_trains_on_fewer_negatives_and_predicts_calibrated(tmp_path):
    """data.negative_sampling_rate: every positive and a fixed hash's quarter of the negatives are trained on,
    and the loss's log(1/w) shift keeps the model's own predictions calibrated on unsampled valid rows (the
    same run without the shift predicts ~2.2x the valid CTR)."""
    from recscale.data.dataset import ArrayDataset, held_out

    common = [*SMALL_SYNTH, "train.epochs=3", "model.name=lr", "train.early_stopping=null"]
    report = Trainer(
        load_config(CONFIGS / "demo.yaml", [*common, "data.negative_sampling_rate=0.25"]), tmp_path / "r"
    ).fit()
    labels = ArrayDataset(tmp_path / "r" / "data" / "train").labels()
    kept = (labels > 0) | held_out(len(labels), 0.25, salt=1)
    negatives = int((~kept).sum() + (kept & (labels == 0)).sum())
    assert report["negative_sampling"] == {"rate": 0.25, "train_rows": int(kept.sum())}
    assert 0.2 < (kept & (labels == 0)).sum() / negatives < 0.3 and kept[labels > 0].all()
    assert report["examples"] == 3 * (int(kept.sum()) // 256) * 256  # epochs over the kept rows only
    assert abs(report["valid"]["calibration"] - 1) < 0.15
    with pytest.raises(ConfigError, match="negative_sampling_rate"):
        load_config(CONFIGS / "demo.yaml", [*common, "data.negative_sampling_rate=0"])


@pytest.mark.parametrize("source", ["csv", "parquet"])
def test_predict_scores_new_rows_without_a_label_column(tmp_path, source, capsys):
    """`recscale predict RUN --data NEW --out SCORES`: new rows have no label; each row's score (eval's, for the
    same rows) and its position in the file, in file order, bad rows --on-bad-row skip drops left out."""
    import pyarrow.parquet as pq

    rng = np.random.default_rng(3)
    rows = [(int(rng.random() < 0.3), i % 7, i % 11) for i in range(200)]
    (tmp_path / "train.csv").write_text("label,user,item\n" + "".join(f"{y},{u},{i}\n" for y, u, i in rows))
    (tmp_path / "run.yaml").write_text(
        f"data: {{format: csv, train: {tmp_path / 'train.csv'}, num_workers: 0, "
        "schema: {label: label, sparse: [{name: user}, {name: item}]}}\n"
        "model: {name: fm}\ntrain: {batch_size: 32, max_steps: 10, progress: false}\n"
    )
    Trainer(load_config(tmp_path / "run.yaml"), tmp_path / "r").fit()
    new = [f"{u},{i}" for _, u, i in rows[:50]]
    new.insert(10, "1,2,3")  # a bad row: three cells under a two-column header
    if source == "csv":
        data = tmp_path / "new.csv"
        data.write_text("user,item\n" + "\n".join(new) + "\n")
    else:
        data = tmp_path / "new.parquet"
        users = [str(u) for _, u, _ in rows[:50]]
        users.insert(10, None)  # a missing id is valid (OOV): no bad row in Parquet
        items = [str(i) for _, _, i in rows[:50]]
        items.insert(10, "3")
        pq.write_table(pa.table({"item": items, "user": users}), data)
    out = tmp_path / "scores.csv"
    argv = ["predict", str(tmp_path / "r"), "--data", str(data), "--out", str(out), "--on-bad-row", "skip",
            "--format", source]  # fmt: skip
    assert main(argv) == 0
    table = pacsv.read_csv(out)
    if source == "csv":
        assert capsys.readouterr().out == f"scored 50 rows (1 bad rows dropped): {out}\n"
        assert table.column_names == ["score", "line"]
        assert table["line"].to_pylist() == [*range(2, 12), *range(13, 53)]
    else:
        assert capsys.readouterr().out == f"scored 51 rows: {out}\n"
        assert table.column_names == ["score", "row"] and table["row"].to_pylist() == list(range(1, 52))
        table = table.filter(pc.not_equal(table["row"], 11))
    # eval scores the same rows alike (their labels from the training file; other batches: float rounding)
    labelled = tmp_path / "labelled.csv"
    labelled.write_text("label,user,item\n" + "".join(f"{y},{u},{i}\n" for y, u, i in rows[:50]))
    eval_run(tmp_path / "r", str(labelled), predictions=tmp_path / "eval.csv")
    np.testing.assert_allclose(
        table["score"].to_numpy(), pacsv.read_csv(tmp_path / "eval.csv")["score"].to_numpy(), atol=1e-6
    )
    # A file of no rows (a header alone) gets a file of no scores, not an error: a day without traffic.
    if source == "csv":
        data.write_text("user,item\n")
    else:
        pq.write_table(pa.table({"item": pa.array([], pa.string()), "user": pa.array([], pa.string())}), data)
    capsys.readouterr()
    assert main(argv) == 0 and capsys.readouterr().out == f"scored 0 rows: {out}\n"
    empty = pacsv.read_csv(out)
    assert empty.num_rows == 0 and empty.column_names == ["score", "line" if source == "csv" else "row"]
    # Several files of no rows: the columns several files' scores get, the file column among them
    (tmp_path / "days").mkdir()
    for day in ("a", "b"):
        shutil.copy(data, tmp_path / "days" / f"{day}{data.suffix}")
    assert main([*argv[:3], str(tmp_path / "days"), *argv[4:]]) == 0
    assert pacsv.read_csv(out).column_names == ["score", "file", "line" if source == "csv" else "row"]
    with pytest.raises(ConfigError, match="data.schema.label"):  # a config's label names a column
        load_config(tmp_path / "run.yaml", ["data.schema.label=''"])


def test_the_bayes_floors_ne_is_over_the_split_its_logloss_is_over(tmp_path):
    """The teacher's floor LogLoss is over the whole split; its NE took the CTR of the rows the run kept of it:
    the negatives negative sampling kept (CTR 2-3x higher: NE 0.58 for 0.67), valid's selection half."""
    from recscale.data.dataset import ArrayDataset
    from recscale.train.metrics import normalized_entropy

    cases = {
        "train": ["data.synthetic.rows={train: 2000}", "data.negative_sampling_rate=0.2"],
        "valid": ["data.synthetic.rows={train: 2000, valid: 500}", "data.report_fraction=0.5"],
    }
    for split, overrides in cases.items():
        cfg = load_config(CONFIGS / "demo.yaml", [*SMALL_SYNTH, *overrides, "train.max_steps=1"])
        report = Trainer(cfg, tmp_path / split).fit()
        ctr = float(ArrayDataset(tmp_path / split / "data" / split).labels().mean())
        assert report["bayes_ne"] == pytest.approx(normalized_entropy(report["bayes_logloss"], ctr))


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".csv.gz"])  # .gz: compressed, as the readers read it
def test_eval_writes_each_rows_prediction(tmp_path, suffix, monkeypatch, capsys):
    """`recscale eval --predictions FILE`: one (label, score, line) row per row read, in file order, whose AUC
    and LogLoss are eval's; the input file itself, or a directory, is refused before anything is scored."""
    import pyarrow.parquet as pq

    from recscale.train.metrics import ctr_metrics

    rng = np.random.default_rng(2)
    lines = ["label,user,item", *(f"{int(rng.random() < 0.3)},{i % 7},{i % 11}" for i in range(300))]
    (tmp_path / "train.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "run.yaml").write_text(
        f"data: {{format: csv, train: {tmp_path / 'train.csv'}, num_workers: 0, "
        "schema: {label: label, sparse: [{name: user}, {name: item}]}}\n"
        "model: {name: fm}\ntrain: {batch_size: 32, max_steps: 10, progress: false}\n"
    )
    Trainer(load_config(tmp_path / "run.yaml"), tmp_path / "r").fit()
    out = tmp_path / f"scores{suffix}"
    assert (
        main(["eval", str(tmp_path / "r"), "--data", str(tmp_path / "train.csv"), "--predictions", str(out)])
        == 0
    )
    m = eval_run(tmp_path / "r", str(tmp_path / "train.csv"))
    table = pq.read_table(out) if suffix == ".parquet" else pacsv.read_csv(out)
    assert table.column_names == ["label", "score", "line"] and table.num_rows == m["rows"] == 300
    assert table["line"].to_pylist() == list(range(2, 302))  # the header is line 1
    labels = np.array([int(x.split(",")[0]) for x in lines[1:]])
    np.testing.assert_array_equal(table["label"].to_numpy(), labels)
    scores = torch.from_numpy(table["score"].to_numpy().astype(np.float64))
    got = ctr_metrics(torch.logit(scores), torch.from_numpy(labels.astype(np.float64)))
    assert got["auc"] == pytest.approx(m["auc"], abs=1e-6) and got["logloss"] == pytest.approx(
        m["logloss"], rel=1e-5
    )
    # Rows --on-bad-row skip drops leave gaps in the line column, which joins the scores back to the file.
    bad_lines = [lines[0], *lines[1:5], "x,1,2", *lines[5:9], "1,2", *lines[9:]]
    (tmp_path / "bad.csv").write_text("\n".join(bad_lines) + "\n")
    m = eval_run(tmp_path / "r", str(tmp_path / "bad.csv"), on_bad_row="skip", predictions=out)
    table = pq.read_table(out) if suffix == ".parquet" else pacsv.read_csv(out)
    assert m["skipped_rows"] == 2 and table.num_rows == 300
    assert table["line"].to_pylist() == [*range(2, 6), *range(7, 11), *range(12, 304)]
    np.testing.assert_array_equal(table["label"].to_numpy(), labels)
    for bad, why in (
        (tmp_path / "train.csv", "is the --data file;"),
        (tmp_path, "is a directory"),
        (tmp_path / "r" / "report.json", "is the run's own report.json"),
        (tmp_path / "r" / "ckpt" / "x.csv", "is the run's own ckpt/x.csv"),
        # A file where a directory goes: refused before the scoring, not after it.
        (tmp_path / "train.csv" / "x.csv", "train.csv is a file, not a directory"),
    ):
        with pytest.raises(RecscaleError, match=why):
            eval_run(tmp_path / "r", str(tmp_path / "train.csv"), predictions=bad)
    if suffix == ".csv":
        # An empty path was taken as no --predictions at all; --nproc's checks came from every rank after the
        # launch ("the other ranks were stopped").
        monkeypatch.setattr("recscale.distributed.launch.launch", lambda *a: pytest.fail("launched"))
        for argv, says in (
            (["--data", str(tmp_path / "train.csv"), "--predictions", ""], "--predictions is an empty path"),
            (["--data", str(tmp_path / "no.csv"), "--nproc", "2"], "--data .*no.csv: no such file"),
            (["--data", str(tmp_path / "train.csv"), "--predictions", str(tmp_path), "--nproc", "2"], "is a directory"),
        ):  # fmt: skip
            capsys.readouterr()
            assert main(["eval", str(tmp_path / "r"), *argv]) in (1, 2)
            err = capsys.readouterr().err
            assert re.search(says, err) and len(err.strip().splitlines()) == 1, err
    # A failed eval ends the process group its model load started, as a finished one does: the next run in
    # the process (a notebook's) found it there.
    import torch.distributed as dist

    from recscale.distributed.env import shutdown

    shutdown()  # what an earlier test in this process left set up: the eval below starts its own
    (tmp_path / "short.csv").write_text("label,user\n1,2\n")
    with pytest.raises(RecscaleError, match="item"):
        eval_run(tmp_path / "r", str(tmp_path / "short.csv"))
    assert not dist.is_initialized()
    upper = tmp_path / "S.PARQUET"  # written as CSV under a Parquet name
    eval_run(tmp_path / "r", str(tmp_path / "train.csv"), predictions=upper)
    assert pq.read_table(upper).num_rows == 300
    ml = tmp_path / "ml"  # a format that reads a directory (MovieLens): no output inside it
    ml.mkdir()
    with pytest.raises(RecscaleError, match="is inside the --data directory"):
        check_run_output(ml / "u.data", "--predictions", tmp_path / "r", str(ml))


def test_metrics_jsonl_is_there_for_a_run_that_logged_nothing(tmp_path):
    """The README lists metrics.jsonl in every run directory; a run with no train window logged and no split
    to evaluate had none."""
    cfg = load_config(
        CONFIGS / "demo.yaml",
        ["data.synthetic.rows={train: 512}", "data.num_workers=0", "train.max_steps=2", "train.log_every=100",
         "train.progress=false"],
    )  # fmt: skip
    Trainer(cfg, tmp_path / "r").fit()
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == ""


def test_a_run_trains_on_a_split_in_parts_and_sees_a_part_rewritten(tmp_path):
    """data.train a folder of parts and data.valid a glob pattern train as the whole files do; eval takes a
    pattern too; a part rewritten in place (same size) changes the split's fingerprint (it is read again)."""
    rng = np.random.default_rng(0)
    names = ["label", "user", "item"]

    def rows(n: int) -> list[str]:
        return [f"{rng.integers(0, 2)},u{rng.integers(0, 30)},i{rng.integers(0, 30)}" for _ in range(n)]

    train, valid = rows(900), rows(300)

    def write(path: Path, lines: list[str]) -> None:
        path.write_text("\n".join([",".join(names), *lines]) + "\n")

    write(tmp_path / "train.csv", train)
    write(tmp_path / "valid.csv", valid)
    (tmp_path / "train").mkdir()
    for i in range(3):
        write(tmp_path / "train" / f"part-{i}.csv", train[i * 300 : (i + 1) * 300])
    write(tmp_path / "valid_0.csv", valid[:100])
    write(tmp_path / "valid_1.csv", valid[100:])
    common = ["data.schema={label: label, sparse: [{name: user}, {name: item}]}", "model.name=lr",
              "train.max_steps=6", "train.batch_size=128", "train.eval_every=3", "train.progress=false",
              "data.num_workers=0"]  # fmt: skip
    valids = {}
    for name, tr, va in (("whole", "train.csv", "valid.csv"), ("parts", "train", "valid_*.csv")):
        cfg = load_config(
            CONFIGS / "frappe.yaml", [*common, f"data.train={tmp_path / tr}", f"data.valid={tmp_path / va}"]
        )
        valids[name] = Trainer(cfg, tmp_path / name).fit()["valid"]
    assert valids["parts"] == valids["whole"]
    scores = tmp_path / "scores.csv"
    assert (
        eval_run(tmp_path / "parts", str(tmp_path / "valid_*.csv"), predictions=scores)["auc"]
        == valids["whole"]["auc"]
    )
    table = pacsv.read_csv(scores).to_pydict()  # each score joined to its file and line
    assert table["file"] == [str(tmp_path / "valid_0.csv")] * 100 + [str(tmp_path / "valid_1.csv")] * 200
    assert table["line"] == [*range(2, 102), *range(2, 202)]
    from recscale.data.sources import source_fingerprint

    before = source_fingerprint("csv", str(tmp_path / "train"), "train", {})
    part = tmp_path / "train" / "part-1.csv"
    mtime = (tmp_path / "train").stat().st_mtime_ns
    part.write_text(part.read_text().replace(",u1,", ",u2,"))  # in place, the same size: the folder's stat
    assert (tmp_path / "train").stat().st_mtime_ns == mtime  # is unchanged
    assert source_fingerprint("csv", str(tmp_path / "train"), "train", {}) != before


def test_scores_are_not_written_over_a_file_the_data_pattern_reads(tmp_path, monkeypatch):
    """`predict RUN --data 'day*.csv' --out day1.csv` wrote the scores over day1.csv, the rows it had scored:
    check_output compared --out with the pattern's own name, which is no file."""
    run = tmp_path / "r"  # not read: the checks are of paths alone
    (tmp_path / "day1.csv").write_text("label,user\n1,a\n")
    for out in (tmp_path / "day1.csv", tmp_path / "day2.csv"):  # the file read; one the next run would read
        with pytest.raises(RecscaleError, match=r"day\d\.csv matches the --data pattern \S+day\*\.csv"):
            check_run_output(out, "--out", run, str(tmp_path / "day*.csv"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecscaleError, match=r"matches the --data pattern"):  # relative, as typed in a shell
        check_run_output(Path("day1.csv"), "--out", run, "day*.csv")
    check_run_output(tmp_path / "scores.csv", "--out", run, str(tmp_path / "day*.csv"))


def test_a_valid_split_sharing_files_with_training_warns(tmp_path):
    """`train: day_*` beside `valid: day_1` trained on the valid rows without a word: its metrics (and early
    stopping on them) are of rows the model saw."""
    for i in range(3):
        (tmp_path / f"day_{i}.csv").write_text(
            "label,user\n" + "".join(f"{(i + j) % 2},u{j % 7}\n" for j in range(60))
        )
    common = ["data.schema={label: label, sparse: [{name: user}]}", "model.name=lr", "train.max_steps=2",
              "train.batch_size=32", "train.progress=false", "data.num_workers=0"]  # fmt: skip
    cfg = load_config(CONFIGS / "frappe.yaml", [*common, f"data.train={tmp_path / 'day_*'}", f"data.valid={tmp_path / 'day_1.csv'}"])  # fmt: skip
    with pytest.warns(UserWarning, match=r"data\.valid reads .*day_1\.csv, which data\.train reads too"):
        Trainer(cfg, tmp_path / "r").fit()
    cfg = load_config(CONFIGS / "frappe.yaml", [*common, f"data.train={tmp_path / 'day_[02].csv'}", f"data.valid={tmp_path / 'day_1.csv'}"])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        Trainer(cfg, tmp_path / "r2").fit()


@pytest.mark.parametrize(("more", "warned"), [([], True), (["train.early_stopping.min_delta=1.0e-5"], False)])
def test_a_moving_average_without_a_stopping_threshold_warns(tmp_path, more, warned):
    """With train.ema_decay Frappe's Wukong gained 1e-6 of selection AUC at every evaluation for 500 steps at a low
    LR, and early stopping with min_delta 0 never stopped it (it headed for 100 epochs) without a word."""
    cfg = load_config(CONFIGS / "demo.yaml", [*SMALL_SYNTH, "train.ema_decay=0.9", *more])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(cfg, tmp_path / "r").close()
    said = [str(w.message) for w in caught if "train.ema_decay" in str(w.message)]
    assert bool(said) == warned and all("set train.early_stopping.min_delta, e.g. 1.0e-5" in w for w in said)
