"""Would replicated (data_parallel) or row-wise tables lower the benchmark's measured plan cost? (docs/SHARDING.md)

    PYTHONPATH=src .venv/bin/python bench/sharding_replicas.py --tasks 20

bench/sharding.py's planners place table_wise and column_wise shards only. A replicated table sends no
pooled outputs through the all-to-all but all-reduces its whole gradient every step; a row-wise table
splits its lookups over the ranks but reduce-scatters a full (batch, dim) partial output from every
shard. This times, over gloo with ``--world`` local processes (one thread each, the benchmark's setting),
what each trades:

- the forward+backward pooled all-to-all per output dim (``BATCH`` examples, even dim sums, timed as
  bench/sharding.py times a plan's), i.e. what a table of dim d costs the all-to-all as a table_wise or
  column_wise shard, d x that;
- the all-reduce of one table's fp32 gradient, rows x 64 (what replicating it adds; DDP's buckets
  would merge small tables, so the MB/s of the largest one is the cheapest a replica can be);
- the reduce-scatter of a 64-dim table's partial pooled outputs (what a row-wise table adds, in place of
  its all-to-all share).

Then it counts what TorchRec's planner does with the dense kernel allowed (its CPU defaults): how many
of the first ``--tasks`` evaluation tasks' tables it replicates, and their share of the summed dims.
Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sharding_common import EVAL_STREAM, all_to_all_ms, collective_ms, random_task, rng

from recscale.distributed.planner.baselines import torchrec_plan
from recscale.distributed.planner.features import BATCH

DIM_SUMS = (256, 1024, 2048)  # per rank
ROWS = (1000, 4096, 16384, 65536)  # replicated 64-dim tables


def _worker(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    rows = []
    for n in ROWS:
        g = torch.ones(n * 64)
        ms = collective_ms(lambda g=g: dist.all_reduce(g))
        rows.append({"all_reduce_ms": round(ms, 2), "rows": n, "dim": 64, "mb": round(n * 64 * 4 / 1e6, 2)})
    full, part = torch.ones(BATCH * 64), torch.empty(BATCH // world * 64)
    ms = collective_ms(lambda: dist.reduce_scatter_tensor(part, full))
    rows.append({"reduce_scatter_ms": round(ms, 2), "batch": BATCH, "dim": 64})
    if rank == 0:
        for r in rows:
            print(json.dumps({"world": world, **r}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--tasks", type=int, default=20, help="evaluation tasks planned by TorchRec's planner")
    args = p.parse_args()
    # The benchmark's own all-to-all timing, for even per-rank dim sums.
    for d, ms in zip(DIM_SUMS, all_to_all_ms([[d] * args.world for d in DIM_SUMS]), strict=True):
        print(json.dumps({"world": args.world, "all_to_all_fwd_bwd_ms": round(ms, 2), "dims_in_all": args.world * d,
                          "us_per_dim": round(ms * 1e3 / (args.world * d), 2)}), flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker, (args.world, os.path.join(tmp, "store")), nprocs=args.world, start_method="spawn"
        )
    logging.getLogger().setLevel(logging.ERROR)  # its "Sharding spec not found" for every replica
    replicated, tables, dims, dp_dims = [], 0, 0, 0
    for i in range(args.tasks):
        task = [t.features for t in random_task(rng(EVAL_STREAM, i))]
        plan = torchrec_plan(task, args.world, args.world, fused_only=False)
        dp = [int(n[1:]) for n, ps in plan.items() if ps.sharding_type == "data_parallel"]
        replicated += [task[t].rows for t in dp]
        tables += len(task)
        dims += sum(f.dim for f in task)
        dp_dims += sum(task[t].dim for t in dp)
    print(json.dumps({"torchrec_dense_allowed": {
        "tasks": args.tasks, "tables": tables, "replicated": len(replicated),
        "replicated_dim_share": round(dp_dims / dims, 4), "replicated_rows_max": max(replicated, default=0)}}))  # fmt: skip


if __name__ == "__main__":
    main()
