"""Retrieval at catalogue scale: the seen-item Bloom filter's cost in a search, and the IVF build's memory.

    OMP_NUM_THREADS=1 python bench/retrieval_scale.py seen --items 1000000 --queries 32 --seen 200
    OMP_NUM_THREADS=1 python bench/retrieval_scale.py ivf-build --items 1000000 --nlist 1024 --iters 2
    OMP_NUM_THREADS=1 python bench/retrieval_scale.py ivf-search --items 1000000 --nlist 1024 --nprobe 64 \\
        --queries 8 --index int8

Items and queries: ``latent_data`` (clustered unit vectors, d = 64). ``seen``: each query user has
``--seen`` seen items drawn as its positives are (softmax of its scores, so mostly items it scores high,
as a trained model's seen items are), added to a Bloom filter at a 1% false-positive rate; reported:
the median ms of one call for the whole batch of ``--queries`` (top ``--k``) without the filter and with
it, over ``--reps`` calls after a warm-up, and the filtered ids' recall of a no-filter search that drops
the seen items by hand (a sanity check: below 1 only by Bloom false positives). ``ivf-build``:
seconds and the peak rise of resident memory (VmHWM, reset before the build) of ``IVFIndex(items, nlist,
nprobe=1, iters)`` (k-means plus the final assignment). ``ivf-search``: ms and the peak rise of one search of
``--queries`` queries (after a warm-up call). One process per measurement, so each peak is its own.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from recscale.retrieval.bloom import BloomFilter
from recscale.retrieval.index import ExactIndex, Int8Index, IVFIndex, recall
from recscale.retrieval.synthetic import latent_data


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def seen(args: argparse.Namespace) -> None:
    data = latent_data(n_users=args.queries, n_items=args.items, dim=64, per_user=args.seen)
    users = torch.arange(args.queries)
    bloom = BloomFilter.sized(capacity=len(data.pairs), fp_rate=0.01)
    bloom.add(data.pairs[:, 0], data.pairs[:, 1])
    index = ExactIndex(data.items) if args.index == "exact" else Int8Index(data.items)

    def median_ms(filtered: bool) -> float:
        times = []
        for _ in range(args.reps + 1):
            t = time.perf_counter()
            index(data.users, args.k, users=users if filtered else None, seen=bloom if filtered else None)
            times.append(time.perf_counter() - t)
        return 1000 * statistics.median(times[1:])

    plain, filtered = median_ms(False), median_ms(True)
    # The same search with the seen items dropped by hand: the top (k + seen) per row, the seen ones removed.
    _, wide = index(data.users, args.k + args.seen)
    mine = set(map(tuple, data.pairs.tolist()))
    want = [[i for i in row if (u, i) not in mine][: args.k] for u, row in enumerate(wide.tolist())]
    got = index(data.users, args.k, users=users, seen=bloom)[1]
    print(
        f"{args.index} index, {args.items:,} items, {args.queries} queries, k={args.k}, {args.seen} seen each: "
        f"{plain:.0f} ms without the filter, {filtered:.0f} ms with it; recall of a hand-filtered search: "
        f"{recall(got, torch.tensor(want)):.4f}",
        flush=True,
    )


def ivf_build(args: argparse.Namespace) -> None:
    items = latent_data(n_users=1, n_items=args.items, dim=64, per_user=1).items
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    except OSError:
        print("(could not reset VmHWM: the peak below includes the data's generation)")
    base = _rss_kib("VmRSS")
    t = time.perf_counter()
    IVFIndex(items, nlist=args.nlist, nprobe=1, iters=args.iters)
    took = time.perf_counter() - t
    print(
        f"IVF build, {args.items:,} items, nlist={args.nlist}, iters={args.iters}: {took:.1f} s, peak RSS "
        f"+{(_rss_kib('VmHWM') - base) / 2**20:.2f} GiB",
        flush=True,
    )


def ivf_search(args: argparse.Namespace) -> None:
    data = latent_data(n_users=args.queries, n_items=args.items, dim=64, per_user=1)
    index = IVFIndex(
        data.items, nlist=args.nlist, nprobe=args.nprobe, int8=args.index == "int8", iters=args.iters
    )
    index(data.users, args.k)  # a warm-up: the first call's allocations are not the search's
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    base = _rss_kib("VmRSS")
    t = time.perf_counter()
    index(data.users, args.k)
    took = time.perf_counter() - t
    print(
        f"IVF{'-int8' if args.index == 'int8' else ''} search, {args.items:,} items, nlist={args.nlist}, "
        f"nprobe={args.nprobe}, {args.queries} queries, k={args.k}: {1000 * took:.0f} ms, peak RSS "
        f"+{(_rss_kib('VmHWM') - base) / 2**20:.3f} GiB",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["seen", "ivf-build", "ivf-search"])
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--queries", type=int, default=64)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--seen", type=int, default=200, help="seen items per query user")
    p.add_argument("--index", choices=["exact", "int8"], default="exact")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--nlist", type=int, default=1024)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--nprobe", type=int, default=64, help="ivf-search: lists probed per query")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    {"seen": seen, "ivf-build": ivf_build, "ivf-search": ivf_search}[args.what](args)


if __name__ == "__main__":
    main()
