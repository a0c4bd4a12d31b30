"""Multi-process training: parity with one process, resharded checkpoints, byte accounting, faults.

The multi-process runs are launched once per world size (module fixtures); each launch trains every
sharding type in turn. Run as a script, this file is the workers' program (see ``_worker``).
"""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from recscale.config import load_config
from recscale.distributed.launch import launch
from recscale.train.loop import Trainer, predict

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
REPO = CONFIGS.parent
SMALL = [
    "data.synthetic.rows.train=2048",
    "data.synthetic.rows.valid=256",
    "data.synthetic.rows.test=256",
    "data.synthetic.num_sparse=4",
    "data.synthetic.num_multi=1",
    "data.synthetic.vocab_sizes=64",
    "data.num_workers=0",
    "model.embedding.dim=8",
    "model.num_layers=1",
    "model.dropout=0",
    "train.batch_size=64",
    "train.max_steps=5",
    "train.log_every=1",
    "train.progress=false",
    "train.early_stopping=null",
]
TYPES = ["data_parallel", "table_wise", "column_wise", "row_wise", "table_row_wise", "table_column_wise"]
# Row-wise Adagrad keeps one accumulator per row of each *column shard*, so column sharding changes
# its updates (by design, in fbgemm); element-wise Adagrad is the same however columns are split.
ADAGRAD = ["train.sparse_optimizer.name=adagrad"]
VARIANTS = {t: [f"distributed.sharding={t}", *(ADAGRAD if "column" in t else [])] for t in TYPES} | {
    "fsdp": ["distributed.sharding=row_wise", "distributed.dense=fsdp"],
    "planner": ["distributed.sharding=planner", *ADAGRAD],
}
# Single-id features only, each table on a known rank: all-to-all volumes follow from the batch.
COMM = ["data.synthetic.num_multi=0", "distributed.sharding=table_wise",
        *(f"distributed.tables.s{i}={{type: table_wise, ranks: [{r}]}}" for i, r in enumerate([0, 1, 2, 2]))]  # fmt: skip
dist_mark = pytest.mark.dist


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


# ---------------------------------------------------------------- worker side
def _worker(spec_path: str) -> None:
    """Each job of the spec in turn: train a run, or resume one and score its test split."""
    logging.disable(logging.WARNING)  # TorchRec's planner and sharders warn on every run
    for job in json.loads(Path(spec_path).read_text()):
        cfg = load_config(CONFIGS / "demo.yaml", [*SMALL, *job["overrides"]])
        trainer = Trainer(cfg, Path(job["dir"]), resume=job["resume"])
        if not job["resume"]:
            trainer.fit()
        scores = predict(trainer.dmp, trainer.test_ds, 100, 0)
        if trainer.main:
            np.save(job["scores"], scores.numpy())


def _jobs(root: Path, world: int) -> list[dict]:
    """Train every variant at this world size, then resume the 4-rank runs and score them."""
    jobs = [{"dir": str(root / f"{name}_{world}"), "overrides": o, "resume": False,
             "scores": str(root / f"{name}_{world}.npy")} for name, o in VARIANTS.items()]  # fmt: skip
    if world == 4:
        jobs.append(
            {"dir": str(root / "comm_4"), "overrides": COMM, "resume": False, "scores": str(root / "c.npy")}
        )
    else:
        jobs += [{"dir": str(root / f"{name}_4"), "overrides": o, "resume": True,
                  "scores": str(root / f"{name}_4_at_{world}.npy")} for name, o in VARIANTS.items()]  # fmt: skip
    return jobs


def _run_world(root: Path, world: int, local: int) -> None:
    spec = root / f"spec_{world}.json"
    spec.write_text(json.dumps(_jobs(root, world)))
    launch([__file__, "worker", str(spec)], world, local, 0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """4 ranks as 2 hosts x 2, then 2 ranks on one host, then the single-process reference."""
    root = tmp_path_factory.mktemp("dist")
    _run_world(root, 4, 2)
    _run_world(root, 2, 2)
    references = [{"dir": str(root / name), "overrides": o, "resume": False, "scores": str(root / f"{name}.npy")}
                  for name, o in (("reference", []), ("reference_adagrad", ADAGRAD))]  # fmt: skip
    for job in references + _jobs(root, 1)[len(VARIANTS) :]:
        cfg = load_config(CONFIGS / "demo.yaml", [*SMALL, *job["overrides"]])
        trainer = Trainer(cfg, Path(job["dir"]), resume=job["resume"])
        if not job["resume"]:
            trainer.fit()
        np.save(job["scores"], predict(trainer.dmp, trainer.test_ds, 100, 0).numpy())
    return root


# ---------------------------------------------------------------- tests
@dist_mark
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_with_one_process(runs, variant, world):
    """N ranks with global batch G train step by step like one process with batch G."""
    ref = losses(runs / ("reference_adagrad" if ADAGRAD[0] in VARIANTS[variant] else "reference"))
    got = losses(runs / f"{variant}_{world}")
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4, 5]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-4), (step, got[step], ref[step])
    # The losses move: parity is not two untrained models agreeing.
    assert ref[5] < ref[1] - 0.05


