"""Faults in training: in a multi-process job a killed rank, a hung rank, a restart that resumes, and the
launcher's bookkeeping behind them; SIGTERM to one process. Each test starts its own processes (pytest-xdist
may run them side by side)."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import ctrl_c_as_in_a_terminal
from test_distributed import CONFIGS, REPO, SMALL, dist_mark

from recscale.cli import main
from recscale.distributed import env as dist_env
from recscale.distributed.env import free_port, lost_peer
from recscale.distributed.launch import _first_cause, _kill_hung, launch
from recscale.errors import RecscaleError
from recscale.train.checkpoint import list_checkpoints


# ---------------------------------------------------------------- faults (no processes needed)
class _Agent:  # what _kill_hung reads of an agent's Popen
    pid = os.getpid()


def test_a_timed_out_rank_names_the_ranks_that_did_not_time_out(tmp_path, monkeypatch):
    """Rank 0 of 4 times out, and rank 2 too: ranks 1 and 3 are the hung ones, silent longest first."""
    store = torch.distributed.HashStore()
    now = time.time()
    for r, step, ago in ((0, 9, 1), (1, 7, 21), (2, 8, 20), (3, None, 30)):
        store.set(f"hb/{r}", json.dumps({"step": step, "time": now - ago, "pid": 1000 + r}))
    store.set("stuck/2", "1")
    monkeypatch.setattr(dist_env, "_heartbeat", dist_env._Heartbeat(store, 0, 4, 20.0))
    monkeypatch.setattr(dist_env, "_PEER_SETTLE_S", 0.3)
    monkeypatch.setenv(dist_env.FAULT_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 20000ms for recv")
    line = lost_peer(timeout)
    assert line == (
        "ranks 3 (last heartbeat before its first step, 30 s ago), 1 (last heartbeat at step 7, 21 s ago) "
        "stopped responding; rank 0 timed out waiting for them after distributed.timeout_s=20"
    )
    verdict = json.loads((tmp_path / "rank0_attempt1.json").read_text())
    assert (verdict["error"], verdict["pids"], verdict["attempt"]) == (line, [1003, 1001], 1)
    # Every rank timed out: no one to blame. A dead peer is not a timeout, nor is any other error.
    store.set("stuck/1", "1")
    store.set("stuck/3", "1")
    assert lost_peer(RuntimeError("Application timeout caused pair closure")) == (
        "rank 0 timed out after distributed.timeout_s=20, as did every other rank: each waited for another"
    )
    monkeypatch.setenv("RANK", "2")
    assert lost_peer(RuntimeError("[pair.cc:598] Connection closed by peer [127.0.0.1]:5")) == (
        "rank 2 lost contact with another rank (Connection closed by peer [127.0.0.1]:5); that rank failed first"
    )
    assert lost_peer(RuntimeError("DataLoader timed out after 5 seconds")) is None


def test_a_run_in_one_process_binds_its_own_store_port():
    """A run in one process asked for a free port, closed it, then bound it for its store: a port taken in
    between (another run starting beside it) failed the run ('address already in use')."""
    code = (
        "import socket; from recscale.distributed import env\n"
        "taken = socket.socket(); taken.bind(('127.0.0.1', 0)); taken.listen()\n"
        "env.free_port = lambda: taken.getsockname()[1]  # the port found free, taken since\n"
        "e = env.init_distributed(20); print('rank', e.rank, 'of', e.world_size); env.shutdown()\n"
    )
    clean = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=clean)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "rank 0 of 1"


def test_heartbeat_is_a_no_op_in_a_world_of_one(monkeypatch):
    monkeypatch.setattr(dist_env, "_heartbeat", None)
    dist_env.heartbeat(1)  # nothing to write to, and no error


def test_the_launcher_kills_the_hung_workers_of_its_own_agents_only(tmp_path):
    """A verdict's pids are SIGKILLed with their sessions if an agent is their parent, else left alone."""
    ours = subprocess.Popen(["sleep", "60"], start_new_session=True)  # as torch elastic starts a worker
    other = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    stranger = int(other.stdout.readline())  # a grandchild: no agent's worker
    try:
        verdict = {"pids": [ours.pid, stranger]}
        (tmp_path / "rank0.json").write_text(json.dumps(verdict))
        seen: set[Path] = set()
        assert _kill_hung(tmp_path, seen, [_Agent()]) == [verdict]  # type: ignore[list-item]
        assert ours.wait(timeout=10) == -signal.SIGKILL
        assert Path(f"/proc/{stranger}").exists()
        assert _kill_hung(tmp_path, seen, [_Agent()]) == []  # type: ignore[list-item]  # each verdict once
    finally:
        ours.kill()
        os.kill(stranger, signal.SIGKILL)
        other.wait()


