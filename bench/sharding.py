"""Sharding planners scored by measurement (docs/SHARDING.md).

    PYTHONPATH=src .venv/bin/python bench/sharding.py --tasks 40 --out docs/sharding

Evaluation tasks come from their own seed stream (``sharding_common.EVAL_STREAM``), never from the cost
models' training tasks. Each planner places every task's tables on ``--world`` ranks; each plan is
scored by measurement: every rank's shards timed alone (fused forward+backward, one thread, CPU time,
mean of the middle 3 of 5 after 2 warm-ups, the batch drawn with the task), the slowest rank's time
plus the plan's forward+backward all-to-all timed over gloo for its per-rank dim sums. Writes OUT/eval.csv (one row per task and planner) and OUT/eval.md (median
and 90th percentile of each planner's cost relative to TorchRec's, planning time). ``--plan-only TABLES`` times planning alone on tasks of TABLES tables.
"""

from __future__ import annotations

import argparse
import csv
import io
import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from sharding_common import EVAL_STREAM, Table, all_to_all_ms, random_task, rng, shard_ms
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recscale.distributed.planner.cost_model import SHIPPED, CostModels, mape
from recscale.distributed.planner.features import BATCH
from recscale.distributed.planner.search import LearnedPlanner
from recscale.io import atomic_write_text

# A plan: (table, width, rank) per shard.
Placement = list[tuple[int, int, int]]


def torchrec_plan(task: list[Table], world: int) -> Placement:
    """TorchRec's planner, default settings on CPU, told each table's pooling factor and the batch size,
    restricted to the fused kernel (as ``distributed.sharding: planner`` runs it)."""
    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=t.features.dim, num_embeddings=t.features.rows,
                                  feature_names=[f"f{i}"]) for i, t in enumerate(task)]  # fmt: skip
    constraints = {
        f"t{i}": ParameterConstraints(compute_kernels=["fused"], pooling_factors=[t.features.pooling])
        for i, t in enumerate(task)
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"), batch_size=BATCH, constraints=constraints
    )
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    plan = planner.plan(ebc, [EmbeddingBagCollectionSharder()])  # type: ignore[list-item]
    out = []
    for name, ps in plan.plan[""].items():  # type: ignore[union-attr]
        assert ps.sharding_spec is not None, (name, ps.sharding_type)
        out += [(int(name[1:]), m.shard_sizes[1], m.placement.rank()) for m in ps.sharding_spec.shards]  # type: ignore[union-attr]
    return out


def greedy(key: Callable[[Table], float]) -> Callable[[list[Table], int], Placement]:
    """Tables by ``key``, largest first, each on the rank with the smallest sum of ``key`` so far."""

    def plan(task: list[Table], world: int) -> Placement:
        load = [0.0] * world
        out = []
        for i in sorted(range(len(task)), key=lambda i: -key(task[i])):
            r = int(np.argmin(load))
            load[r] += key(task[i])
            out.append((i, task[i].features.dim, r))
        return out

    return plan


def random_plan(task: list[Table], world: int) -> Placement:
    g = np.random.default_rng(len(task))
    return [(i, t.features.dim, int(g.integers(world))) for i, t in enumerate(task)]


