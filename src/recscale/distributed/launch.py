"""``recscale train --nproc N``: run a training job as N local processes, under torch elastic.

The job is what ``torchrun`` would run: one elastic agent per host, each starting ``LOCAL_WORLD_SIZE``
workers (``python -m recscale.cli train ...``) and watching them. On one machine each simulated
host gets its own agent (a subprocess of this launcher) and the agents meet through a static
rendezvous on localhost, exactly as ``torchrun --nnodes H --node-rank h`` would on H machines.

Faults: an agent notices a dead worker within its monitor interval, stops the others on its host
and, while restarts remain (``--max-restarts``), starts them again (the trainer then resumes from
the last checkpoint); workers on other hosts fail on their closed connections and restart too.
When restarts run out the agent exits; this launcher stops the other agents and reports the first
failure in one line. The ranks print no error lines of their own: each leaves its line in
``$RECSCALE_FAULT_DIR/errors/`` (``env.record_error``), so the job's error is one line, not one per rank.

Stopping: Ctrl-C or SIGTERM to the launcher (``recscale train --nproc``; the CLI turns SIGTERM into
``Terminated``) stops the agents, which stop their workers, before it ends.

Hangs: a rank whose collective times out (``distributed.timeout_s``) names the rank that stopped
responding and leaves that verdict in ``$RECSCALE_FAULT_DIR`` (see ``recscale.distributed.env``).
This launcher SIGKILLs the hung rank as soon as it reads it: torch elastic would SIGTERM it and wait
out a grace period, and a stopped process does not act on SIGTERM. While restarts remain, the agents
then restart the job; otherwise the launcher stops it at once, the verdict its one-line error.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from recscale.data.chunks import usable_cores
from recscale.distributed.env import ERRORS_SUBDIR, FAULT_DIR_ENV, crash_site, free_port
from recscale.errors import RecscaleError, Terminated

_POLL_S = 0.2
_STOP_GRACE_S = 60.0
_SETTLE_S = 3.0
# torch elastic's grace between SIGTERM and SIGKILL when stopping workers (its default: 30 s). The
# trainer does not handle SIGTERM, so a worker that can die dies at once; only a hung one waits it out.
_WORKER_GRACE_S = 5
_PORT_TRIES = 3


def host_split(nproc: int, local_world_size: int | None) -> tuple[int, int]:
    """(hosts, ranks per host) of ``nproc`` ranks, ``local_world_size`` per host (None: one host)."""
    local = local_world_size or nproc
    if nproc < 1 or local < 1 or nproc % local:
        raise RecscaleError(
            f"--nproc {nproc} cannot be split into hosts of --local-world-size {local} ranks each"
        )
    return nproc // local, local


def rank_threads(nproc: int) -> int:
    """Threads per rank, as torchrun does but shared out: N processes on C cores get C // N each. C is the
    cores this process may run on (taskset, a container's cpuset), as torch counts them: the machine's count
    gave 2 ranks on 2 of 64 cores 32 threads each."""
    return max(1, usable_cores() // nproc)


def launch(command: list[str], nproc: int, local_world_size: int | None, max_restarts: int) -> None:
    """Run ``python *command`` (e.g. ``-m recscale.cli train ...``) as ``nproc`` ranks,
    ``local_world_size`` of them per host."""
    hosts, local = host_split(nproc, local_world_size)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(rank_threads(nproc)))
    # The rendezvous port is found free here and bound seconds later by the first agent, once it has imported
    # torch: another process can take it in between. The job then starts again on another port.
    for _ in range(_PORT_TRIES):
        if _run(command, hosts, local, max_restarts, env):
            return
    raise RecscaleError(
        f"the rendezvous port was taken by another process {_PORT_TRIES} times in a row; retry"
    )


def _run(command: list[str], hosts: int, local: int, max_restarts: int, env: dict[str, str]) -> bool:
    """One launch of the job's agents on a free port: True once it succeeded, False where the port was taken
    before the first agent bound it (nothing ran); a failure raises its one line."""
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    with tempfile.TemporaryDirectory(prefix="recscale-launch-") as tmp:
        summaries = [Path(tmp) / f"host{h}.json" for h in range(hosts)]
        faults = Path(tmp) / "faults"
        (faults / ERRORS_SUBDIR).mkdir(parents=True)
        env = {**env, FAULT_DIR_ENV: str(faults)}
        agents: list[subprocess.Popen] = []
        try:
            for h in range(hosts):
                agent = [sys.executable, "-m", "recscale.distributed.launch", "--hosts", str(hosts), "--host",
                         str(h), "--local", str(local), "--max-restarts", str(max_restarts), "--port", str(port),
                         "--run-id", run_id, "--summary", str(summaries[h]), "--", *command]  # fmt: skip
                agents.append(subprocess.Popen(agent, env=env))
            failed = _wait(agents, faults, max_restarts)
        except (KeyboardInterrupt, Terminated):  # Ctrl-C, or SIGTERM to `recscale train --nproc` (cli)
            _stop(agents)
            raise
        if not failed:
            return True
        found = [json.loads(p.read_text()) for p in summaries if p.is_file()]
        if any(f.get("port_taken") for f in found):
            return False
        cause = _root_cause(faults, found, max_restarts, agents)
        # Every rank failing with this same line of its own (a diverged loss, found by all at one step): none
        # was stopped for another's failure.
        alike = [e for e in _errors(faults, max_restarts) if not e["consequence"] and e["error"] == cause]
        raise RecscaleError(
            f"{cause} (on all {hosts * local} ranks)"
            if len(alike) == hosts * local
            else f"{cause}; the other ranks were stopped"
        )


def _root_cause(faults: Path, found: list[dict], final_attempt: int, agents: list[subprocess.Popen]) -> str:
    """The one line that says why the job failed, from the hang verdicts, the ranks' own error lines
    (``env.record_error``; the ranks print none) and the agents' summaries ``found``."""
    # A hang named by a rank that timed out waiting for it is the cause (its agent may not even have
    # reported). Verdicts and errors of earlier attempts, restarted since, are not.
    verdicts = [v for v in _verdicts(faults) if v["attempt"] == final_attempt]
    errors = _errors(faults, final_attempt)
    # Otherwise the earliest failure: a rank killed from outside, else a rank's own error; on other ranks
    # the trainer then fails on lost connections (their lines say so) and their agents report exit codes.
    # Agents' failure times are whole seconds, so a rank that died of a lost peer can tie with the cause.
    for group in (
        verdicts,
        [f for f in found if not f["maybe_consequence"]],
        [e for e in errors if not e["consequence"]],
        found,
        errors,
    ):
        if group:
            return str(min(group, key=lambda g: g["time"])["error"])
    return f"the hosts' agents exited with codes {[a.returncode for a in agents]}"


def _wait(agents: list[subprocess.Popen], faults: Path, final_attempt: int) -> bool:
    """Wait for every agent, killing ranks found hung; on the first failure stop the rest. Returns
    whether the job failed."""
    seen: set[Path] = set()

    def doomed() -> bool:  # a rank named a hung one with no restarts left: it is failing, and the job
        return any(v["attempt"] == final_attempt for v in _kill_hung(faults, seen, agents))

    while True:
        if doomed():
            _stop(agents)
            return True
        codes = [a.poll() for a in agents]
        if any(c not in (None, 0) for c in codes):
            # Let agents whose ranks are failing too finish writing their summaries: the root
            # cause may be on a host whose agent exits a moment later than this one.
            deadline = time.monotonic() + _SETTLE_S
            while any(a.poll() is None for a in agents) and time.monotonic() < deadline and not doomed():
                time.sleep(_POLL_S)
            _stop(agents)
            return True
        if all(c == 0 for c in codes):
            return False
        time.sleep(_POLL_S)


def _errors(faults: Path, attempt: int) -> list[dict]:
    """The ranks' own error lines (``env.record_error``) of ``attempt``, one per rank that left one."""
    errors = [json.loads(p.read_text()) for p in (faults / ERRORS_SUBDIR).glob("*.json")]
    return [e for e in errors if e["attempt"] == attempt]


def _verdicts(faults: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(faults.glob("*.json"))]


def _kill_hung(faults: Path, seen: set[Path], agents: list[subprocess.Popen]) -> list[dict]:
    """SIGKILL the workers named by verdicts not seen before (``seen`` collects them); returns those
    verdicts. Their agents then restart them, or fail."""
    ours, new = {a.pid for a in agents}, []
    for path in sorted(set(faults.glob("*.json")) - seen):
        seen.add(path)
        new.append(verdict := json.loads(path.read_text()))
        for pid in verdict["pids"]:
            if _parent(pid) in ours:  # a worker of this job, not a process that reused its pid
                _kill_worker(pid)
    return new


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm) state": comm may hold spaces