def test_ranks_share_the_cores_this_process_may_use(monkeypatch):
    """--nproc gave each rank the machine's cores // N threads: 2 ranks confined to 2 of 64 cores (taskset, a
    container's cpuset) ran 32 threads each. They share the cores the process may run on, as torch counts."""
    from recscale.distributed import launch as launch_module

    class Started(Exception):
        pass

    seen: dict[str, str] = {}

    def popen(cmd: list[str], env: dict[str, str]) -> None:
        seen.update(env)
        raise Started

    monkeypatch.setattr(launch_module.subprocess, "Popen", popen)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    with pytest.raises(Started):
        launch(["-c", "pass"], 2, None, 0)
    assert seen["OMP_NUM_THREADS"] == "1"


def test_the_launcher_acts_on_a_hang_in_each_attempt(tmp_path, monkeypatch):
    """Rank 0 times out in attempt 0 and again, after a restart, in attempt 1: the launcher reads both verdicts.
    Both were written to rank0.json, which it had already read, so the second hung rank lived on and the job's
    next attempt waited for it ("rank 1 ... it never joined")."""
    store = torch.distributed.HashStore()
    store.set("hb/1", json.dumps({"step": 3, "time": time.time() - 9, "pid": 1001}))
    monkeypatch.setattr(dist_env, "_heartbeat", dist_env._Heartbeat(store, 0, 2, 8.0))
    monkeypatch.setattr(dist_env, "_PEER_SETTLE_S", 0.1)
    monkeypatch.setenv(dist_env.FAULT_DIR_ENV, str(tmp_path))
    timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 8000ms for recv")
    seen: set[Path] = set()
    for attempt in (0, 1):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
        assert lost_peer(timeout) is not None
        verdicts = _kill_hung(tmp_path, seen, [])
        assert [v["attempt"] for v in verdicts] == [attempt]


# ---------------------------------------------------------------- faults
LONG = [*SMALL, "data.synthetic.rows.train=20000", "train.eval_every=20"]
# Bounds on how long a job takes to end after a fault. Once a rank is gone, the launcher polls every
# 0.2 s, lets failing agents settle for 3 s and stops the rest: 5-8 s in all on a loaded 2-core box.
# Torch elastic's default grace between SIGTERM and SIGKILL is 30 s: a job that waits it out for a
# rank that cannot act on SIGTERM (a stopped one), or that hangs, ends later than these bounds.
ELASTIC_GRACE_S = 30
# A hung rank is found once its peer times out (distributed.timeout_s), then in 2 s, then as above.
HANG_MARGIN_S = 15


def _logged(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen) -> None:
    """Until the job has logged training ``step``; fails if it exits first or takes over 120 s."""
    deadline = time.monotonic() + 120
    while not any(r["step"] >= step and r["split"] == "train" for r in _logged(run_dir)):
        assert proc.poll() is None, "the job exited before it got going"
        assert time.monotonic() < deadline, f"training did not reach step {step} within 120 s"
        time.sleep(0.2)  # a finer poll would only take CPU from the job it waits for (2 cores)


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
    assert time.monotonic() - t0 < ELASTIC_GRACE_S
    assert proc.returncode == 2
    assert [x for x in err.splitlines() if x.startswith("error:")] == [  # not also rank 0's 'lost contact'
        f"error: rank 1 (pid {victim}) was killed by SIGKILL; the other ranks were stopped"
    ]
    assert "Traceback" not in err


