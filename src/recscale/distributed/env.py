"""The process group of a run: torchrun's environment, or a one-process group for local runs.

Single-process training goes through the same TorchRec ``DistributedModelParallel`` path as a
multi-process job, on a world of size 1, so there is one code path to test.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from recscale.distributed.topology import Topology


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float | None = None) -> DistEnv:
    """Join torchrun's process group if launched by it, else start a group of one on localhost.

    ``timeout_s`` bounds every collective: a rank whose peer hangs fails after it instead of
    waiting forever (a peer that dies is noticed at once, by its closed connections).
    """
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    Topology(world, local_world)  # fails early on an impossible layout
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else default_pg_timeout
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if not dist.is_initialized():
        if launched:
            store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
            # torchrun's static rendezvous keeps one store across restarts (torch 2.13): without a
            # fresh prefix per attempt, a restarted group reads the dead attempt's addresses and hangs.
            store = dist.PrefixStore(f"recscale/attempt_{restarts}", store)
        else:
            os.environ.setdefault("LOCAL_WORLD_SIZE", "1")  # TorchRec's planner reads it
            store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return DistEnv(rank, world, local_rank, local_world, device, backend, restarts)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def lost_peer(e: BaseException) -> str | None:
    """One line for an error meaning another rank died or stopped answering; None for other errors.

    gloo reports a dead peer as a plain RuntimeError ("Connection closed by peer"); timeouts and
    NCCL failures are ``torch.distributed.DistError`` s.
    """
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip().split("\n")[0])  # drop gloo's "[file:line]"
    if not isinstance(e, dist.DistError) and not re.search(r"(closed|reset) by peer", text):
        return None
    rank = os.environ.get("RANK", "0")
    return f"rank {rank} lost contact with another rank ({text.split('. ')[0][:160]}); that rank failed first"