def _kill_worker(pid: int) -> None:
    """SIGKILL a worker and its children (data loaders): torch elastic starts each in its own session."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _stop(agents: list[subprocess.Popen]) -> None:
    for a in agents:
        if a.poll() is None:
            a.send_signal(signal.SIGTERM)  # the agent stops its workers
    deadline = time.monotonic() + _STOP_GRACE_S
    for a in agents:
        try:
            a.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            # Its workers lead sessions of their own: killing the agent alone would orphan them.
            for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
                if _parent(pid) == a.pid:
                    _kill_worker(pid)
            a.kill()
            a.wait()


def _first_cause(failures: dict[int, Any]) -> tuple[int, Any]:
    """The rank (and its ``ProcessFailure``) to blame among those the agent found failed: the earliest, and
    of those failed in the same (whole) second, one killed from outside (SIGKILL, SIGSEGV), then one that
    may have failed of it (an error, an abort), then one its agent stopped (SIGTERM); then the lowest rank."""

    def key(rf: tuple[int, Any]) -> tuple[int, int, int]:
        code = rf[1].exitcode
        return rf[1].timestamp, 2 if code == -signal.SIGTERM else int(_maybe_consequence(code)), rf[0]

    return min(failures.items(), key=key)


def _maybe_consequence(exitcode: int) -> bool:
    """Whether a rank that ended so may have failed because another rank did: it exited with an error (a
    lost connection raises), aborted (gloo aborts on some) or was stopped by its agent (SIGTERM), rather
    than killed by another signal."""
    return exitcode >= 0 or -exitcode in (signal.SIGABRT, signal.SIGTERM)


def _describe(rank: int, failure: object) -> str:
    code = failure.exitcode  # type: ignore[attr-defined]
    if code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
        # A crash (SIGSEGV, SIGABRT) left the rank's stacks; a kill from outside (SIGKILL) leaves none.
        fault_dir = os.environ.get(FAULT_DIR_ENV)  # set by launch() for its agents
        if fault_dir and (site := crash_site(Path(fault_dir), failure.pid)) is not None:  # type: ignore[attr-defined]
            how += f" {site}"
    else:
        how = f"exited with code {code} (its error is printed above)"
    return f"rank {rank} (pid {failure.pid}) {how}"  # type: ignore[attr-defined]


def _agent(args: argparse.Namespace) -> int:
    """One host's elastic agent (the body of ``torchrun --nnodes H --node-rank h``)."""
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent's own logging repeats what the summary says, over many lines.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    # torch elastic stops the job on SIGINT, SIGHUP and SIGQUIT even where they were ignored when it started: a
    # job under nohup died when the terminal hung up. A signal the launcher ignores (passed on to this process)
    # is left ignored; SIGTERM is how the launcher stops its agents (_stop).
    stops = ("SIGINT", "SIGHUP", "SIGQUIT")
    handled = ["SIGTERM", *(n for n in stops if signal.getsignal(getattr(signal, n)) != signal.SIG_IGN)]
    config = LaunchConfig(
        min_nodes=args.hosts,
        max_nodes=args.hosts,
        nproc_per_node=args.local,
        rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{args.port}",
        rdzv_configs={"rank": args.host},
        run_id=args.run_id,
        max_restarts=args.max_restarts,
        shutdown_timeout=_WORKER_GRACE_S,
        signals_to_handle=",".join(handled),
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)(*args.command)
    except ChildFailedError as e:
        rank, failure = _first_cause(e.failures)
        restarts = f" (after {args.max_restarts} restarts)" if args.max_restarts else ""
        summary = {
            "error": _describe(rank, failure) + restarts,
            "time": failure.timestamp,
            "maybe_consequence": _maybe_consequence(failure.exitcode),
        }
        Path(args.summary).write_text(json.dumps(summary))
        return 1
    except DistNetworkError as e:
        if args.host != 0 or "EADDRINUSE" not in str(e):
            raise
        # The rendezvous port, found free by the launcher, was taken before this agent bound it.
        Path(args.summary).write_text(json.dumps({"port_taken": True}))
        return 1
    except SignalException as e:  # stopped by the launcher (or the user): its workers are stopped too
        return 128 + e.sigval
    finally:
        # torch elastic's handlers turn a signal into an exception; one that lands while the interpreter
        # joins its threads on exit prints a traceback ("Exception ignored in threading"). The workers
        # are done by now: a late SIGTERM from the launcher just ends this process.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recscale.distributed.launch")
    for name in ("--hosts", "--host", "--local", "--max-restarts", "--port"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--summary", required=True)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return _agent(args)


if __name__ == "__main__":
    sys.exit(main())
