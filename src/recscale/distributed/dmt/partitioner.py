"""DMT's tower partitioner (TP): which features share a tower, learned from a trained flat run
(``recscale dmt partition RUN_DIR``; ``assignment.resolve_assignment`` reads what it writes):

1. affinity: from a trained flat run, the embeddings of a sample of training rows; for features i
   and j, A_ij = E|<e_i, e_j>| / sqrt(E|e_i|² E|e_j|²): how strongly their learned vectors
   interact through the dot products an FM-style interaction computes (summed over the vectors of
   multi-embedding features).
2. spectral start: features ordered by the Fiedler vector of A's normalised Laplacian, cut into
   towers of equal lookup cost (neighbours in that order interact strongly).
3. balanced refinement: moves and swaps of features between towers that raise the intra-tower
   affinity Σ_t Σ_{i<j in t} A_ij while every tower's lookup cost (ids/sample x dim) and memory
   (rows x dim) stay under (1 + tolerance) x the mean (or the largest single feature's cost, when
   that is higher), until no move helps.

The report gives per tower its features, loads and affinity, and the same for round-robin and
random (the mean of 20 seeds) assignments as baselines.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from recscale.data.batch import Batch
from recscale.distributed.dmt.assignment import random_assignment, round_robin
from recscale.errors import ConfigError
from recscale.models.embedding import EmbeddingLayer


@dataclass(frozen=True)
class FeatureStats:
    """What the partitioner knows of the features, in schema order."""

    names: list[str]
    affinity: np.ndarray  # (n, n), symmetric, zero diagonal
    lookup: np.ndarray  # (n,) ids per sample x table dim
    memory: np.ndarray  # (n,) rows x table dim


def feature_stats(
    embedding: EmbeddingLayer, batch: Batch, num_embeddings: Callable[[str], int]
) -> FeatureStats:
    """Affinity and costs from a trained flat model's embedding layer on a batch of training rows."""
    with torch.no_grad():
        x = embedding(batch.dense, batch.sparse)  # (B, n, d)
    names = list(embedding.positions)
    vectors = [x[:, embedding.positions[f]] for f in names]  # (B, m_f, d) each
    n = len(names)
    affinity = np.zeros((n, n))
    norms = [v.square().sum((1, 2)).mean().item() for v in vectors]
    for i, j in itertools.combinations(range(n), 2):
        dots = torch.einsum("bmd,bkd->bmk", vectors[i], vectors[j]).abs().sum((1, 2)).mean().item()
        affinity[i, j] = affinity[j, i] = dots / max(np.sqrt(norms[i] * norms[j]), 1e-12)
    lengths = batch.sparse.lengths().view(len(batch.sparse.keys()), -1).float().mean(1)
    ids = dict(zip(batch.sparse.keys(), lengths.tolist(), strict=True))
    dims = {f: len(embedding.positions[f]) * embedding.dim for f in names}
    lookup = np.array([ids[f] * dims[f] for f in names])
    memory = np.array([num_embeddings(f) * dims[f] for f in names], dtype=float)
    return FeatureStats(names, affinity, lookup, memory)


def _caps(stats: FeatureStats, towers: int, tolerance: float) -> tuple[float, float]:
    return tuple(
        max((1 + tolerance) * cost.sum() / towers, cost.max()) for cost in (stats.lookup, stats.memory)
    )


def intra_affinity(stats: FeatureStats, labels: np.ndarray) -> float:
    """Σ over pairs in the same tower of A_ij."""
    same = labels[:, None] == labels[None, :]
    return float(np.triu(stats.affinity * same, 1).sum())


def _violation(stats: FeatureStats, labels: np.ndarray, towers: int, caps: tuple[float, float]) -> float:
    """How far the towers are over their caps (0 = balanced); an empty tower is infinitely far."""
    if np.any(np.bincount(labels, minlength=towers) == 0):
        return float("inf")
    return sum(
        float(np.maximum(np.bincount(labels, weights=cost, minlength=towers) - cap, 0).sum() / cap)
        for cost, cap in zip((stats.lookup, stats.memory), caps, strict=True)
    )


def _spectral_start(stats: FeatureStats, towers: int) -> np.ndarray:
    a = stats.affinity
    degree = a.sum(1) + 1e-12
    laplacian = np.eye(len(a)) - a / np.sqrt(np.outer(degree, degree))
    fiedler = np.linalg.eigh(laplacian)[1][:, 1] if len(a) > 1 else np.zeros(1)
    order = np.argsort(fiedler, kind="stable")
    share = np.cumsum(stats.lookup[order]) / stats.lookup.sum()
    labels = np.empty(len(a), dtype=int)
    labels[order] = np.minimum((share * towers - 1e-9).astype(int), towers - 1)
    return labels


