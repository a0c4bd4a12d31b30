"""What bench/distributed.py and bench/dmt.py share: each runs its own ``--worker`` on N ranks through
``recscale.distributed.launch`` (the launcher behind ``recscale train --nproc``); rank 0 writes a JSON
result that the parent reads back.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "runs" / "bench"


def add_worker_args(p: argparse.ArgumentParser) -> None:
    """The hidden flags the parent passes its workers."""
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)


def run_workers(script: str, flags: list[str], run_dir: Path, result: Path, nproc: int, local: int) -> Any:
    """``script flags --worker`` on ``nproc`` ranks, ``local`` per simulated host; what rank 0 wrote to ``result``."""
    from recscale.distributed.launch import launch

    launch([script, *flags, "--worker", "--run-dir", str(run_dir), "--result", str(result)], nproc, local, 0)
    return json.loads(result.read_text())


def rank_batches(trainer: Any, global_batch: int, steps: int) -> list:
    """This rank's share of the first ``steps`` global batches of epoch 0, gathered ahead of timing."""
    from recscale.data.dataset import epoch_batches, iterate

    env = trainer.env
    index = epoch_batches(len(trainer.train_ds), global_batch, seed=0, epoch=0, drop_last=True,
                          rank=env.rank, world_size=env.world_size)  # fmt: skip
    return list(iterate(trainer.train_ds, index[:steps]))
