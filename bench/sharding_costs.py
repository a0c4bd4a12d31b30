"""Collect the cost data the learned sharding planner trains on (docs/SHARDING.md).

    PYTHONPATH=src .venv/bin/python bench/sharding_costs.py --compute 400 --comm 160 --out docs/sharding
    PYTHONPATH=src .venv/bin/python bench/sharding_costs.py --compute 0 --comm 0 --plan-tasks 200 --out docs/sharding
    PYTHONPATH=src .venv/bin/python bench/sharding_costs.py --compute 0 --comm 0 --splits 24 --out docs/sharding

compute.csv: random multi-table shards (1-30 tables of random training tasks, some split column-wise)
and their fused forward+backward time (ms of the thread's CPU time, one thread, trimmed mean of 9
after 3 warm-ups), one row per
shard with its tables' features as JSON. compute_plans.csv, the same columns: the rank shards of
plan-like placements (every table of a training task over ``--world`` ranks, near-balanced), the shards
a planner scores; compute.csv's random shards hold fewer, smaller-pooled tables than those. splits.csv:
single tables timed whole, as a column half and as each row half (table_row_wise on a host of 2). comm.csv (wall time: it waits on the other ranks): per-rank output dim sums (random totals of the
training tasks, split with random skew) and their forward+backward all-to-all time over gloo.
On a machine with CUDA the same script would need fbgemm's CUDA TBE; it times the CPU kernels only.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from sharding_common import TRAIN_STREAM, Table, all_to_all_ms, random_task, rng, shard_ms

from recscale.io import atomic_write_text

SHARDS_PER_TASK = 8
# Task ids of compute_plans.csv: after compute.csv's, so the two never share a task.
PLAN_TASKS_FROM = 5000


def split_width(g: np.random.Generator, dim: int) -> tuple[int, int]:
    """A random column split of a table of ``dim`` columns: (shards, width); a split must leave equal
    multiples of 4 columns."""
    k = int(g.choice([1, 2, 4], p=[0.6, 0.25, 0.15]))
    return (k, dim // k) if dim % (4 * k) == 0 else (1, dim)


def timed_row(task_id: int, shard: list[tuple[Table, int]]) -> list:
    ms = shard_ms(shard)
    feats = [[t.features.rows, w, round(t.features.pooling, 4), *(round(h, 5) for h in t.features.hist)]
             for t, w in shard]  # fmt: skip
    return [task_id, round(ms, 4), json.dumps(feats)]


def compute_rows(n: int) -> Iterator[list]:
    done, task_id = 0, 0
    while done < n:
        g = rng(TRAIN_STREAM, task_id)
        task = random_task(g)
        for _ in range(min(SHARDS_PER_TASK, n - done)):
            size = int(g.integers(1, min(30, len(task)) + 1))
            picked = g.choice(len(task), size, replace=False)
            row = timed_row(task_id, [(task[t], split_width(g, task[t].features.dim)[1]) for t in picked])
            done += 1
            print(f"compute {done}/{n}: {size} tables {row[1]:.2f} ms", flush=True)
            yield row
        task_id += 1


def plan_rows(n_tasks: int, world: int) -> Iterator[list]:
    """Every rank shard of a random near-balanced placement of each of ``n_tasks`` training tasks:
    tables (column shards on distinct ranks) drawn to ranks with Dirichlet(4) weights."""
    for i in range(n_tasks):
        task_id = PLAN_TASKS_FROM + i
        g = rng(TRAIN_STREAM, task_id)
        task = random_task(g)
        weights = g.dirichlet(np.full(world, 4.0))
        ranks: list[list[tuple[Table, int]]] = [[] for _ in range(world)]
        for t in task:
            k, width = split_width(g, t.features.dim)
            for r in g.choice(world, min(k, world), replace=False, p=weights):
                ranks[r].append((t, width))
        for shard in ranks:
            if shard:
                row = timed_row(task_id, shard)
                print(f"plan task {i + 1}/{n_tasks}: {len(shard)} tables {row[1]:.2f} ms", flush=True)
                yield row


def split_rows(n: int) -> Iterator[list]:
    """Tables of training tasks timed whole, as one of 2 column halves, and as each of 2 row halves
    (table_row_wise over a host's 2 ranks): which split divides a table's compute better."""
    g = rng(TRAIN_STREAM, 20_000)
    task = random_task(g, n)
    for t in task:
        f, half = t.features, (t.features.rows + 1) // 2
        column = shard_ms([(t, f.dim // 2)]) if f.dim % 8 == 0 else float("nan")
        rows = [shard_ms([(t.row_block(lo, hi), f.dim)]) for lo, hi in ((0, half), (half, f.rows))]
        row = [f.rows, f.dim, round(f.pooling, 3), round(shard_ms([(t, f.dim)]), 4), round(column, 4)]
        print(f"split: {row}, row halves {rows}", flush=True)
        yield row + [round(max(rows), 4), round(min(rows), 4)]


def comm_rows(n: int, world: int) -> list[list]:
    dims = []
    for i in range(n):
        g = rng(TRAIN_STREAM, 10_000 + i)
        total = int(g.integers(10, 61)) * 66  # a task's tables at the mean dim
        share = g.dirichlet(np.full(world, float(np.exp(g.uniform(np.log(0.3), np.log(30))))))
        dims.append([int(4 * round(total * s / 4)) for s in share])
    times = all_to_all_ms(dims)
    return [[world, " ".join(map(str, d)), round(t, 4)] for d, t in zip(dims, times, strict=True)]


def write_csv(path: Path, header: list[str], rows: list[list]) -> None:
    buf = io.StringIO()
    csv.writer(buf).writerows([header, *rows])
    atomic_write_text(path, buf.getvalue())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compute", type=int, default=400, help="shards to time")
    p.add_argument("--comm", type=int, default=160, help="dim-sum vectors to time")
    p.add_argument(
        "--plan-tasks", type=int, default=0, help="training tasks whose plan-like rank shards to time"
    )
    p.add_argument("--splits", type=int, default=0, help="tables to time whole, column-split and row-split")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path("docs/sharding"))
    a = p.parse_args()
    if a.splits:
        header = [
            "rows",
            "dim",
            "pooling",
            "whole_ms",
            "column_half_ms",
            "row_half_max_ms",
            "row_half_min_ms",
        ]
        write_csv(a.out / "splits.csv", header, list(split_rows(a.splits)))
    if a.comm:
        write_csv(a.out / "comm.csv", ["world", "dims", "ms"], comm_rows(a.comm, a.world))
    for name, source in (
        ("compute.csv", compute_rows(a.compute)),
        ("compute_plans.csv", plan_rows(a.plan_tasks, a.world)),
    ):
        rows: list[list] = []
        for row in source:  # written every 40 rows: an interrupted run keeps its data
            rows.append(row)
            if len(rows) % 40 == 0:
                write_csv(a.out / name, ["task", "ms", "tables"], rows)
        if rows:
            write_csv(a.out / name, ["task", "ms", "tables"], rows)


if __name__ == "__main__":
    main()
