"""Model-based retrieval: recall@K of the int8 and IVF item indexes against exact fp32 search, latency
per query and index memory, on synthetic latent factors (100k items) and a two-tower model trained on
MovieLens-100k.

    python bench/retrieval.py --movielens ../shared/data/movielens-100k --out docs/serving_retrieval

Synthetic: ``latent_data`` items (clustered unit vectors, d = 64) are the index rows and its users the
queries. MovieLens: a two-tower model (user tower: user_id, age, gender, occupation; item tower:
item_id, release_year, genres) trained by ``recscale.retrieval.two_tower.fit`` on the train split's
positives (rating >= 4); its item-tower outputs for all items are the index, its user-tower outputs for
the users of valid positives the queries. Also reported there: the model's own recall of the valid
positives, with the train positives dropped by the Bloom filter layer and without it.

Latency: ``--batch`` queries per call, the median over ``--reps`` calls divided by the batch (ms per
query), after one warm-up call. Writes OUT.md and OUT.csv.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from report_files import write_report

from recscale.data.readers import read_batches
from recscale.data.schema import Schema, SparseFeature
from recscale.retrieval.bloom import BloomFilter
from recscale.retrieval.index import ExactIndex, Int8Index, ItemIndex, IVFIndex
from recscale.retrieval.synthetic import latent_data
from recscale.retrieval.two_tower import Tower, TwoTower, embed, fit

USER, ITEM = ["user_id", "age", "gender", "occupation"], ["item_id", "release_year", "class"]


def recall(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return (
        sum(len(set(a.tolist()) & set(e.tolist())) for a, e in zip(approx, exact, strict=True))
        / exact.numel()
    )


def latency_ms(
    index: ItemIndex,
    queries: torch.Tensor,
    k: int,
    args: argparse.Namespace,
    users: torch.Tensor | None = None,
    seen: BloomFilter | None = None,
) -> float:
    """Median ms per query of ``index`` on consecutive batches of ``args.batch`` queries (one warm-up)."""
    times = []
    for r in range(args.reps + 1):
        start = (r * args.batch) % (queries.shape[0] - args.batch + 1)
        part = slice(start, start + args.batch)
        t = time.perf_counter()
        index(queries[part], k, users=None if users is None else users[part], seen=seen)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[1:]) / args.batch


def compare(
    name: str,
    items: torch.Tensor,
    queries: torch.Tensor,
    nlist: int,
    nprobes: list[int],
    args: argparse.Namespace,
) -> list[dict]:
    exact = ExactIndex(items)
    want = {k: exact(queries, k)[1] for k in (10, 100)}
    variants: list[tuple[str, ItemIndex, float]] = [("exact fp32", exact, 0.0)]
    for label, make in [("int8", lambda: Int8Index(items))] + [
        (
            f"IVF{'-int8' if q else ''} nlist={nlist} nprobe={p}",
            lambda p=p, q=q: IVFIndex(items, nlist, p, int8=q),
        )
        for q in (False, True)
        for p in nprobes
    ]:
        t = time.perf_counter()
        index = make()
        variants.append((label, index, time.perf_counter() - t))
    rows = []
    for label, index, build_s in variants:
        rows.append(
            {
                "data": name,
                "index": label,
                "recall@10": round(recall(index(queries, 10)[1], want[10]), 4),
                "recall@100": round(recall(index(queries, 100)[1], want[100]), 4),
                "ms/query": round(latency_ms(index, queries, 100, args), 4),
                "index bytes": index.index_bytes(),
                "x smaller": round(exact.index_bytes() / index.index_bytes(), 2),
                "build s": round(build_s, 2),
            }
        )
        print(rows[-1], flush=True)
    return rows


def movielens_tables(path: Path) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, torch.Tensor]]:
    """Per-user and per-item id tables (1-based, 0 = padding) and the (user, item) positive pairs of each
    split, from recscale's MovieLens reader."""
    schema = Schema(label="rating", sparse=[SparseFeature(name=n, multi=n == "class") for n in USER + ITEM])
    splits = {
        s: pa.Table.from_batches(list(read_batches(path, "movielens", schema, {"split": s})))
        for s in ("all", "train", "valid")
    }
    every = splits["all"]

    def table(cols: list[str]) -> tuple[list[torch.Tensor], dict[str, int]]:
        keys, first = np.unique(
            every.column(cols[0]).to_numpy(zero_copy_only=False).astype(str), return_index=True
        )
        out = []
        for c in cols:
            values = every.column(c).to_pylist()
            lists = [v if isinstance(v, list) else [v] for v in (values[i] for i in first)]
            vocab = {
                x: j + 1
                for j, x in enumerate(sorted({str(x) for lst in lists for x in lst if x is not None}))
            }
            width = max(len(lst) for lst in lists)
            ids = torch.zeros(len(keys), width, dtype=torch.long)
            for r, lst in enumerate(lists):
                ids[r, : len(lst)] = torch.tensor([vocab[str(x)] for x in lst if x is not None] or [0])[
                    :width
                ]
            out.append(ids)
        return out, {k: j for j, k in enumerate(keys)}

    users, user_row = table(USER)
    items, item_row = table(ITEM)
    pairs = {}
    for s in ("train", "valid"):
        pos = splits[s].filter(pa.compute.equal(splits[s].column("label"), 1.0))
        u = [user_row[str(x)] for x in pos.column("user_id").to_pylist()]
        i = [item_row[str(x)] for x in pos.column("item_id").to_pylist()]
        pairs[s] = torch.tensor([u, i]).T
    return users, items, pairs