@dist_mark
def test_a_crashed_rank_is_named_with_where_it_crashed(tmp_path):
    """A rank that aborts (as on a C++ exception no one caught) leaves its stacks to the launcher, whose
    line says in which function it died; the other rank is stopped."""
    program = tmp_path / "crash.py"
    program.write_text(
        "import os, time\nfrom recscale.distributed.env import init_distributed\n"
        "def _crash_here():\n    os.abort()\n"
        "if init_distributed().rank == 1:\n    _crash_here()\ntime.sleep(120)\n"
    )
    with pytest.raises(RecscaleError) as e:
        launch([str(program)], 2, 2, 0)
    assert re.fullmatch(
        r"rank 1 \(pid \d+\) was killed by SIGABRT in _crash_here \(crash\.py:4\); the other ranks were stopped",
        str(e.value),
    ), str(e.value)


@dist_mark
def test_a_rendezvous_port_taken_before_the_agents_bind_it_starts_the_job_on_another(tmp_path, monkeypatch):
    """The launcher finds a free port and its first agent binds it seconds later: a port taken in between failed
    the job ('the hosts' agents exited with codes [1, -15]', a traceback above). It starts again on another."""
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    ports = iter([squatter.getsockname()[1], free_port()])
    monkeypatch.setattr("recscale.distributed.launch.free_port", lambda: next(ports))
    program = tmp_path / "ranks.py"
    program.write_text(
        "import sys\nfrom recscale.distributed.env import init_distributed\n"
        "open(sys.argv[0] + '.rank%d' % init_distributed().rank, 'w').close()\n"
    )
    with squatter:
        launch([str(program)], 2, 1, 0)
    assert sorted(p.name for p in tmp_path.glob("ranks.py.rank*")) == ["ranks.py.rank0", "ranks.py.rank1"]


@dist_mark
def test_an_error_every_rank_hits_alike_is_not_said_to_have_stopped_the_others(tmp_path):
    """Every rank failing with one line of its own (a diverged --nproc run: all find it at one step) ended with
    'the other ranks were stopped', as if one rank's failure had stopped them."""
    program = tmp_path / "alike.py"
    program.write_text(
        "import sys\nfrom recscale.distributed.env import init_distributed, record_error\n"
        "init_distributed()\nrecord_error('train: the loss diverged', consequence=False)\nsys.exit(2)\n"
    )
    with pytest.raises(RecscaleError) as e:
        launch([str(program)], 2, 1, 0)
    assert str(e.value) == "train: the loss diverged (on all 2 ranks)"


