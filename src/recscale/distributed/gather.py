"""Evaluation across ranks: each rank scores a slice of every batch, then all ranks get every score.

Every rank must run the same number of forward passes with rows in each (TorchRec's collectives pair
them up), so a rank's slice of a short last batch is padded by repeating the batch's last row, and
the padding is dropped when the scores are put back in row order.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist


def eval_batches(rows: int, batch_size: int, rank: int, world_size: int) -> list[np.ndarray]:
    """Row indices this rank scores in each batch of ``batch_size`` rows (the global batch), in order."""
    out = []
    for lo in range(0, rows, batch_size):
        hi = min(lo + batch_size, rows)
        per = -(-(hi - lo) // world_size)
        out.append(np.minimum(np.arange(lo + rank * per, lo + (rank + 1) * per), hi - 1))
    return out


def gather_scores(local: torch.Tensor, rows: int, batch_size: int, world_size: int) -> torch.Tensor:
    """Every rank's ``local`` scores (this rank's ``eval_batches`` concatenated) -> (rows,) in row order."""
    if world_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local)
    out, start = [], 0
    for lo in range(0, rows, batch_size):
        n = min(batch_size, rows - lo)
        per = -(-n // world_size)
        out.append(torch.cat([p[start : start + per] for p in parts])[:n])
        start += per
    return torch.cat(out)