def partition(stats: FeatureStats, towers: int, tolerance: float = 0.25) -> np.ndarray:
    """Tower of each feature: spectral start, then balanced moves and swaps (see module doc). When no
    assignment meets the caps, the one least over them."""
    n = len(stats.names)
    if towers > n:
        raise ConfigError(f"{towers} towers need at least as many features; there are {n}")
    caps = _caps(stats, towers, tolerance)
    labels = _spectral_start(stats, towers)
    if _violation(stats, labels, towers, caps) > 0:  # the spectral cut broke a balance: start balanced
        labels = np.empty(n, dtype=int)
        labels[np.argsort(-stats.memory, kind="stable")] = np.arange(n) % towers  # biggest tables apart
    # Lexicographic: first less over the caps, then more affinity at no more violation.
    best = (_violation(stats, labels, towers, caps), -intra_affinity(stats, labels))
    improved = True
    while improved:
        improved = False
        moves = [_moved(labels, i, t) for i in range(n) for t in range(towers) if t != labels[i]]
        swaps = [
            _swapped(labels, i, j) for i, j in itertools.combinations(range(n), 2) if labels[i] != labels[j]
        ]
        for candidate in moves + swaps:
            score = (_violation(stats, candidate, towers, caps), -intra_affinity(stats, candidate))
            if score[0] < best[0] - 1e-9 or (score[0] <= best[0] + 1e-9 and score[1] < best[1] - 1e-12):
                labels, best, improved = candidate, score, True
    return labels


def _moved(labels: np.ndarray, i: int, t: int) -> np.ndarray:
    out = labels.copy()
    out[i] = t
    return out


def _swapped(labels: np.ndarray, i: int, j: int) -> np.ndarray:
    out = labels.copy()
    out[i], out[j] = labels[j], labels[i]
    return out


def describe(stats: FeatureStats, labels: np.ndarray, towers: int) -> dict:
    """Balance (max / mean tower load) and intra-tower affinity (also as a share of all pairs')."""
    total = float(np.triu(stats.affinity, 1).sum())
    intra = intra_affinity(stats, labels)
    per_tower: list[dict[str, Any]] = []
    for t in range(towers):
        members = labels == t
        per_tower.append({
            "features": [f for f, m in zip(stats.names, members, strict=True) if m],
            "lookup": float(stats.lookup[members].sum()),
            "memory": float(stats.memory[members].sum()),
            "affinity": float(np.triu(stats.affinity[np.ix_(members, members)], 1).sum()),
        })  # fmt: skip
    return {
        "intra_affinity": intra,
        "intra_share": intra / total if total else 0.0,
        "lookup_imbalance": max(t["lookup"] for t in per_tower) / (stats.lookup.sum() / towers),
        "memory_imbalance": max(t["memory"] for t in per_tower) / (stats.memory.sum() / towers),
        "towers": per_tower,
    }


def partition_report(stats: FeatureStats, towers: int, tolerance: float, seed: int = 0) -> dict:
    """The learned assignment and its report, with round-robin and random baselines."""
    labels = partition(stats, towers, tolerance)
    rr = np.array([round_robin(stats.names, towers)[f] for f in stats.names])
    randoms = [
        describe(stats, np.array([random_assignment(stats.names, towers, s)[f] for f in stats.names]), towers)
        for s in range(seed, seed + 20)
    ]
    return {
        "assignment": {f: int(t) for f, t in zip(stats.names, labels, strict=True)},
        "towers": towers,
        "tolerance": tolerance,
        "partitioner": describe(stats, labels, towers),
        "round_robin": describe(stats, rr, towers),
        "random_mean_of_20": {
            k: float(np.mean([r[k] for r in randoms]))
            for k in ("intra_affinity", "intra_share", "lookup_imbalance", "memory_imbalance")
        },
    }


def summary(report: dict) -> str:
    """The report in a few lines: towers, then intra-tower affinity share and imbalances per method."""
    lines = [
        f"tower {t}: {', '.join(tw['features'])}" for t, tw in enumerate(report["partitioner"]["towers"])
    ]
    lines.append(f"{'':18s} intra-affinity share  lookup max/mean  memory max/mean")
    for name in ("partitioner", "round_robin", "random_mean_of_20"):
        r = report[name]
        lines.append(
            f"{name:18s} {r['intra_share']:20.3f}  {r['lookup_imbalance']:15.2f}  {r['memory_imbalance']:15.2f}"
        )
    return "\n".join(lines)
