"""What bench/sharding_costs.py (cost data) and bench/sharding.py (planner benchmark) share: random
tasks as NeuroShard generates them, and the two measurements (one rank's fused forward+backward, a
plan's all-to-all over gloo).

A task is 10-60 tables: dims from {4, 8, ..., 128}, rows log-uniform in [1e3, 2e5] (the ceiling keeps a
60-table task within this machine's memory), pooling factors log-uniform in [1, 32], Zipf access with
exponent uniform in [0, 1.4]. Each table comes with one batch of ``BATCH`` examples drawn from it; the
same batch is timed and gives the table's access histogram. Task streams: ``rng(0, i)`` for cost-model
training data, ``rng(1, i)`` for evaluation tasks, so the two sets never share a task.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from recscale.data.access import access_histogram
from recscale.distributed.planner.features import BATCH, TableFeatures, synthetic_table

TRAIN_STREAM, EVAL_STREAM = 0, 1
DIMS = list(range(4, 129, 4))


@dataclass(frozen=True)
class Table:
    features: TableFeatures
    lengths: np.ndarray  # (BATCH,) ids per example
    ids: np.ndarray  # (lengths.sum(),)

    def row_block(self, lo: int, hi: int) -> Table:
        """Rows ``lo`` to ``hi`` of this table as a table of their own (a row-wise shard), with the
        batch's ids that fall in them."""
        example = np.repeat(np.arange(len(self.lengths)), self.lengths)
        keep = (self.ids >= lo) & (self.ids < hi)
        lengths = np.bincount(example[keep], minlength=len(self.lengths))
        f = self.features
        block = TableFeatures(f.name, hi - lo, f.dim, float(lengths.mean()), access_histogram(self.ids[keep]))
        return Table(block, lengths, self.ids[keep] - lo)


def rng(stream: int, i: int) -> np.random.Generator:
    return np.random.default_rng([stream, i])


def random_task(g: np.random.Generator, n_tables: int | None = None) -> list[Table]:
    n = n_tables or int(g.integers(10, 61))
    tables = []
    for t in range(n):
        rows = int(np.exp(g.uniform(np.log(1e3), np.log(2e5))))
        pooling = float(np.exp(g.uniform(0, np.log(32))))
        f, lengths, ids = synthetic_table(f"t{t}", rows, int(g.choice(DIMS)), pooling, g.uniform(0, 1.4), g)
        tables.append(Table(f, lengths, ids))
    return tables


def trimmed_mean_ms(
    run: Callable[[], None],
    clock: Callable[[], float],
    warmup: int = 3,
    reps: int = 9,
    trim: int = 2,
    fastest: bool = False,
) -> float:
    """Mean time of ``run`` in ms by ``clock`` without its ``trim`` fastest and slowest of ``reps`` runs
    (``fastest``: the fastest run instead)."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        t0 = clock()
        run()
        times.append(clock() - t0)
    if fastest:
        return min(times) * 1e3
    return float(np.mean(sorted(times)[trim : reps - trim]) * 1e3)


def shard_ms(shards: list[tuple[Table, int]], warmup: int = 3, reps: int = 9, trim: int = 2) -> float:
    """Fused forward+backward (row-wise Adagrad, fbgemm's TBE: the kernels training runs) of one
    rank's shards, (table, width) each, on one thread. 0 for a rank without shards.

    Timed in the thread's CPU time: on an idle machine the same as wall time, while on this shared
    machine (load 8-10 on 2 cores) wall times of one shard varied 90-170 ms where CPU time stayed at 27."""
    if not shards:
        return 0.0
    torch.set_num_threads(1)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(t.features.rows, w, EmbeddingLocation.HOST, ComputeDevice.CPU) for t, w in shards],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.01,
        pooling_mode=PoolingMode.SUM,
        device=torch.device("cpu"),
    )
    with torch.no_grad():  # real values: uninitialised memory may hold denormals, which are slow
        for w in tbe.split_embedding_weights():
            w.uniform_(-0.01, 0.01)
    indices = torch.from_numpy(np.concatenate([t.ids for t, _ in shards]))
    lengths = torch.from_numpy(np.concatenate([t.lengths for t, _ in shards]))
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    grad = torch.full((BATCH, sum(w for _, w in shards)), 1e-3)

    def step() -> None:
        tbe(indices, offsets).backward(grad)

    return trimmed_mean_ms(step, time.thread_time, warmup, reps, trim)


def collective_ms(run: Callable[[], None], reps: int = 5) -> float:
    """Wall time (ms) of the collective(s) ``run``, each run after a barrier: the fastest of ``reps``
    after a warm-up, as the slowest rank saw it."""

    def synced() -> None:
        dist.barrier()
        run()

    t = torch.tensor([trimmed_mean_ms(synced, time.perf_counter, warmup=1, reps=reps, trim=0, fastest=True)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _a2a_pair(fwd_in: torch.Tensor, fwd_out: torch.Tensor, sends: list[int], receives: list[int]) -> None:
    dist.all_to_all_single(fwd_out, fwd_in, receives, sends)
    dist.all_to_all_single(fwd_in, fwd_out, sends, receives)


def _comm_worker(rank: int, world: int, store: str, dim_sums: list[list[int]], passes: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    b = BATCH // world
    times = np.zeros((passes, len(dim_sums)))
    for p in range(passes):  # every vector once per pass: drift of the shared machine hits all alike
        for i, dims in enumerate(dim_sums):
            fwd_in = torch.ones(world * b * dims[rank])  # this rank's pooled outputs, b examples per rank
            fwd_out = torch.empty(b * sum(dims))
            sends, receives = [b * dims[rank]] * world, [b * d for d in dims]
            # forward: outputs to their examples' ranks; backward: their gradients back
            times[p, i] = collective_ms(partial(_a2a_pair, fwd_in, fwd_out, sends, receives))
    if rank == 0:
        np.save(out, np.median(times, axis=0))
    dist.destroy_process_group()


def all_to_all_ms(dim_sums: list[list[int]], passes: int = 3) -> list[float]:
    """Forward+backward pooled-embedding all-to-all time (ms) over gloo for each list of per-rank
    output dims, ``len(dims)`` local processes, ``BATCH`` examples split evenly over them: the fastest
    of 5 (after a warm-up), the median of that over ``passes`` interleaved passes. Wall time: it waits
    on the other ranks; the fastest run is the one least disturbed by the machine's other load (4
    processes share 2 cores with the other engineers' jobs here)."""
    world = len(dim_sums[0])
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "times.npy")
        mp.start_processes(
            _comm_worker, (world, store, dim_sums, passes, out), nprocs=world, start_method="spawn"
        )
        return [float(x) for x in np.load(out)]
