"""NeuroShard's search: column-wise splits by beam search, table-wise placement by a greedy grid over
dim-balance thresholds, scored by the learned cost models.

A plan's cost is max over ranks of the predicted shard compute (forward + backward) plus the predicted
all-to-all (forward + backward) for the ranks' output dim sums. Column shards are equal, a multiple of
4 columns wide (fbgemm's kernels), on distinct ranks, as recscale's column-wise plans build them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from recscale.distributed.planner.cost_model import CostModels
from recscale.distributed.planner.features import TableFeatures
from recscale.errors import ConfigError

# Upper bounds on a rank's dim sum, as multiples of the mean; inf: no bound (pure cost greedy).
THRESHOLDS = (1.0, 1.1, 1.25, 1.5, 2.0, math.inf)
_COLUMN_MULTIPLE = 4


@dataclass(frozen=True)
class Shard:
    table: int  # index into the planned tables
    offset: int  # first column
    width: int
    rank: int


@dataclass(frozen=True)
class Plan:
    """Shards and what the cost models predict for them."""

    shards: list[Shard]
    compute_ms: list[float]  # per rank
    comm_ms: float
    memory: list[int]  # bytes per rank

    @property
    def cost_ms(self) -> float:
        return max(self.compute_ms) + self.comm_ms

    def ranks_of(self, table: int) -> list[int]:
        """The ranks holding ``table``'s column shards, first columns first."""
        return [s.rank for s in sorted(self.shards, key=lambda s: s.offset) if s.table == table]


class _Unplaceable(Exception):
    def __init__(self, table: int) -> None:
        self.table = table


