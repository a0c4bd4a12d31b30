"""FreeScale-style load balancing of a data-parallel step (``distributed.balance``).

With contiguous slices, the rank that draws the longest histories is the straggler every other rank
waits for at the next collective. Instead, every rank partitions the same global batch by predicted
cost, so each rank gets about the same work:

    cost(sample) = 1 + Σ_f len_f        tokens  (per-position work: embeddings, projections, DIN)
    cost(sample) = 1 + Σ_f len_f²       tokens2 (attention over the history is quadratic)
    cost(sample) = F + Σ_f (a_f len_f + b_f len_f²)     flops

over the sequence features f (the 1 is the sample's fixed cost). ``flops`` takes the coefficients from
the model's own FLOP count (``CostModel.flops``): F the dense network's FLOPs per example outside the
histories, a_f the encoder's FLOPs per position (projections, feed-forward, DIN's scoring MLP), b_f its
FLOPs per position² (attention). It matters when both terms do: for a causal block of width d the
per-position work is 12 d² FLOPs and attention's 4 d per position², so attention dominates only beyond
3 d positions, and ``tokens2`` overweights the long histories below that. The partition is LPT (longest
processing time first): samples by descending cost, each to the rank with the least load so far. It
depends only on the batch, so every rank computes the same one without talking, and every sample is
trained exactly once per step: the loss is the same up to summation order, provided each rank scales
its summed loss by world / global batch (``Trainer.train_step``), as ranks now hold unequal counts.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Balance = Literal["none", "tokens", "tokens2", "flops"]


@dataclass(frozen=True)
class CostModel:
    """cost(sample) = fixed + Σ_f linear[f] len_f + quadratic[f] len_f², f over the sequence features."""

    fixed: float
    linear: tuple[float, ...]
    quadratic: tuple[float, ...]

    @classmethod
    def tokens(cls, balance: Literal["tokens", "tokens2"], n_sequences: int) -> CostModel:
        """1 + Σ len (``tokens``) or 1 + Σ len² (``tokens2``)."""
        one, zero = (1.0,) * n_sequences, (0.0,) * n_sequences
        return cls(1.0, one, zero) if balance == "tokens" else cls(1.0, zero, one)

    @classmethod
    def flops(cls, fixed: float, length_flops: Sequence[tuple[int, int]]) -> CostModel:
        """From the model: ``fixed`` FLOPs per example outside the histories, and each sequence
        feature's encoder FLOPs (per position, per position²)."""
        return cls(
            float(fixed), tuple(float(a) for a, _ in length_flops), tuple(float(b) for _, b in length_flops)
        )


def sample_costs(lengths: np.ndarray, model: CostModel) -> np.ndarray:
    """(B, n_sequences) history lengths -> (B,) predicted cost of each sample."""
    n = lengths.astype(np.float64)
    return model.fixed + n @ np.array(model.linear) + (n * n) @ np.array(model.quadratic)


def partition(costs: np.ndarray, world: int) -> list[np.ndarray]:
    """LPT: the positions 0..B-1 of ``costs`` split into ``world`` parts of near-equal total cost, each
    part in increasing position order. Ties go to the lowest rank, so the result is deterministic."""
    loads = [(0.0, r) for r in range(world)]
    owner = np.empty(len(costs), dtype=np.int64)
    for i in np.argsort(-costs, kind="stable"):
        load, r = heapq.heappop(loads)
        owner[i] = r
        heapq.heappush(loads, (load + float(costs[i]), r))
    return [np.flatnonzero(owner == r) for r in range(world)]


def imbalance(loads: np.ndarray) -> float:
    """max / mean of per-rank loads (1 = perfectly balanced)."""
    return float(loads.max() / loads.mean())
