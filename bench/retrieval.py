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
from collections.abc import Callable
from pathlib import Path

import torch
from report_files import write_report

from recscale.retrieval.index import ExactIndex, Int8Index, ItemIndex, recall
from recscale.retrieval.movielens import read_movielens
from recscale.retrieval.pipeline import IndexKind, RetrieveRank, make_index
from recscale.retrieval.recipe import fit_ranker_on, fit_towers, seen_filter
from recscale.retrieval.synthetic import latent_data
from recscale.retrieval.two_tower import embed


def latency_ms(run: Callable[[slice], object], n: int, batch: int, reps: int) -> float:
    """Median ms per query of ``run(batch of query rows)`` over consecutive batches of ``batch`` of the ``n``
    queries, after one warm-up call."""
    times = []
    for r in range(reps + 1):
        start = (r * batch) % (n - batch + 1)
        t = time.perf_counter()
        run(slice(start, start + batch))
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[1:]) / batch


def compare(
    name: str,
    items: torch.Tensor,
    queries: torch.Tensor,
    nlist: int,
    nprobes: list[int],
    args: argparse.Namespace,
) -> list[dict]:
    exact, n = ExactIndex(items), queries.shape[0]
    want = {k: exact(queries, k)[1] for k in (10, 100)}
    variants: list[tuple[str, ItemIndex, float]] = [("exact fp32", exact, 0.0)]
    kinds: list[tuple[IndexKind, int]] = [("int8", 1)] + [
        (q, p) for q in ("ivf", "ivf-int8") for p in nprobes
    ]
    for kind, nprobe in kinds:
        t = time.perf_counter()
        index = make_index(kind, items, nlist, nprobe)
        label = kind if kind == "int8" else f"IVF{kind[3:]} nlist={nlist} nprobe={nprobe}"
        variants.append((label, index, time.perf_counter() - t))
    rows = []
    for label, index, build_s in variants:
        rows.append(
            {
                "data": name,
                "index": label,
                "recall@10": round(recall(index(queries, 10)[1], want[10]), 4),
                "recall@100": round(recall(index(queries, 100)[1], want[100]), 4),
                **{
                    f"ms/query (batch {b})": round(
                        latency_ms(lambda q, index=index: index(queries[q], 100), n, b, args.reps), 4
                    )
                    for b in (args.batch, 1)
                },
                "index bytes": index.index_bytes(),
                "x smaller": round(exact.index_bytes() / index.index_bytes(), 2),
                "build s": round(build_s, 2),
            }
        )
        print(rows[-1], flush=True)
    return rows


def movielens(path: Path, args: argparse.Namespace) -> list[dict]:
    data = read_movielens(path)
    users, items, pairs = data.users, data.items, {s: data.positives(s) for s in ("train", "valid")}
    t = time.perf_counter()
    towers = fit_towers(data, args.epochs)
    user_tower, item_tower, losses = towers.user, towers.item, towers.losses
    print(f"two-tower: {len(pairs['train'])} train positives, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
          f"{time.perf_counter() - t:.1f} s", flush=True)  # fmt: skip
    item_vecs = embed(item_tower, items)
    valid_users = pairs["valid"][:, 0].unique()
    queries = embed(user_tower, [t[valid_users] for t in users])
    rows = compare("movielens two-tower", item_vecs, queries, nlist=32, nprobes=[4], args=args)

    # What each way finds: the share of the valid positives in the top-K of each valid user.
    truth: dict[int, set[int]] = {int(u): set() for u in valid_users}
    for u, i in pairs["valid"].tolist():
        truth[u].add(i)

    def found(label: str, top: dict[int, torch.Tensor], **extra: object) -> None:
        row: dict[str, object] = {"data": "movielens valid positives found", "index": label}
        for k, ids in top.items():
            hit = sum(len(set(r.tolist()) & truth[int(u)]) for r, u in zip(ids, valid_users, strict=True))
            row[f"recall@{k}"] = round(hit / len(pairs["valid"]), 4)
        rows.append({**row, **extra})
        print(rows[-1], flush=True)

    popular = torch.bincount(pairs["train"][:, 1], minlength=item_vecs.shape[0]).argsort(descending=True)
    found("most popular train items", {k: popular[:k].expand(len(valid_users), k) for k in (10, 100)})
    exact = ExactIndex(item_vecs)
    found("two-tower, exact fp32", {k: exact(queries, k)[1] for k in (10, 100)})
    seen = seen_filter(data)
    filtered = lambda q: exact(queries[q], 100, users=valid_users[q], seen=seen)
    found(
        "two-tower, exact fp32, Bloom filter of train positives",
        {k: exact(queries, k, users=valid_users, seen=seen)[1] for k in (10, 100)},
        **{f"ms/query (batch {b})": round(latency_ms(filtered, len(valid_users), b, args.reps), 4) for b in (args.batch, 1)},
        **{"index bytes": exact.index_bytes() + seen.index_bytes()},
    )  # fmt: skip

    # retrieve -> rank: the ranker learns every train rating's label from the user vector and the item.
    t = time.perf_counter()
    ranker, losses = fit_ranker_on(data, user_tower)
    print(f"ranker: {len(data.rated['train'])} train ratings, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
          f"{time.perf_counter() - t:.1f} s", flush=True)  # fmt: skip
    pipe = RetrieveRank(user_tower, Int8Index(item_vecs), ranker, candidates=100, k=10, seen=seen)
    features = [t[valid_users] for t in users]
    run = lambda q: pipe([f[q] for f in features], valid_users[q])
    found(
        "retrieve (int8 index, 100 candidates, Bloom filter) -> rank -> top 10",
        {10: pipe(features, valid_users)[1]},
        **{f"ms/query (batch {b})": round(latency_ms(run, len(valid_users), b, args.reps), 4) for b in (args.batch, 1)},
    )  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--movielens", type=Path)
    p.add_argument("--items", type=int, default=100_000)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--epochs", type=int, default=5)
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
