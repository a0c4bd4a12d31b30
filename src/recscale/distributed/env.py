"""The process group of a run: torchrun's environment, or a one-process group for local runs.

Single-process training goes through the same TorchRec ``DistributedModelParallel`` path as a
multi-process job, on a world of size 1, so there is one code path to test.

Hangs: each rank of a multi-process job posts a heartbeat (its last step) to the rendezvous store
(``heartbeat``). A rank whose collective times out reads them to name the rank that stopped
responding (``lost_peer``) and, under ``recscale train --nproc``, leaves that verdict in
``$RECSCALE_FAULT_DIR``, where the launcher picks it up and kills the hung rank at once.

Crashes: under that launcher a rank killed by a fatal signal (SIGSEGV, SIGABRT: a C++ exception no
one caught, in gloo's threads say) leaves its threads' Python stacks there too (``crash_site``), so
the job's one line says where it died.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import math
import os
import re
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from recscale.distributed.topology import Topology
from recscale.errors import RecscaleError

FAULT_DIR_ENV = "RECSCALE_FAULT_DIR"  # set by recscale's launcher: where ranks leave hang verdicts
ERRORS_SUBDIR = "errors"  # ...and, in this folder of it, their one-line errors (``record_error``)
CRASH_SUBDIR = "crash"  # ...and in this one, PID.txt: faulthandler's stacks of a rank that crashed
_BEAT_EVERY_S = 1.0  # a beat is a round trip to the store's host: one a second at most, however short a step
_PEER_SETTLE_S = 2.0  # ranks stuck in one collective time out within about a step of each other


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str
    restart_count: int = 0  # how often torchrun restarted this job's workers (--max-restarts)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def topology(self) -> Topology:
        return Topology(self.world_size, self.local_world_size)


@dataclass
class _Heartbeat:
    """This rank's beats, and what it needs to read the others' (keys ``hb/{rank}``, ``stuck/{rank}``
    in the attempt's store)."""

    store: dist.Store
    rank: int
    world_size: int
    timeout_s: float
    last: float = -math.inf  # time.monotonic() of the last beat

    def beat(self, step: int | None) -> None:
        self.last = time.monotonic()
        # Wall-clock time: other ranks (on other hosts, with synchronised clocks) read how long ago.
        beat = {"step": step, "time": time.time(), "pid": os.getpid()}
        self.store.set(f"hb/{self.rank}", json.dumps(beat))


_heartbeat: _Heartbeat | None = None
_groups_formed = 0  # process groups this process has formed under torchrun (init_distributed)
_crash_file: object = None  # open for faulthandler while the process lives (``_dump_stacks_on_crash``)


def free_port() -> int:
    """A port free now, for the launcher to tell its agents (each binds it later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float | None = None) -> DistEnv:
    """Join torchrun's process group if launched by it, else start a group of one on localhost.

    ``timeout_s`` bounds every collective: a rank whose peer hangs fails after it instead of
    waiting forever (a peer that dies is noticed at once, by its closed connections).
    """
    global _heartbeat, _groups_formed
    launched, rank, world, local_rank, local_world = launch_env()
    Topology(world, local_world)  # fails early on an impossible layout
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else default_pg_timeout
    restarts = _attempt()
    if not dist.is_initialized():
        if launched:
            _dump_stacks_on_crash()
            store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
            # torchrun's static rendezvous keeps one store across restarts (torch 2.13): without a
            # fresh prefix per attempt, a restarted group reads the dead attempt's addresses and hangs.
            # So can a group formed again in the same process (a Trainer destroys the group it started,
            # and destroying the default group resets torch's own group count, its key prefix): a rank
            # read the last group's addresses and gloo timed out connecting. Every rank forms its groups
            # in the same order, so the count names the same group on each.
            store = dist.PrefixStore(f"recscale/attempt_{restarts}/group_{_groups_formed}", store)
            _groups_formed += 1
            if world > 1:
                # A first beat before the group forms, so every rank's key exists once it has.
                _heartbeat = _Heartbeat(store, rank, world, timeout.total_seconds())
                _heartbeat.beat(None)
        else:
            os.environ.setdefault("LOCAL_WORLD_SIZE", "1")  # TorchRec's planner reads it
            # Port 0: the store binds a free port itself (a port found free, then bound, can be taken between)
            store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return DistEnv(rank, world, local_world, device, backend, restarts)


_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def launch_env() -> tuple[bool, int, int, int, int]:
    """(launched by torchrun, rank, world size, local rank, local world size) from the environment. A RANK
    or WORLD_SIZE left in the shell (another launcher's, an `export` in a script) made a local run fail
    inside gloo ("rank < size. 1 vs 1") or torch's rendezvous ("MASTER_ADDR expected"): said in one line."""
    env = {k: os.environ[k] for k in _LAUNCH_VARS if k in os.environ}
    fix = "launch ranks with `recscale train --nproc N` (or torchrun), or unset them for a run in one process"
    for k, v in env.items():
        if not v.strip().isdigit():
            raise RecscaleError(f"the environment variable {k}={v!r} is not a whole number; {fix}")
    launched = "RANK" in env and "WORLD_SIZE" in env
    if ("RANK" in env or "WORLD_SIZE" in env) and not launched:
        given = " and ".join(f"{k}={env[k]}" for k in ("RANK", "WORLD_SIZE") if k in env)
        raise RecscaleError(f"the environment sets {given} but not {'WORLD_SIZE' if 'RANK' in env else 'RANK'}, "
                            f"as a launcher sets both; {fix}")  # fmt: skip
    world = int(env.get("WORLD_SIZE", 1))
    rank, local_rank = int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0))
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    if world < 1 or rank >= world or local_rank >= local_world:
        raise RecscaleError(f"the environment's {' '.join(f'{k}={v}' for k, v in env.items())} is no rank of "
                            f"a job (each rank is below its size); {fix}")  # fmt: skip
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if launched and k not in os.environ]
    if missing:
        raise RecscaleError(f"the environment sets RANK and WORLD_SIZE, as torchrun does, but not "
                            f"{' or '.join(missing)}, where the ranks meet; {fix}")  # fmt: skip
    return launched, rank, world, local_rank, local_world


