"""``recscale train --nproc N``: run a training job as N local processes, under torch elastic.

The job is what ``torchrun`` would run: one elastic agent per host, each starting ``LOCAL_WORLD_SIZE``
workers (``python -m recscale.cli train ...``) and watching them. On one machine each simulated
host gets its own agent (a subprocess of this launcher) and the agents meet through a static
rendezvous on localhost, exactly as ``torchrun --nnodes H --node-rank h`` would on H machines.

Faults: an agent notices a dead worker within its monitor interval, stops the others on its host
and, while restarts remain (``--max-restarts``), starts them again (the trainer then resumes from
the last checkpoint); workers on other hosts fail on their closed connections and restart too.
When restarts run out the agent exits; this launcher stops the other agents and reports the first
failure in one line.
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

from recscale.distributed.env import free_port
from recscale.errors import RecscaleError

_POLL_S = 0.2
_STOP_GRACE_S = 60.0
_SETTLE_S = 3.0


def launch(command: list[str], nproc: int, local_world_size: int | None, max_restarts: int) -> None:
    """Run ``python *command`` (e.g. ``-m recscale.cli train ...``) as ``nproc`` ranks,
    ``local_world_size`` of them per host."""
    local = local_world_size or nproc
    if nproc < 1 or local < 1 or nproc % local:
        raise RecscaleError(
            f"--nproc {nproc} cannot be split into hosts of --local-world-size {local} ranks each"
        )
    hosts = nproc // local
    env = dict(os.environ)
    # As torchrun does, but shared out: N processes on C cores get C // N threads each.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    with tempfile.TemporaryDirectory(prefix="recscale-launch-") as tmp:
        summaries = [Path(tmp) / f"host{h}.json" for h in range(hosts)]
        agents = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "recscale.distributed.launch",
                    "--hosts",
                    str(hosts),
                    "--host",
                    str(h),
                    "--local",
                    str(local),
                    "--max-restarts",
                    str(max_restarts),
                    "--port",
                    str(port),
                    "--run-id",
                    run_id,
                    "--summary",
                    str(summaries[h]),
                    "--",
                    *command,
                ],
                env=env,
            )  # fmt: skip
            for h in range(hosts)
        ]
        failed = _wait(agents)
        if failed is not None:
            # The root cause is the earliest failure: on other hosts, ranks then fail on lost connections.
            # Failure times are whole seconds, so a rank that died of a lost peer (gloo aborts, or
            # the trainer exits with an error) can tie with the cause; one killed from outside wins.
            found = [json.loads(p.read_text()) for p in summaries if p.is_file()]
            if found:
                what = min(found, key=lambda f: (f["maybe_consequence"], f["time"]))["error"]
            else:
                what = f"host {failed}'s agent exited with code {agents[failed].returncode}"
            raise RecscaleError(f"{what}; the other ranks were stopped")


def _wait(agents: list[subprocess.Popen]) -> int | None:
    """Wait for every agent; on the first failure stop the rest. Returns the failed agent's index."""
    try:
        while True:
            codes = [a.poll() for a in agents]
            failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None:
                # Let agents whose ranks are failing too finish writing their summaries: the root
                # cause may be on a host whose agent exits a moment later than this one.
                deadline = time.monotonic() + _SETTLE_S
                while any(a.poll() is None for a in agents) and time.monotonic() < deadline:
                    time.sleep(_POLL_S)
                _stop(agents)
                return failed
            if all(c == 0 for c in codes):
                return None
            time.sleep(_POLL_S)
    except KeyboardInterrupt:
        _stop(agents)
        raise


def _stop(agents: list[subprocess.Popen]) -> None:
    for a in agents:
        if a.poll() is None:
            a.send_signal(signal.SIGTERM)  # the agent stops its workers
    deadline = time.monotonic() + _STOP_GRACE_S
    for a in agents:
        try:
            a.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            a.kill()
            a.wait()


def _describe(rank: int, failure: object) -> str:
    code = failure.exitcode  # type: ignore[attr-defined]
    if code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code} (its error is printed above)"
    return f"rank {rank} (pid {failure.pid}) {how}"  # type: ignore[attr-defined]


def _agent(args: argparse.Namespace) -> int:
    """One host's elastic agent (the body of ``torchrun --nnodes H --node-rank h``)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent's own logging repeats what the summary says, over many lines.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=args.hosts,
        max_nodes=args.hosts,
        nproc_per_node=args.local,
        rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{args.port}",
        rdzv_configs={"rank": args.host},
        run_id=args.run_id,
        max_restarts=args.max_restarts,
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)(*args.command)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        restarts = f" (after {args.max_restarts} restarts)" if args.max_restarts else ""
        summary = {
            "error": _describe(rank, failure) + restarts,
            "time": failure.timestamp,
            "maybe_consequence": failure.exitcode >= 0 or -failure.exitcode == signal.SIGABRT,
        }
        Path(args.summary).write_text(json.dumps(summary))
        return 1
    except SignalException as e:  # stopped by the launcher (or the user): its workers are stopped too
        return 128 + e.sigval
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