class Learned:
    def __init__(self) -> None:
        self.models = CostModels.load(SHIPPED)
        self.predicted = 0.0

    def __call__(self, task: list[Table], world: int) -> Placement:
        plan = LearnedPlanner(self.models, world).plan([t.features for t in task])
        self.predicted = plan.cost_ms
        return [(s.table, s.width, s.rank) for s in plan.shards]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", type=int, default=100, help="evaluation tasks (NeuroShard: 100)")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--out", default="docs/sharding")
    p.add_argument(
        "--plan-only", type=int, metavar="TABLES", help="only time planning, tasks of this many tables"
    )
    a = p.parse_args()
    logging.getLogger("torchrec").setLevel(logging.ERROR)  # its planner warns on every data_parallel option
    learned = Learned()
    planners: dict[str, Callable[[list[Table], int], Placement]] = {
        "torchrec": torchrec_plan,
        "random": random_plan,
        "size_greedy": greedy(lambda t: t.features.memory()),
        "dim_greedy": greedy(lambda t: t.features.dim),
        "lookup_greedy": greedy(lambda t: t.features.dim * t.features.pooling),
        "learned": learned,
    }
    if a.plan_only:
        plan_times(planners, a)
        return
    rows, dims = [], []
    for i in range(a.tasks):
        task = random_task(rng(EVAL_STREAM, i))
        for name, planner in planners.items():
            start = time.perf_counter()
            placement = planner(task, a.world)
            seconds = time.perf_counter() - start
            per_rank = [[(task[t], w) for t, w, r in placement if r == rank] for rank in range(a.world)]
            compute = [shard_ms(s, warmup=2, reps=5, trim=1) for s in per_rank]
            dims.append([sum(w for _, w in s) for s in per_rank])
            predicted = learned.predicted if name == "learned" else float("nan")
            rows.append([i, len(task), name, max(compute), seconds, predicted])
            print(
                f"task {i} ({len(task)} tables) {name}: max rank {max(compute):.1f} ms, planned in {seconds:.2f} s",
                flush=True,
            )
    comm = all_to_all_ms(dims)
    header = ["task", "tables", "planner", "cost_ms", "compute_ms", "comm_ms", "plan_s", "predicted_ms"]
    table = [[i, n, name, round(c + m, 3), round(c, 3), round(m, 3), round(s, 4), round(pr, 3)]
             for (i, n, name, c, s, pr), m in zip(rows, comm, strict=True)]  # fmt: skip
    buf = io.StringIO()
    csv.writer(buf).writerows([header, *table])
    atomic_write_text(f"{a.out}/eval.csv", buf.getvalue())
    atomic_write_text(f"{a.out}/eval.md", summary(table, list(planners), a))
    print(summary(table, list(planners), a))


def plan_times(planners: dict[str, Callable[[list[Table], int], Placement]], a: argparse.Namespace) -> None:
    """Planning time alone, for ``a.tasks`` evaluation tasks of ``a.plan_only`` tables."""
    times: dict[str, list[float]] = {name: [] for name in planners}
    for i in range(a.tasks):
        task = random_task(rng(EVAL_STREAM, i), a.plan_only)
        for name, planner in planners.items():
            start = time.perf_counter()
            planner(task, a.world)
            times[name].append(time.perf_counter() - start)
    for name, t in times.items():
        print(
            f"{name}: median {np.median(t):.3f} s, max {max(t):.3f} s over {a.tasks} tasks of {a.plan_only} tables"
        )


def summary(table: list[list], planners: list[str], a: argparse.Namespace) -> str:
    cost = {(r[0], r[2]): r[3] for r in table}
    tasks = sorted({r[0] for r in table})
    lines = [f"{len(tasks)} evaluation tasks, {a.world} ranks, batch {BATCH}; cost = slowest rank's measured "
             "fused forward+backward + measured all-to-all (forward+backward)", "",
             "| planner | median cost / TorchRec | p90 cost / TorchRec | median cost (ms) | median planning time (s) | max planning time (s) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name in planners:
        ratio = np.array([cost[t, name] / cost[t, "torchrec"] for t in tasks])
        costs = np.array([cost[t, name] for t in tasks])
        plan_s = np.array([r[6] for r in table if r[2] == name])
        lines.append(f"| {name} | {np.median(ratio):.3f} | {np.percentile(ratio, 90):.3f} | {np.median(costs):.1f} | "
                     f"{np.median(plan_s):.3f} | {plan_s.max():.3f} |")  # fmt: skip
    learned = [r for r in table if r[2] == "learned"]
    err = mape(np.array([r[7] for r in learned]), np.array([r[3] for r in learned]))
    lines += [
        "",
        f"Learned planner: its predicted cost against the measured one on these plans, MAPE {err:.1f}%",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