class LearnedPlanner:
    """Plans ``tables`` over ``world`` ranks holding at most ``memory_cap`` bytes each (None: no cap)."""

    def __init__(
        self, models: CostModels, world: int, memory_cap: int | None = None, beam: int = 3, steps: int = 8
    ) -> None:
        self.models, self.world, self.cap = models, world, memory_cap
        self.beam, self.steps = beam, steps

    def plan(self, tables: list[TableFeatures]) -> Plan:
        self.tables = tables
        self._check_fits(tables)
        self._emb: dict[tuple[int, int], np.ndarray] = {}
        for t, f in enumerate(tables):
            for k in self._splits(f):
                self._emb[t, k] = self.models.table_embedding(f.columns(f.dim // k).vector())
        start = tuple(1 for _ in tables)
        best = self._best_placement(start)
        beam, seen = [(best.cost_ms, start, best)], {start}
        state = start
        for _ in range(self.steps):
            children = []
            for _, state, _ in beam:
                for t in self._split_candidates(state):
                    child = tuple(k * 2 if i == t else k for i, k in enumerate(state))
                    if child not in seen:
                        seen.add(child)
                        try:
                            p = self._best_placement(child)
                        except _Unplaceable:
                            continue
                        children.append((p.cost_ms, child, p))
            beam = sorted(beam + children, key=lambda c: c[0])[: self.beam]
            if not children or beam[0][2] is best:
                break
            _, state, best = beam[0]
        return self._refine(best, state)

    def _refine(self, plan: Plan, state: tuple[int, ...], moves: int = 200) -> Plan:
        """Hill-climb (recscale's addition to NeuroShard's search): move a shard off the costliest rank
        while that lowers the predicted plan cost."""
        R, shards = self.world, list(plan.shards)
        sums = np.zeros((R, self._emb[0, 1].shape[-1]), dtype=np.float32)
        dims, mem, count = np.zeros(R), np.array(plan.memory, dtype=np.int64), np.zeros(R, dtype=np.int64)
        for sh in shards:
            sums[sh.rank] += self._emb[sh.table, state[sh.table]]
            dims[sh.rank] += sh.width
            count[sh.rank] += 1
        compute = np.where(count > 0, self.models.shard_cost(sums), 0.0)
        cost = compute.max() + float(self.models.comm_cost(dims))
        for _ in range(moves):
            top, move = int(np.argmax(compute)), None
            for i, sh in enumerate(shards):
                if sh.rank != top:
                    continue
                e, m = self._emb[sh.table, state[sh.table]], self.tables[sh.table].columns(sh.width).memory()
                held = {x.rank for x in shards if x.table == sh.table}
                to = [r for r in range(R) if r not in held and (self.cap is None or mem[r] + m <= self.cap)]
                if not to:
                    continue
                left = float(self.models.shard_cost(sums[top] - e)) if count[top] > 1 else 0.0
                after = self.models.shard_cost(sums[to] + e)
                for r, c_r in zip(to, after, strict=True):
                    comp = compute.copy()
                    comp[top], comp[r] = left, c_r
                    d = dims.copy()
                    d[top] -= sh.width
                    d[r] += sh.width
                    c = comp.max() + float(self.models.comm_cost(d))
                    if c < cost - 1e-6:
                        cost, move = c, (i, r, comp)
            if move is None:
                break
            i, r, compute = move
            sh = shards[i]
            e, m = self._emb[sh.table, state[sh.table]], self.tables[sh.table].columns(sh.width).memory()
            sums[sh.rank] -= e
            sums[r] += e
            dims[sh.rank] -= sh.width
            dims[r] += sh.width
            mem[sh.rank] -= m
            mem[r] += m
            count[sh.rank] -= 1
            count[r] += 1
            shards[i] = Shard(sh.table, sh.offset, sh.width, r)
        comm = float(self.models.comm_cost(dims))
        return Plan(shards, [float(c) for c in compute], comm, [int(x) for x in mem])

    def _splits(self, f: TableFeatures) -> list[int]:
        """Column-shard counts allowed for ``f``: powers of 2 up to the world, equal multiples of 4."""
        ks = [1]
        while 2 * ks[-1] <= self.world and f.dim % (2 * ks[-1] * _COLUMN_MULTIPLE) == 0:
            ks.append(2 * ks[-1])
        return ks

    def _check_fits(self, tables: list[TableFeatures]) -> None:
        if self.cap is None:
            return
        for f in tables:
            if f.memory() / max(self._splits(f)) > self.cap:
                self._too_big(f)

    def _too_big(self, f: TableFeatures) -> None:
        cap, total = (self.cap or 0) / 2**20, sum(t.memory() for t in self.tables) / 2**20
        raise ConfigError(
            f"distributed.learned.memory_cap_mb: table {f.name!r} ({f.memory() / 2**20:.3g} MB with its "
            f"optimizer state) does not fit under the cap of {cap:.3g} MB per rank on {self.world} ranks "
            f"(all tables: {total:.3g} MB); raise the cap or use more ranks"
        )

    def _split_candidates(self, state: tuple[int, ...], top: int = 3) -> list[int]:
        """The ``top`` tables of highest predicted single-shard cost that can split further."""
        cost = {t: float(self.models.shard_cost(self._emb[t, k])) for t, k in enumerate(state)}
        ok = [t for t, k in enumerate(state) if (t, 2 * k) in self._emb]
        return sorted(ok, key=lambda t: -cost[t])[:top]

    def _best_placement(self, state: tuple[int, ...]) -> Plan:
        plans, failed = [], None
        # Shards by predicted cost (NeuroShard); when memory caps defeat that, largest first.
        for by_memory in (False, True):
            for theta in THRESHOLDS:
                try:
                    plans.append(self._place(state, theta, by_memory))
                except _Unplaceable as e:
                    failed = e
            if plans:
                break
        if not plans:
            assert failed is not None
            if all(k == 1 for k in state):
                self._too_big(self.tables[failed.table])
            raise failed
        return min(plans, key=lambda p: p.cost_ms)

    def _place(self, state: tuple[int, ...], theta: float, by_memory: bool = False) -> Plan:
        """Greedy: shards by predicted cost (or memory), each to the rank it costs least on among those
        under the dim bound ``theta`` x mean (any rank with memory left when none is)."""
        R = self.world
        widths = [(t, f.dim // k, k) for t, (f, k) in enumerate(zip(self.tables, state, strict=True))]
        if by_memory:
            order = sorted(widths, key=lambda w: -self.tables[w[0]].columns(w[1]).memory())
        else:
            order = sorted(widths, key=lambda w: -float(self.models.shard_cost(self._emb[w[0], w[2]])))
        bound = theta * sum(f.dim for f in self.tables) / R
        sums = np.zeros((R, self._emb[0, 1].shape[-1]), dtype=np.float32)
        dims, mem = np.zeros(R), np.zeros(R)
        holds: list[set[int]] = [set() for _ in range(R)]
        shards = []
        for t, width, k in order:
            e = self._emb[t, k]
            m = self.tables[t].columns(width).memory()
            for j in range(k):
                free = [
                    r for r in range(R) if t not in holds[r] and (self.cap is None or mem[r] + m <= self.cap)
                ]
                if not free:
                    raise _Unplaceable(t)
                under = [r for r in free if dims[r] + width <= bound] or free
                costs = self.models.shard_cost(sums[under] + e)
                r = under[int(np.argmin(costs))]
                sums[r] += e
                dims[r] += width
                mem[r] += m
                holds[r].add(t)
                shards.append(Shard(t, j * width, width, r))
        compute = [float(self.models.shard_cost(sums[r])) if holds[r] else 0.0 for r in range(R)]
        comm = float(self.models.comm_cost(dims))
        return Plan(shards, compute, comm, [int(x) for x in mem])