@dist_mark
def test_one_ranks_error_is_the_jobs_one_line(tmp_path):
    """Rank 0 stops on a bad row (it prepares the data) and rank 1 then loses contact: the job says
    rank 0's line once (each rank used to print its own, then the launcher 'its error is printed above')."""
    data = tmp_path / "data.csv"
    data.write_text("label,a\n" + "1,3\n0,4\n" * 16 + "1,2,3\n")
    cmd = [sys.executable, "-m", "recscale.cli", "train", str(CONFIGS / "frappe.yaml"), f"data.train={data}",
           f"data.valid={data}", "data.schema={label: label, sparse: [{name: a}]}", "train.batch_size=8",
           "--out", str(tmp_path / "run"), "--nproc", "2"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 2
    assert [x for x in done.stderr.splitlines() if x.startswith("error:")] == [
        f"error: {data} line 34: has 3 columns, expected 2 (set data.on_bad_row: skip to drop such rows); "
        "the other ranks were stopped"
    ], done.stderr[-2000:]


@dist_mark
def test_hung_rank_is_named_and_the_job_ends_soon_after_the_timeout(tmp_path):
    """2 hosts x 1 rank: SIGSTOP one rank. The other times out, names it from its heartbeats, and the
    launcher kills it at once (a stopped process ignores the SIGTERM that torch elastic would send)."""
    run_dir, timeout_s = tmp_path / "run", 10
    cmd = [sys.executable, "-m", "recscale.cli", "train", str(CONFIGS / "demo.yaml"), *LONG,
           "train.max_steps=100000", f"distributed.timeout_s={timeout_s}", "--out", str(run_dir),
           "--nproc", "2", "--local-world-size", "1"]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        preexec_fn=ctrl_c_as_in_a_terminal,
    )  # stopped by SIGINT below if it hangs
    victim = None
    try:
        _wait_for_step(run_dir, 3, proc)
        # Beats are rate-limited from the one the group forms with: a fast job can reach step 3 before
        # rank 1 has beaten after a step, so let one beat interval pass while it trains on.
        time.sleep(dist_env._BEAT_EVERY_S + 0.5)
        victim = _pid_of_rank(run_dir, 1)
        os.kill(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=timeout_s + 120)
        elapsed = time.monotonic() - t0
    finally:  # leave nothing behind, whatever failed
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)  # acts on a stopped process too
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the launcher stops its agents, which stop their workers
            proc.communicate(timeout=120)
    assert proc.returncode == 2
    # "at step N": the training loop beats after every step (not only once, as the group forms).
    assert re.fullmatch(
        r"error: rank 1 stopped responding \(last heartbeat at step \d+, \d+ s ago\); rank 0 timed out "
        r"waiting for it after distributed\.timeout_s=10; the other ranks were stopped",
        err.strip().splitlines()[-1],
    ), f"{err[-2000:]}\n(no step? the training loop calls recscale.distributed.env.heartbeat after each step)"
    assert "Traceback" not in err
    assert elapsed < timeout_s + HANG_MARGIN_S


def _stop_with_sigterm(
    run_dir: Path,
    *args: str,
    env: dict[str, str] | None = None,
    sig: int = signal.SIGTERM,
    preexec: Callable[[], None] = ctrl_c_as_in_a_terminal,
) -> tuple[int, str, list[int]]:
    """Start a long training into ``run_dir`` (``args``: more of its command line; ``preexec`` before it
    runs), SIGTERM (or ``sig``) it once it has written a checkpoint; returns its exit code, its stderr and the
    processes of the job that outlived it (then killed)."""
    cmd = [sys.executable, "-m", "recscale.cli", "train", str(CONFIGS / "demo.yaml"), *SMALL, "train.eval_every=3",
           "train.epochs=1000", "train.max_steps=100000", "--out", str(run_dir), *args]  # fmt: skip
    # Not a pipe: processes the command leaves behind would hold it open.
    log = run_dir.with_name("stderr.txt")
    with open(log, "w") as stderr:
        proc = subprocess.Popen(cmd, stderr=stderr, cwd=REPO, env=env, preexec_fn=preexec)
    try:
        deadline = time.monotonic() + 120
        while not list_checkpoints(run_dir / "ckpt"):
            assert proc.poll() is None, "the training exited before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.2)
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        left = _job_processes(run_dir)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
    return proc.returncode, log.read_text(), left


