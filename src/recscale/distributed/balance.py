"""FreeScale-style load balancing of a data-parallel step (``distributed.balance``).

With contiguous slices, the rank that draws the longest histories is the straggler every other rank
waits for at the next collective. Instead, every rank partitions the same global batch by predicted
cost, so each rank gets about the same work:

    cost(sample) = 1 + Σ_f len_f        tokens  (per-position work: embeddings, projections, DIN)
    cost(sample) = 1 + Σ_f len_f²       tokens2 (attention over the history is quadratic)

over the sequence features f (the 1 is the sample's fixed cost). The partition is LPT (longest
processing time first): samples by descending cost, each to the rank with the least load so far. It
depends only on the batch, so every rank computes the same one without talking, and every sample is
trained exactly once per step: the loss is the same up to summation order, provided each rank scales
its summed loss by world / global batch (``Trainer.train_step``), as ranks now hold unequal counts.
"""

from __future__ import annotations

import heapq
from typing import Literal

import numpy as np

Balance = Literal["none", "tokens", "tokens2"]


def sample_costs(lengths: np.ndarray, balance: Balance) -> np.ndarray:
    """(B, n_sequences) history lengths -> (B,) predicted cost of each sample."""
    power = 2 if balance == "tokens2" else 1
    return 1 + (lengths.astype(np.int64) ** power).sum(axis=1)


def partition(costs: np.ndarray, world: int) -> list[np.ndarray]:
    """LPT: the positions 0..B-1 of ``costs`` split into ``world`` parts of near-equal total cost, each
    part in increasing position order. Ties go to the lowest rank, so the result is deterministic."""
    loads = [(0, r) for r in range(world)]
    owner = np.empty(len(costs), dtype=np.int64)
    for i in np.argsort(-costs, kind="stable"):
        load, r = heapq.heappop(loads)
        owner[i] = r
        heapq.heappush(loads, (load + int(costs[i]), r))
    return [np.flatnonzero(owner == r) for r in range(world)]


def imbalance(loads: np.ndarray) -> float:
    """max / mean of per-rank loads (1 = perfectly balanced)."""
    return float(loads.max() / loads.mean())
