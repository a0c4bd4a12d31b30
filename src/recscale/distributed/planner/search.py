"""NeuroShard's search: column-wise splits by beam search, table-wise placement by a greedy grid over
dim-balance thresholds, scored by the learned cost models.

A plan's cost is max over ranks of the predicted shard compute (forward + backward) plus the predicted
all-to-all (forward + backward) for the ranks' output dim sums; over several hosts, plus the time the
busiest host's inter-host traffic takes at TorchRec's cross-node bandwidth (``inter_host_ms``). Column
shards are equal, a multiple of 4 columns wide (fbgemm's kernels), on distinct ranks, as recscale's
column-wise plans build them. A table that fits the memory cap only split by rows is row-wise over all
the planner's ranks (over one host's ranks in the hierarchical search: table_row_wise): each rank holds a
block of its rows, takes its share of the lookups and sends a partial output for every example, which the
all-to-all term counts as that many output dims on every rank (the bytes of TorchRec's reduce-scatter).
The plan kept is the cheapest predicted of the search's, the
hierarchical search's (several hosts) and the caller's candidates (other planners' placements), then
hill-climbed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torchrec.distributed.planner.constants import CROSS_NODE_BANDWIDTH

from recscale.distributed.planner.cost_model import CostModels
from recscale.distributed.planner.features import BATCH, TableFeatures
from recscale.distributed.topology import Topology
from recscale.errors import ConfigError

# Upper bounds on a rank's (or host's) dim sum, as multiples of the mean; inf: no bound (pure cost greedy).
THRESHOLDS = (1.0, 1.1, 1.25, 1.5, 2.0, math.inf)
_COLUMN_MULTIPLE = 4
# Bytes per pooled output value (fp32) and per id (int64) of the all-to-alls.
_VALUE_BYTES, _ID_BYTES = 4, 4  # float32 outputs, int32 ids


@dataclass(frozen=True)
class Shard:
    table: int  # index into the planned tables
    offset: int  # first column
    width: int
    rank: int
    parts: int = 1  # > 1: one of the table's ``parts`` row blocks (every column), one per rank


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

    def row_split(self, table: int) -> bool:
        """Whether ``table`` is split by rows (row blocks on ``ranks_of(table)``, in order)."""
        return any(s.parts > 1 for s in self.shards if s.table == table)


def traffic(topology: Topology, dims: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, float]:
    """Bytes of one step's all-to-alls: per host, to and from the other hosts; and in all, between
    ranks of one host. Each rank sends its pooled outputs (``dims`` per rank) for every other rank's
    examples and gets their gradients back, and receives their ids (``ids``: ids per example its shards
    read)."""
    W, L = topology.world_size, topology.local_world_size
    to_one = BATCH / W * (2 * _VALUE_BYTES * dims + _ID_BYTES * ids)  # with each other rank
    per_host = (to_one * (W - L)).reshape(topology.num_hosts, L).sum(1)
    return per_host, float((to_one * (L - 1)).sum())


def inter_host_ms(topology: Topology, dims: np.ndarray, ids: np.ndarray) -> float:
    """Time of the busiest host's inter-host traffic at TorchRec's cross-node bandwidth; zero on one
    host, where all ranks share the all-to-all the comm model measured."""
    if topology.num_hosts == 1:
        return 0.0
    return float(traffic(topology, dims, ids)[0].max() / CROSS_NODE_BANDWIDTH)


class _Unplaceable(Exception):
    def __init__(self, table: int) -> None:
        self.table = table


class LearnedPlanner:
    """Plans tables over ``world`` ranks, ``local_world`` per host (None: one host), holding at most
    ``memory_cap`` bytes each (None: no cap), of which ``reserved`` (bytes per rank, default none) are
    taken already by tables placed before planning (``distributed.tables``): they count towards the cap
    and the plan's ``memory``."""

    def __init__(
        self,
        models: CostModels,
        world: int,
        memory_cap: int | None = None,
        beam: int = 3,
        steps: int = 8,
        local_world: int | None = None,
        reserved: Sequence[int] | None = None,
    ) -> None:
        self.models, self.world, self.cap = models, world, memory_cap
        self.beam, self.steps = beam, steps
        self.topology = Topology(world, local_world or world)
        self.reserved = (
            np.zeros(world, dtype=np.int64) if reserved is None else np.asarray(reserved, np.int64)
        )
        assert self.reserved.shape == (world,), self.reserved

    def plan(self, tables: list[TableFeatures], candidates: Sequence[list[Shard]] = ()) -> Plan:
        """The cheapest predicted plan of the search's and ``candidates`` (placements of ``tables``, e.g.
        other planners'; those over the memory cap are passed over), hill-climbed."""
        self.tables = tables
        self._emb: dict[tuple[int, int, int], np.ndarray] = {}
        if self.cap is not None and self.reserved.max() > self.cap:
            self._too_big(None)
        self.by_rows = self._row_split_tables()
        plans = [self._search()]
        if self.topology.num_hosts > 1:
            plans += self._hierarchical()
        for shards in candidates:
            p = self.score(shards)
            if self.cap is None or max(p.memory) <= self.cap:
                plans.append(p)
        return self._refine(min(plans, key=lambda p: p.cost_ms))

    def score(self, shards: list[Shard]) -> Plan:
        """What the cost models predict for ``shards`` (of the tables being planned)."""
        sums, dims, ids, mem, count = self._loads(shards)
        compute = np.where(count > 0, self.models.shard_cost(sums), 0.0)
        return Plan(shards, [float(c) for c in compute], self._comm(dims, ids), [int(x) for x in mem])

    def _features(self, table: int, width: int, parts: int = 1) -> TableFeatures:
        """A shard's features: ``width`` columns of ``table``, or one of its ``parts`` row blocks."""
        f = self.tables[table]
        return f.row_block(parts) if parts > 1 else f.columns(width)

    def _emb_of(self, table: int, width: int, parts: int = 1) -> np.ndarray:
        """The compute model's embedding of a shard (``_features``; cached)."""
        e = self._emb.get((table, width, parts))
        if e is None:
            e = self._emb[table, width, parts] = self.models.table_embedding(
                self._features(table, width, parts).vector()
            )
        return e

    def _row_shards(self) -> list[Shard]:
        """The row-split tables' blocks, one on each rank."""
        return [
            Shard(t, 0, self.tables[t].dim, r, self.world)
            for t in sorted(self.by_rows)
            for r in range(self.world)
        ]

    def _loads(self, shards: list[Shard]) -> tuple[np.ndarray, ...]:
        """Per rank: summed table embeddings, output dims, ids per example, memory, shard count."""
        R = self.world
        sums = np.zeros((R, self._emb_of(0, self.tables[0].dim).shape[-1]), dtype=np.float32)
        dims, ids = np.zeros(R), np.zeros(R)
        mem, count = self.reserved.copy(), np.zeros(R, dtype=np.int64)
        for sh in shards:
            f = self._features(sh.table, sh.width, sh.parts)
            sums[sh.rank] += self._emb_of(sh.table, sh.width, sh.parts)
            dims[sh.rank] += sh.width
            ids[sh.rank] += f.pooling
            mem[sh.rank] += f.memory()
            count[sh.rank] += 1
        return sums, dims, ids, mem, count

    def _comm(self, dims: np.ndarray, ids: np.ndarray) -> float:
        return float(self.models.comm_cost(dims)) + inter_host_ms(self.topology, dims, ids)

    def _search(self) -> Plan:
        """NeuroShard's beam search over column splits, each state placed by the greedy grid."""
        start = tuple(self._fewest_splits(f) for f in self.tables)
        while True:  # a table the greedy cannot fit beside the others: split it further while it can be
            try:
                best = self._best_placement(start)
                break
            except _Unplaceable as e:
                k = start[e.table]
                if e.table in self.by_rows or 2 * k not in self._splits(self.tables[e.table]):
                    self._too_big(self.tables[e.table], beside_others=True)
                start = tuple(2 * k if t == e.table else s for t, s in enumerate(start))
        beam, seen = [(best.cost_ms, start, best)], {start}
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
            best = beam[0][2]
        return best

    def _hierarchical(self) -> list[Plan]:
        """Hierarchical placement for several hosts: whole tables to hosts (largest predicted cost first,
        each to the host of least summed cost under a host dim-sum bound, NeuroShard's grid one level
        up: the bound keeps the busiest host's inter-host all-to-all small), then each host's tables
        over its ranks by the flat search, so column splits stay inside a host (table_column_wise)."""
        H, L = self.topology.num_hosts, self.topology.local_world_size
        cost = [float(self.models.shard_cost(self._emb_of(t, f.dim))) for t, f in enumerate(self.tables)]
        order = sorted(range(len(self.tables)), key=lambda t: -cost[t])
        total_dim = sum(f.dim for f in self.tables)
        assignments: set[tuple[int, ...]] = set()
        for theta in THRESHOLDS:
            load, dims, host = np.zeros(H), np.zeros(H), [0] * len(self.tables)
            mem = self.reserved.reshape(H, L).sum(1).astype(np.float64)
            for t in order:
                f = self.tables[t]
                free = [h for h in range(H) if self.cap is None or mem[h] + f.memory() <= self.cap * L]
                under = (
                    [h for h in free if dims[h] + f.dim <= theta * total_dim / H] or free or list(range(H))
                )
                h = min(under, key=lambda h: load[h])
                host[t] = h
                load[h], dims[h], mem[h] = load[h] + cost[t], dims[h] + f.dim, mem[h] + f.memory()
            assignments.add(tuple(host))
        plans = []
        for assigned in sorted(assignments):
            shards = []
            try:
                for h in range(H):
                    held = [t for t in range(len(self.tables)) if assigned[t] == h]
                    if held:
                        reserved = [int(x) for x in self.reserved[h * L : (h + 1) * L]]
                        sub = LearnedPlanner(
                            self.models, L, self.cap, self.beam, self.steps, reserved=reserved
                        )
                        part = sub.plan([self.tables[t] for t in held])
                        shards += [
                            Shard(held[s.table], s.offset, s.width, h * L + s.rank, s.parts)
                            for s in part.shards
                        ]
            except ConfigError:  # a host's tables do not fit its ranks' caps: no hierarchical plan this way
                continue
            plans.append(self.score(shards))
        return plans

    def _refine(self, plan: Plan, moves: int = 200) -> Plan:
        """Hill-climb (recscale's addition to NeuroShard's search): move a shard off the costliest rank
        while that lowers the predicted plan cost."""
        R, shards = self.world, list(plan.shards)
        sums, dims, ids, mem, count = self._loads(shards)
        compute = np.where(count > 0, self.models.shard_cost(sums), 0.0)
        cost = compute.max() + self._comm(dims, ids)
        for _ in range(moves):
            top, move = int(np.argmax(compute)), None
            for i, sh in enumerate(shards):
                if sh.rank != top or sh.parts > 1:
                    continue
                f = self.tables[sh.table]
                e, m = self._emb_of(sh.table, sh.width), f.columns(sh.width).memory()
                held = {x.rank for x in shards if x.table == sh.table}
                to = [r for r in range(R) if r not in held and (self.cap is None or mem[r] + m <= self.cap)]
                if not to:
                    continue
                left = float(self.models.shard_cost(sums[top] - e)) if count[top] > 1 else 0.0
                after = self.models.shard_cost(sums[to] + e)
                for r, c_r in zip(to, after, strict=True):
                    comp = compute.copy()
                    comp[top], comp[r] = left, c_r
                    d, n = dims.copy(), ids.copy()
                    d[top], d[r] = d[top] - sh.width, d[r] + sh.width
                    n[top], n[r] = n[top] - f.pooling, n[r] + f.pooling
                    c = comp.max() + self._comm(d, n)
                    if c < cost - 1e-6:
                        cost, move = c, (i, r, comp)
            if move is None:
                break
            i, r, compute = move
            shards[i] = Shard(shards[i].table, shards[i].offset, shards[i].width, r)
            sums, dims, ids, mem, count = self._loads(shards)
        return Plan(shards, [float(c) for c in compute], self._comm(dims, ids), [int(x) for x in mem])

    def _splits(self, f: TableFeatures) -> list[int]:
        """Column-shard counts allowed for ``f``: powers of 2 up to the world, equal multiples of 4."""
        ks = [1]
        while 2 * ks[-1] <= self.world and f.dim % (2 * ks[-1] * _COLUMN_MULTIPLE) == 0:
            ks.append(2 * ks[-1])
        return ks

    def _column_splits_that_fit(self, f: TableFeatures) -> int | None:
        """The fewest column shards of ``f`` that each fit the memory cap (1 without a cap), or None."""
        ks = self._splits(f)
        room = None if self.cap is None else self.cap - int(self.reserved.min())  # on the emptiest rank
        return next((k for k in ks if room is None or f.columns(f.dim // k).memory() <= room), None)

    def _fewest_splits(self, f: TableFeatures) -> int:
        """The search's first column split of ``f``: the fewest that fit (a row-split table's is unused)."""
        return self._column_splits_that_fit(f) or self._splits(f)[-1]

    def _row_split_tables(self) -> frozenset[int]:
        """The tables that fit the memory cap only split by rows (even their narrowest column shards do
        not); a table that does not fit split by rows over every rank either is a one-line error."""
        out, blocks = set(), 0  # bytes of the row-split tables' blocks on each rank so far
        for t, f in enumerate(self.tables):
            if self._column_splits_that_fit(f) is not None:
                continue
            assert self.cap is not None  # without a cap every table fits whole
            if -(-f.rows // self.world) * (self.world - 1) >= f.rows:
                # TorchRec's blocks of ceil(rows / ranks) rows leave the last rank none: a row-wise plan
                # fbgemm's CPU lookup fails on, for a table so small that only the cap asked to split it.
                raise ConfigError(
                    f"distributed.learned.memory_cap_mb: table {f.name!r} ({f.memory() / 2**20:.3g} MB with its "
                    f"optimizer state) fits the cap of {self.cap / 2**20:.3g} MB per rank only split by rows, "
                    f"and its {f.rows} rows in blocks of ceil(rows / {self.world}) leave a rank none; raise the cap"
                )
            block = f.row_block(self.world).memory()
            if block > self.cap - int(self.reserved.max()):  # a block on each rank
                self._too_big(f)
            # Every rank holds a block of each: the greedy places only the other tables against the cap.
            if blocks + block > self.cap - int(self.reserved.max()):
                self._too_big(f, beside_others=True)
            blocks += block
            out.add(t)
        return frozenset(out)

    def _too_big(self, f: TableFeatures | None, beside_others: bool = False) -> None:
        """One line: ``f`` does not fit the cap (split every way it can be), or not beside the others;
        ``f`` None: the tables placed before planning (``reserved``) exceed the cap on their own."""
        cap = (self.cap or 0) / 2**20
        fixed = self.reserved / 2**20
        total = sum(t.memory() for t in self.tables) / 2**20 + fixed.sum()
        under = f"under the cap of {cap:.3g} MB per rank on {self.world} rank{'s' * (self.world != 1)}"
        explicit = f", {fixed.sum():.3g} MB of them placed by distributed.tables" if fixed.any() else ""
        if f is None:
            r = int(np.argmax(fixed))
            raise ConfigError(
                f"distributed.learned.memory_cap_mb: the tables placed by distributed.tables take "
                f"{fixed[r]:.3g} MB with their optimizer state on rank {r}, over the cap of {cap:.3g} MB "
                "per rank; raise the cap or spread those tables over more ranks"
            )
        if beside_others and total > cap * self.world:
            what = f"all tables ({total:.3g} MB with their optimizer state{explicit}) do not fit {under}"
        else:
            where = "beside the other tables " if beside_others else ""
            what = (
                f"table {f.name!r} ({f.memory() / 2**20:.3g} MB with its optimizer state) does not fit "
                f"{where}{under} (all tables: {total:.3g} MB{explicit})"
            )
        raise ConfigError(f"distributed.learned.memory_cap_mb: {what}; raise the cap or use more ranks")

    def _split_candidates(self, state: tuple[int, ...], top: int = 3) -> list[int]:
        """The ``top`` tables of highest predicted single-shard cost that can split further."""
        cost = {
            t: float(self.models.shard_cost(self._emb_of(t, self.tables[t].dim // k)))
            for t, k in enumerate(state)
        }
        ok = [
            t for t, k in enumerate(state) if t not in self.by_rows and 2 * k in self._splits(self.tables[t])
        ]
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
            raise failed
        return min(plans, key=lambda p: p.cost_ms)

    def _place(self, state: tuple[int, ...], theta: float, by_memory: bool = False) -> Plan:
        """Greedy: shards by predicted cost (or memory), each to the rank it costs least on among those
        under the dim bound ``theta`` x mean (any rank with memory left when none is)."""
        R = self.world
        widths = [
            (t, f.dim // k, k)
            for t, (f, k) in enumerate(zip(self.tables, state, strict=True))
            if t not in self.by_rows
        ]
        if by_memory:
            order = sorted(widths, key=lambda w: -self.tables[w[0]].columns(w[1]).memory())
        else:
            order = sorted(widths, key=lambda w: -float(self.models.shard_cost(self._emb_of(w[0], w[1]))))
        shards = self._row_shards()  # every rank holds a block of each row-split table
        sums, dims, _, mem, _ = self._loads(shards)
        bound = theta * (dims.sum() + sum(w * k for _, w, k in widths)) / R
        holds: list[set[int]] = [set(self.by_rows) for _ in range(R)]
        for t, width, k in order:
            e = self._emb_of(t, width)
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
        return self.score(shards)
