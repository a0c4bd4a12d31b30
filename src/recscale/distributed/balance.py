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
processing time first): samples by descending cost, each to the rank with the least load so far.

A padded encoder does more than the jagged work: each length bucket is padded to its longest history
(``model.embedding.sequence.buckets``). With ``CostModel.padding`` set (``flops`` sets it from the
encoder's buckets: ``pow2``, or ``batch`` for one bucket), LPT adds each sample to the rank whose padded
load grows least: joining a bucket whose longest history is m costs F + a m + b m² (every member is
padded to m; a longer sample pads the members already there up to its length), opening a bucket costs
its own length's work. Samples come in descending cost, so most joins pad the newcomer, not the bucket. It
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
# How an encoder pads a rank's histories: not at all (jagged), to the rank's longest (batch), or to the
# longest of each power-of-two length class (pow2).
Padding = Literal["jagged", "batch", "pow2"]


@dataclass(frozen=True)
class CostModel:
    """cost(sample) = fixed + Σ_f linear[f] len_f + quadratic[f] len_f², f over the sequence features."""

    fixed: float
    linear: tuple[float, ...]
    quadratic: tuple[float, ...]
    padding: Padding = "jagged"

    @classmethod
    def tokens(cls, balance: Literal["tokens", "tokens2"], n_sequences: int) -> CostModel:
        """1 + Σ len (``tokens``) or 1 + Σ len² (``tokens2``)."""
        one, zero = (1.0,) * n_sequences, (0.0,) * n_sequences
        return cls(1.0, one, zero) if balance == "tokens" else cls(1.0, zero, one)

    @classmethod
    def flops(
        cls,
        fixed: float,
        length_flops: Sequence[tuple[int, int]],
        padding: Padding = "jagged",
    ) -> CostModel:
        """From the model: ``fixed`` FLOPs per example outside the histories, each sequence feature's
        encoder FLOPs (per position, per position²), and how its encoder pads."""
        linear, quadratic = (tuple(float(c[i]) for c in length_flops) for i in (0, 1))
        return cls(float(fixed), linear, quadratic, padding)


def sample_costs(lengths: np.ndarray, model: CostModel) -> np.ndarray:
    """(B, n_sequences) history lengths -> (B,) predicted cost of each sample."""
    n = lengths.astype(np.float64)
    return model.fixed + n @ np.array(model.linear) + (n * n) @ np.array(model.quadratic)


def part_cost(lengths: np.ndarray, model: CostModel) -> float:
    """(B, n_sequences) history lengths of one rank's part -> its predicted cost, padding included."""
    if model.padding == "jagged":
        return float(sample_costs(lengths, model).sum())
    total = model.fixed * len(lengths)
    for f, column in enumerate(lengths.T.astype(np.int64)):
        keys = np.zeros_like(column) if model.padding == "batch" else _pow2_bucket(column)
        for k in np.unique(keys):
            members = column[keys == k]
            top = float(members.max())
            total += len(members) * (model.linear[f] * top + model.quadratic[f] * top * top)
    return total


def _pow2_bucket(lengths: np.ndarray) -> np.ndarray:
    """Length class k of each length: (2^(k-1), 2^k], with 0 and 1 in class 0 (the encoder's pow2 buckets)."""
    return np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64)


def balanced_parts(lengths: np.ndarray, model: CostModel, world: int) -> list[np.ndarray]:
    """(B, n_sequences) history lengths -> each rank's positions in the batch (see the module doc)."""
    costs = sample_costs(lengths, model)
    if model.padding == "jagged":
        return partition(costs, world)
    terms = list(zip(model.linear, model.quadratic, strict=True))
    classes = np.zeros_like(lengths) if model.padding == "batch" else _pow2_bucket(lengths)
    n_classes = int(classes.max(initial=0)) + 1
    # Per rank and sequence feature, per length class: members so far and their longest length.
    members = [[[0] * n_classes for _ in terms] for _ in range(world)]
    longest = [[[0] * n_classes for _ in terms] for _ in range(world)]
    loads = [0.0] * world
    owner = np.empty(len(costs), dtype=np.int64)
    order = np.argsort(-costs, kind="stable")
    for i, row, keys in zip(order.tolist(), lengths[order].tolist(), classes[order].tolist(), strict=True):
        best, best_load = 0, float("inf")
        for r in range(world):
            load = loads[r] + model.fixed
            for (lin, quad), v, k, n_r, m_r in zip(terms, row, keys, members[r], longest[r], strict=True):
                n, m = n_r[k], m_r[k]
                top = m if m > v else v  # a longer newcomer pads the members already there
                load += lin * ((n + 1) * top - n * m) + quad * ((n + 1) * top * top - n * m * m)
            if load < best_load:
                best, best_load = r, load
        owner[i], loads[best] = best, best_load
        for v, k, n_r, m_r in zip(row, keys, members[best], longest[best], strict=True):
            n_r[k] += 1
            m_r[k] = max(m_r[k], v)
    return [np.flatnonzero(owner == r) for r in range(world)]


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