def movielens(path: Path, args: argparse.Namespace) -> list[dict]:
    users, items, pairs = movielens_tables(path)
    torch.manual_seed(0)
    user_tower = Tower([int(t.max()) + 1 for t in users], 16, [64], 32)
    item_tower = Tower([int(t.max()) + 1 for t in items], 16, [64], 32)
    model = TwoTower(user_tower, item_tower, temperature=0.05)
    t = time.perf_counter()
    losses = fit(model, users, items, pairs["train"], epochs=args.epochs, batch_size=256, lr=0.003)
    print(
        f"movielens two-tower: {len(pairs['train'])} train positives, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"{time.perf_counter() - t:.1f} s",
        flush=True,
    )
    item_vecs = embed(item_tower, items)
    valid_users = pairs["valid"][:, 0].unique()
    queries = embed(user_tower, [t[valid_users] for t in users])
    rows = compare("movielens two-tower", item_vecs, queries, nlist=32, nprobes=[4], args=args)
    # The model's own recall of the valid positives, without and with the seen-item (train positive) filter.
    seen = BloomFilter.sized(capacity=len(pairs["train"]), fp_rate=0.01)
    seen.add(pairs["train"][:, 0], pairs["train"][:, 1])
    truth = {int(u): set() for u in valid_users}
    for u, i in pairs["valid"].tolist():
        truth[u].add(i)
    exact = ExactIndex(item_vecs)
    for label, kw in [
        ("no filter", {}),
        ("Bloom filter of train positives", {"users": valid_users, "seen": seen}),
    ]:
        row = {
            "data": "movielens two-tower",
            "index": f"exact fp32, share of valid positives found ({label})",
        }
        for k in (10, 100):
            ids = exact(queries, k, **kw)[1]
            hit = sum(len(set(r.tolist()) & truth[int(u)]) for r, u in zip(ids, valid_users, strict=True))
            row[f"recall@{k}"] = round(hit / len(pairs["valid"]), 4)
        print(row, flush=True)
        rows.append(row)
    ms = latency_ms(exact, queries, 100, args, users=valid_users, seen=seen)
    rows.append(
        {
            "data": "movielens two-tower",
            "index": "exact fp32 + Bloom filter",
            "ms/query": round(ms, 4),
            "index bytes": exact.index_bytes() + seen.index_bytes(),
        }
    )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--movielens", type=Path)
    p.add_argument("--items", type=int, default=100_000)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--out", type=Path, help="write OUT.md and OUT.csv")
    args = p.parse_args()
    data = latent_data(n_users=args.queries, n_items=args.items, dim=64, per_user=1)
    rows = compare(
        f"synthetic {args.items:,} items", data.items, data.users, nlist=1024, nprobes=[8, 32], args=args
    )
    if args.movielens:
        rows += movielens(args.movielens, args)
    if args.out:
        cols = list(rows[0])
        text = "| " + " | ".join(cols) + " |\n| " + " | ".join("---" for _ in cols) + " |\n"
        text += "\n".join(
            "| "
            + " | ".join(f"{r[c]:,}" if isinstance(r.get(c), int) else str(r.get(c, "")) for c in cols)
            + " |"
            for r in rows
        )
        write_report(args.out, text, [{c: r.get(c, "") for c in cols} for r in rows])


if __name__ == "__main__":
    main()