def _job_processes(run_dir: Path) -> list[int]:
    """The processes of the job writing ``run_dir`` (the launcher, its agents, the ranks)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):  # gone meanwhile
            if str(run_dir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(int(pid))
    return pids


def _as_nohup() -> None:
    ctrl_c_as_in_a_terminal()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


@dist_mark
def test_a_job_under_nohup_outlives_the_terminal(tmp_path):
    """torch elastic's agents stop the job on SIGHUP even where it started ignored: `nohup recscale train --nproc
    2` died when the terminal hung up ('the hosts' agents exited with codes [129]'). The agents leave ignored
    what the launcher ignores; SIGTERM still stops the job."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "recscale.cli", "train", str(CONFIGS / "demo.yaml"), *LONG, "train.epochs=1000",
           "train.max_steps=100000", "--out", str(run_dir), "--nproc", "2"]  # fmt: skip
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(cmd, stderr=stderr, cwd=REPO, start_new_session=True, preexec_fn=_as_nohup)
    try:
        _wait_for_step(run_dir, 3, proc)
        os.killpg(proc.pid, signal.SIGHUP)  # the hang-up, to the job's process group
        time.sleep(5)
        assert proc.poll() is None, log.read_text()[-2000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text()[-2000:]
    finally:
        for pid in _job_processes(run_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


def test_sigterm_stops_a_training_with_one_line_and_a_resume_continues_it(tmp_path, capsys):
    """SIGTERM ended `recscale train` with no word (rc -15). It stops as Ctrl-C does, wherever it lands (a
    write in progress dropped whole), says where with the command that continues the run, and exits 143."""
    run_dir = tmp_path / "run"
    code, err, left = _stop_with_sigterm(run_dir)
    assert code == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err and left == []
    line = err.strip().splitlines()[-1]
    stopped = re.fullmatch(
        r"train: stopped by SIGTERM at step (\d+); continue from (\S+) with `recscale train --resume --out (\S+)`",
        line,
    )
    assert stopped and stopped.group(3) == str(run_dir), line
    latest = list_checkpoints(run_dir / "ckpt")[-1]
    assert stopped.group(2) == str(latest) and int(stopped.group(1)) >= int(latest.name[len("step_") :])
    resumed_to = int(latest.name[len("step_") :]) + 2
    assert main(["train", "--resume", "--out", str(run_dir), f"train.max_steps={resumed_to}"]) == 0
    assert f"resumed from {latest} " in capsys.readouterr().err
    assert [r["step"] for r in _logged(run_dir) if r["split"] == "train"] == list(range(1, resumed_to + 1))


def _signals_blocked() -> None:
    ctrl_c_as_in_a_terminal()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_training_started_with_stop_signals_blocked_still_stops(tmp_path, sig):
    """A parent that left SIGINT and SIGTERM blocked (the mask is inherited across exec) made a training deaf
    to both until it ended: it now stops as any other does."""
    code, err, left = _stop_with_sigterm(tmp_path / "run", sig=sig, preexec=_signals_blocked)
    assert code == (143 if sig == signal.SIGTERM else 130) and left == [], err[-2000:]
    assert err.strip().splitlines()[-1].startswith("train: stopped by "), err[-2000:]


def test_ctrl_c_stops_a_training_saying_how_to_continue(tmp_path):
    """Ctrl-C said only 'interrupted' where SIGTERM says where the run stopped and how to continue it."""
    run_dir = tmp_path / "run"
    code, err, left = _stop_with_sigterm(run_dir, sig=signal.SIGINT)
    assert code == 130 and "Traceback" not in err and left == [], err[-2000:]
    latest = list_checkpoints(run_dir / "ckpt")[-1]
    assert re.fullmatch(
        rf"train: stopped by Ctrl-C at step \d+; continue from {re.escape(str(latest))} with "
        rf"`recscale train --resume --out {re.escape(str(run_dir))}`",
        err.strip().splitlines()[-1],
    ), err[-2000:]


def test_sigterm_still_ends_a_rank_at_once(tmp_path):
    """A rank of --nproc or torchrun keeps dying of SIGTERM: its launcher stops it so, and prints the job's
    one line."""
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
    code, err, _ = _stop_with_sigterm(tmp_path / "run", env=env)
    assert code == -signal.SIGTERM and "SIGTERM" not in err, err[-2000:]


def _sigterm_once(cmd: list[str], started: Path | Callable[[], bool], log: Path) -> tuple[int, str]:
    """Run ``recscale CMD``, SIGTERM it once ``started`` exists or returns True (the command is at work then);
    returns its exit code and stderr."""
    at_work = started.exists if isinstance(started, Path) else started
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "recscale.cli", *cmd], stdout=subprocess.DEVNULL,
                                stderr=stderr, cwd=REPO)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not at_work():
            assert proc.poll() is None, f"it exited before it was at work: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"not at work ({started}) within 120 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    return proc.returncode, log.read_text()


def test_sigterm_stops_a_sweep_with_one_line(tmp_path):
    """SIGTERM ended `recscale sweep` with no word (rc -15), where `recscale train` says where it stopped and
    exits 143: a sweep does as train does (cli._sigterm_raises) and says how to go on."""
    sweep = tmp_path / "sweep.yaml"
    families = {"dlrm": {"model": {"name": "dlrm"}, "sizes": [{"top_mlp": [16]}]}}
    overrides = ["data.synthetic.rows={train: 400000, valid: 256, test: 256}", "data.synthetic.num_sparse=4",
                 "data.num_workers=0", "model.embedding.dim=8", "train.batch_size=64",
                 "train.progress=false"]  # fmt: skip
    spec = {"base": str(CONFIGS / "demo.yaml"), "overrides": overrides, "out": str(tmp_path / "out"),
            "families": families}  # fmt: skip
    sweep.write_text(json.dumps(spec))  # JSON is YAML
    code, err = _sigterm_once(["sweep", str(sweep)], tmp_path / "out" / "runs", tmp_path / "stderr.txt")
    assert code == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "sweep: stopped by SIGTERM; run the same command again to go on (finished runs are skipped, "
        "the one stopped starts afresh)"
    )


def test_sigterm_stops_data_prepare_with_one_line(tmp_path):
    """SIGTERM ended `recscale data prepare` with no word (rc -15); it stops as train does, says so and
    leaves no half-prepared directory."""
    out = tmp_path / "prep"
    cmd = [
        "data",
        "prepare",
        str(CONFIGS / "demo.yaml"),
        "data.synthetic.rows.train=3000000",
        "--out",
        str(out),
    ]
    code, err = _sigterm_once(cmd, out / "data", tmp_path / "stderr.txt")
    assert code == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"data prepare: stopped by SIGTERM before {out} was complete; run the same command again"
    )
    assert not out.exists()


@dist_mark
def test_sigterm_to_the_launcher_stops_its_job_with_one_line(tmp_path):
    """SIGTERM to `recscale train --nproc` ended the launcher alone: its agents and ranks trained on, orphaned,
    holding the run. It stops them as Ctrl-C does, and says how to continue, as one process does."""
    run_dir = tmp_path / "run"
    code, err, left = _stop_with_sigterm(run_dir, "--nproc", "2", "--local-world-size", "1")
    assert code == 128 + signal.SIGTERM, err[-2000:]
    latest = list_checkpoints(run_dir / "ckpt")[-1]
    assert err.strip().splitlines() == [  # the ranks, stopped by their agents, say nothing
        f"train: stopped by SIGTERM; continue from {latest} with "
        f"`recscale train --resume --out {run_dir} --nproc 2 --local-world-size 1`"
    ]
    assert left == [], "processes of the job outlived it"


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1"]
RECSCALE = ["--nproc", "2", "--local-world-size", "1", "--max-restarts", "1"]


@dist_mark
@pytest.mark.parametrize("launcher", ["torchrun, 1 host x 2", "recscale --nproc, 2 hosts x 1"])
def test_restart_resumes_from_the_last_checkpoint(tmp_path, launcher):
    """With --max-restarts 1 a killed rank restarts the job, which resumes from its last checkpoint."""
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
    port = ["--master-port", str(free_port())]  # not torchrun's default 29500: tests run side by side
    cmd = (
        [*TORCHRUN, *port, *train] if launcher.startswith("torchrun") else [sys.executable, *train, *RECSCALE]
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    _wait_for_step(run_dir, 23, proc)
    os.kill(_pid_of_rank(run_dir, 1), signal.SIGKILL)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-2000:]
    # Step 20's checkpoint, or step 40's where the job outran the poll on a loaded machine.
    resumed = re.search(r"restart 1 after a failed rank: resumed from \S*/step_(\d{8}) ", err)
    assert resumed and int(resumed.group(1)) in (20, 40), err[-2000:]
    steps = [r["step"] for r in _logged(run_dir) if r["split"] == "train"]
    assert steps == list(range(1, 61))  # what the killed attempt did after step 20 was dropped, then redone
    assert json.loads((run_dir / "report.json").read_text())["steps"] == 60


def test_resume_drops_log_lines_that_are_not_records(tmp_path):
    """A metrics.jsonl edited by hand (a list, a string step, bad bytes) used to stop a resume with an
    internal error after the checkpoint was loaded; such lines go, as a line cut short by a kill does."""
    from recscale.train.state import RunLog

    log = RunLog(tmp_path, main=True)
    good = [{"split": "train", "step": s, "loss": 0.5} for s in (10, 20, 30)]
    lines = [json.dumps(r) for r in good] + ["[1]", '{"step": "x"}', '{"loss": 1}', '{"step": 1', "\udcff"]
    log.path.write_text("\n".join(lines[:2] + lines[3:] + lines[2:3]) + "\n", errors="surrogateescape")
    log.truncate(20)
    log.close()
    assert [json.loads(x) for x in log.path.read_text().splitlines()] == good[:2]


def test_the_agent_blames_a_killed_rank_before_the_ranks_that_failed_of_it():
    """Ranks found failed by one check share a whole-second time: the agent named the lowest rank, so rank
    0 aborting on a lost peer (gloo's SIGABRT), or stopped by its agent, hid rank 1, killed from outside."""
    from types import SimpleNamespace

    def failed(code: int, t: int = 7) -> SimpleNamespace:
        return SimpleNamespace(exitcode=code, timestamp=t)

    abort, kill, error, stopped = -signal.SIGABRT, -signal.SIGKILL, 1, -signal.SIGTERM
    assert _first_cause({0: failed(abort), 1: failed(kill)})[0] == 1
    assert _first_cause({0: failed(stopped), 1: failed(abort), 2: failed(-signal.SIGSEGV)})[0] == 2
    assert _first_cause({0: failed(stopped), 1: failed(abort)})[0] == 1  # an abort is no stop
    assert _first_cause({0: failed(abort), 1: failed(error)})[0] == 0  # a tie: the lowest rank
    # The earliest first: a rank its agent killed after the grace period is no cause.
    assert _first_cause({0: failed(error, 7), 1: failed(kill, 12)})[0] == 0


@pytest.mark.parametrize("library", ["wraps", "swallows"])
def test_sigterm_stops_a_command_whose_library_caught_it(library):
    """A SIGTERM landing in a library's callback came out as the library's error (pydantic's serializer:
    "internal error PydanticSerializationError: ... Terminated", exit 1), or not at all where the library
    caught everything: the block still ends with Terminated (one line, exit 143)."""
    from recscale.cli import _sigterm_raises
    from recscale.errors import Terminated

    def callback() -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs here
        except BaseException as e:  # as pydantic-core takes any Python error of a callback
            if library == "wraps":
                raise ValueError("Error calling function: Terminated") from None
            del e

    with pytest.raises(Terminated):
        with _sigterm_raises():
            callback()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # as before the block


def test_a_finished_rank_exits_with_its_code_and_output_but_no_exit_time_teardown():
    """A rank's exit ran the interpreter's teardown, where the gloo group DDP keeps alive past
    destroy_process_group was destroyed by exit-time destructors: on rare runs that aborted a finished rank
    (SIGABRT, "terminate called without an active exception"). exit_rank ends it at once, output flushed."""
    program = (
        "import atexit, sys\nfrom recscale.distributed.env import exit_rank\n"
        "atexit.register(lambda: print('teardown ran'))\n"
        "print('report', end='')\nprint('warning', end='', file=sys.stderr)\nexit_rank(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (3, "report", "warning")


def test_a_crash_outside_python_says_what_the_other_threads_did(tmp_path):
    """faulthandler's dump of a rank that aborted in a C++ thread: the line names the other threads' frames,
    or, with none running Python, that the process was ending (CI's SIGABRT at a finished rank's teardown)."""
    (tmp_path / dist_env.CRASH_SUBDIR).mkdir()
    during = (
        "Fatal Python error: Aborted\n\nThread 0x00007f01 (most recent call first):\n"
        '  File "/x/loop.py", line 431 in train_step\n  File "/x/loop.py", line 40 in fit\n\n'
        "Current thread 0x00007f02 (most recent call first):\n  <no Python frame>\n"
    )
    (tmp_path / dist_env.CRASH_SUBDIR / "11.txt").write_text(during)
    assert dist_env.crash_site(tmp_path, 11) == (
        "in a thread running no Python (a C++ library's), while its other threads were in train_step (loop.py:431)"
    )
    (tmp_path / dist_env.CRASH_SUBDIR / "12.txt").write_text(
        "Fatal Python error: Aborted\n\nCurrent thread 0x00007f02 (most recent call first):\n  <no Python frame>\n"
    )
    assert dist_env.crash_site(tmp_path, 12).endswith("with no Python code running: the process was ending")
    assert dist_env.crash_site(tmp_path, 13) is None  # no dump: killed from outside


@pytest.mark.parametrize("nproc", [[], ["--nproc", "2"]])
def test_sigterm_stops_predict_and_removes_its_copy_of_the_file(tmp_path, monkeypatch, nproc):
    """SIGTERM ended `recscale predict` (and eval) with no word (rc -15), leaving the materialised copy of the
    file it scored behind in a temporary directory, as large as the file's split; it stops as Ctrl-C does:
    one line, exit 143, no copy left and no output written. With --nproc each rank removes its own copy
    before it dies of the launcher's SIGTERM."""
    from recscale.config import load_config
    from recscale.train.loop import Trainer

    lines = "".join(f"{i % 2},{i % 7},{i % 11}\n" for i in range(300))
    (tmp_path / "train.csv").write_text("label,user,item\n" + lines)
    (tmp_path / "run.yaml").write_text(
        f"data: {{format: csv, train: {tmp_path / 'train.csv'}, num_workers: 0, "
        "schema: {label: label, sparse: [{name: user}, {name: item}]}}\n"
        "model: {name: fm}\ntrain: {batch_size: 32, max_steps: 2, progress: false}\n"
    )
    Trainer(load_config(tmp_path / "run.yaml"), tmp_path / "r").fit()
    # Long enough to be scoring still when the signal comes, on a busy machine too.
    (tmp_path / "new.csv").write_text("user,item\n" + "3,5\n" * 6_000_000)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # where the command materialises the file
    out = tmp_path / "scores.csv"
    cmd = ["predict", str(tmp_path / "r"), "--data", str(tmp_path / "new.csv"), "--out", str(out), *nproc]
    copies = 2 if nproc else 1  # each rank's copy of the file in the temp directory

    def scoring() -> bool:
        return len([p for p in tmp.iterdir() if p.name.startswith("recscale-predict-")]) >= copies

    code, err = _sigterm_once(cmd, scoring, tmp_path / "stderr.txt")
    assert code == 128 + signal.SIGTERM, err[-2000:]
    assert (
        err.strip().splitlines()[-1] == "predict: stopped by SIGTERM before it finished; nothing was written"
    )
    left = [p for p in tmp.iterdir() if p.name.startswith("recscale-")]
    assert left == [] and not out.exists(), err[-2000:]