@dist_mark
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_checkpoint_from_4_ranks_resumes_at_2_and_1(runs, variant):
    at4 = np.load(runs / f"{variant}_4.npy")
    for world in (2, 1):
        np.testing.assert_allclose(np.load(runs / f"{variant}_4_at_{world}.npy"), at4, rtol=0, atol=1e-5)
    ref = "reference_adagrad" if ADAGRAD[0] in VARIANTS[variant] else "reference"
    assert np.abs(at4 - np.load(runs / f"{ref}.npy")).max() < 1e-3  # and they are the trained model's


@dist_mark
def test_comm_bytes_match_hand_computed_volumes(runs):
    """Table-wise all-to-all and DDP all-reduce volumes, 4 ranks as 2 hosts x 2 (ranks 0,1 | 2,3)."""
    rec = [json.loads(line) for line in (runs / "comm_4" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rec if r["split"] == "train"]
    report = json.loads((runs / "comm_4" / "report.json").read_text())
    b, d, world = 64 // 4, 8, 4
    owner = {"s0": 0, "s1": 1, "s2": 2, "s3": 2}
    host = [0, 0, 1, 1]
    a2a = {"intra": 0, "inter": 0}
    for o in owner.values():
        for r in range(world):
            if r != o:
                where = "intra" if host[r] == host[o] else "inter"
                # ids to the owner: lengths (int32) and values (int64), one id per row;
                # pooled embeddings back (float32), their gradients to the owner again.
                a2a[where] += b * 4 + b * 8 + 2 * b * d * 4
    for r in range(world):  # before the ids, every rank tells every other its split sizes and
        for s in range(world):  # batch size: 3 int64 (TorchRec's KJTAllToAll)
            if r != s:
                a2a["intra" if host[r] == host[s] else "inter"] += 3 * 8
    n = report["parameters"]["dense"] * 4
    ring = (
        2 * (world - 1) / world * n
    )  # each rank to its successor: 0>1 intra, 1>2 inter, 2>3 intra, 3>0 inter
    for r in train:
        assert r["comm"]["all_to_all"] == a2a
        assert r["comm"]["all_reduce"] == {"intra": round(2 * ring), "inter": round(2 * ring)}
        assert r["comm_inter_bytes"] == r["comm"]["all_to_all"]["inter"] + r["comm"]["all_reduce"]["inter"]


# ---------------------------------------------------------------- faults
LONG = [*SMALL, "data.synthetic.rows.train=20000", "train.eval_every=20"]


def _train_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not any(r["step"] >= step and r["split"] == "train" for r in _train_records(run_dir)):
        assert proc.poll() is None and time.monotonic() < deadline, "training did not get going"
        time.sleep(0.05)


def _pid_of_rank(run_dir: Path, rank: int) -> int:
    """The worker process of ``rank`` in the job writing ``run_dir``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"recscale.cli" in cmd and str(run_dir).encode() in cmd and f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no rank {rank} process")


@dist_mark
def test_killed_rank_stops_the_job_in_bounded_time_with_one_clear_line(tmp_path):
    """2 hosts x 1 rank: kill -9 one rank; the other host's rank and agent stop too."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "recscale.cli", "train", str(CONFIGS / "demo.yaml"), *LONG,
           "train.max_steps=100000", "--out", str(run_dir), "--nproc", "2", "--local-world-size", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    _wait_for_step(run_dir, 3, proc)
    victim = _pid_of_rank(run_dir, 1)
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert time.monotonic() - t0 < 30
    assert proc.returncode == 2
    assert err.strip().splitlines()[-1] == (
        f"error: rank 1 (pid {victim}) was killed by SIGKILL; the other ranks were stopped"
    )
    assert "Traceback" not in err


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1"]
RECSCALE = ["--nproc", "2", "--local-world-size", "1", "--max-restarts", "1"]


@dist_mark
@pytest.mark.parametrize("launcher", ["torchrun, 1 host x 2", "recscale --nproc, 2 hosts x 1"])
def test_restart_resumes_from_the_last_checkpoint(tmp_path, launcher):
    """With --max-restarts 1 a killed rank restarts the job, which resumes from step 20."""
    run_dir = tmp_path / "run"
    train = [
        "-m",
        "recscale.cli",
        "train",
        str(CONFIGS / "demo.yaml"),
        *LONG,
        "train.max_steps=60",
        "--out",
        str(run_dir),
    ]
    cmd = [*TORCHRUN, *train] if launcher.startswith("torchrun") else [sys.executable, *train, *RECSCALE]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    _wait_for_step(run_dir, 23, proc)
    os.kill(_pid_of_rank(run_dir, 1), signal.SIGKILL)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-2000:]
    assert "restart 1: resumed from" in err and "step_00000020" in err
    steps = [r["step"] for r in _train_records(run_dir) if r["split"] == "train"]
    assert steps == list(range(1, 61))  # what the killed attempt did after step 20 was dropped, then redone
    assert json.loads((run_dir / "report.json").read_text())["steps"] == 60


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(sys.argv[2])
