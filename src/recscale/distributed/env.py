"""The process group of a run: torchrun's environment, or a one-process group for local runs.

Single-process training goes through the same TorchRec ``DistributedModelParallel`` path as a
multi-process job, on a world of size 1, so there is one code path to test.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> DistEnv:
    """Join torchrun's process group if launched by it, else start a group of one on localhost."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        if launched:
            dist.init_process_group(backend)
        else:
            os.environ.setdefault("LOCAL_WORLD_SIZE", "1")  # TorchRec's planner reads it
            store = dist.TCPStore("127.0.0.1", _free_port(), 1, is_master=True)
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return DistEnv(rank, world, local_rank, local_world, device, backend)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