def _dump_stacks_on_crash() -> None:
    """Under recscale's launcher, have a fatal signal write this process's Python stacks to
    ``$RECSCALE_FAULT_DIR/crash/PID.txt`` (faulthandler) for the launcher's line (``crash_site``)."""
    global _crash_file
    fault_dir = os.environ.get(FAULT_DIR_ENV)
    if not fault_dir or _crash_file is not None:
        return
    try:
        path = Path(fault_dir) / CRASH_SUBDIR / f"{os.getpid()}.txt"
        path.parent.mkdir(exist_ok=True)
        _crash_file = path.open("w")
    except OSError:  # the launcher is gone: no one would read it
        return
    faulthandler.enable(_crash_file, all_threads=True)


def crash_site(fault_dir: Path, pid: int) -> str | None:
    """Where process ``pid`` was when a fatal signal killed it, from the stacks it left
    (``_dump_stacks_on_crash``): the innermost frame of the thread that took the signal, or, when that
    thread ran no Python (a C++ library's own thread), that and the other threads' innermost frames."""
    try:
        text = (Path(fault_dir) / CRASH_SUBDIR / f"{pid}.txt").read_text(errors="replace")
    except OSError:
        return None
    stacks = re.findall(r"^(Current thread|Thread) 0x[0-9a-f]+ [^\n]*\n((?:  .*\n?)*)", text, re.MULTILINE)
    if not stacks:
        return None

    def top(frames: str) -> str | None:
        m = re.search(r'File "([^"]+)", line (\d+) in (\S+)', frames)
        return f"{m.group(3)} ({Path(m.group(1)).name}:{m.group(2)})" if m else None

    current = next((f for kind, f in stacks if kind == "Current thread"), "")
    if (where := top(current)) is not None:
        return f"in {where}"
    others = [w for kind, f in stacks if kind == "Thread" and (w := top(f)) is not None]
    return "in a thread running no Python (a C++ library's)" + (
        f", while its other threads were in {', '.join(others)}"
        if others
        else ", with no Python code running: the process was ending"
    )


def heartbeat(step: int) -> None:
    """Tell the other ranks that this one has completed ``step``: call it after every step.

    Free between beats (one a second at most) and a no-op in a world of one; what a rank that times
    out reads to name the rank that stopped (see ``lost_peer``).
    """
    hb = _heartbeat
    if hb is not None and time.monotonic() - hb.last >= _BEAT_EVERY_S:
        try:
            hb.beat(step)
        except dist.DistError:  # advisory: if the store's host is gone, the collectives fail anyway
            pass


def shutdown() -> None:
    global _heartbeat
    _heartbeat = None
    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def own_group() -> Iterator[None]:
    """The process group started in the block (loading a run's model starts one) ends with it, failed or
    not, unless the caller's was there before: eval, predict, export or a probe from Python left it to the
    next run in the process (a notebook's). Also a decorator."""
    own = not dist.is_initialized()
    try:
        yield
    finally:
        if own:
            shutdown()


def exit_rank(code: int) -> NoReturn:
    """End a launched rank's process with ``code`` once its work is done, without interpreter finalization.

    ``shutdown()`` destroys the process group, but the gloo group (and its threads) stays alive in torch
    2.13: importing ``torch._dynamo`` while a group exists keeps it (DDP's constructor does, lazily), and in
    the full stack something else holds it too (not found); exit-time destructors then tear them down, and on rare runs that
    aborts the finished rank ("terminate called without an active exception", SIGABRT: its launcher
    reports a failed job). Output is flushed and logging shut
    down first; the kernel releases the rest (files, locks, the group's sockets)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more to say on it
            pass
    os._exit(code)


def lost_peer(e: BaseException) -> str | None:
    """One line for an error meaning another rank died or stopped answering; None for other errors.

    gloo reports a dead peer as a plain RuntimeError ("Connection closed by peer"), and a silent one
    as one too ("Timed out waiting 10000ms for send operation to complete", "Application timeout
    caused pair closure") where TorchRec waits on it, as a ``DistError`` elsewhere; NCCL failures are
    ``DistError`` s. For a timeout the line names the rank that stopped, from the heartbeats: that
    takes up to ``_PEER_SETTLE_S``, and under recscale's launcher leaves the verdict in
    ``$RECSCALE_FAULT_DIR``.
    """
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip().split("\n")[0])  # drop gloo's "[file:line]"
    timed_out = re.search(r"timed out|timeout", text, re.IGNORECASE) is not None
    gloo = re.search(r"(closed|reset) by peer|Timed out waiting \d+ms|Application timeout", text)
    if not isinstance(e, dist.DistError) and gloo is None:
        return None
    if timed_out and _heartbeat is not None and (line := _name_the_hung(_heartbeat)) is not None:
        return line
    rank = os.environ.get("RANK", "0")
    return f"rank {rank} lost contact with another rank ({text.split('. ')[0][:160]}); that rank failed first"


def _name_the_hung(hb: _Heartbeat) -> str | None:
    """After a timeout: the ranks that did not time out too are the ones that stopped, as one line
    (None if the store cannot tell). The healthy ranks are all stuck in collectives, so their
    heartbeats are as old as the hung rank's: a mark each posts on timing out tells them apart."""
    limit = f"distributed.timeout_s={hb.timeout_s:g}"
    others = [r for r in range(hb.world_size) if r != hb.rank]
    try:
        hb.store.set(f"stuck/{hb.rank}", "1")
        deadline = time.monotonic() + _PEER_SETTLE_S
        while True:
            silent = [r for r in others if not hb.store.check([f"stuck/{r}"])]
            if not silent or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        # A rank's first beat precedes its joining the group: none means it never joined this attempt.
        beats = {r: json.loads(hb.store.get(f"hb/{r}")) for r in silent if hb.store.check([f"hb/{r}"])}
    except (dist.DistError, ValueError):
        return None
    if not silent:
        return f"rank {hb.rank} timed out after {limit}, as did every other rank: each waited for another"
    silent.sort(key=lambda r: beats[r]["time"] if r in beats else -math.inf)
    now = time.time()

    def last(r: int) -> str:
        if r not in beats:
            return "it never joined"
        at = "before its first step" if beats[r]["step"] is None else f"at step {beats[r]['step']}"
        return f"last heartbeat {at}, {now - beats[r]['time']:.0f} s ago"

    if len(silent) == 1:
        line = f"rank {silent[0]} stopped responding ({last(silent[0])}); "
        line += f"rank {hb.rank} timed out waiting for it after {limit}"
    else:
        line = f"ranks {', '.join(f'{r} ({last(r)})' for r in silent)} stopped responding; "
        line += f"rank {hb.rank} timed out waiting for them after {limit}"
    if fault_dir := os.environ.get(FAULT_DIR_ENV):
        pids = [beats[r]["pid"] for r in silent if r in beats]
        verdict = {"error": line, "pids": pids, "time": now, "attempt": _attempt()}
        # One file per attempt: the launcher reads each file once, so a restarted attempt's verdict written
        # over the last one's was never acted on (its hung rank lived on, and the next attempt waited for it).
        _write_fault(Path(fault_dir) / f"rank{hb.rank}_attempt{_attempt()}.json", verdict)
    return line


def record_error(line: str, consequence: bool) -> bool:
    """Under recscale's launcher, leave this rank's one-line error in ``$RECSCALE_FAULT_DIR/errors/``, from
    which the launcher reports the job's root cause as its one line (every rank printing its own would be N
    lines); False elsewhere, where the caller prints it. ``consequence``: the line says another rank failed."""
    fault_dir = os.environ.get(FAULT_DIR_ENV)
    if not fault_dir or "RANK" not in os.environ:
        return False
    rank, attempt = int(os.environ["RANK"]), _attempt()
    doc = {"error": line, "time": time.time(), "attempt": attempt, "consequence": consequence}
    try:
        _write_fault(Path(fault_dir) / ERRORS_SUBDIR / f"rank{rank}_attempt{attempt}.json", doc)
    except OSError:  # the launcher is gone (its folder with it): no one would report it
        return False
    return True


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def _write_fault(path: Path, doc: dict) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(doc))
    path.with_suffix(".tmp").replace(path)  # the launcher never reads half a file
