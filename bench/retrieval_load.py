"""Load test of ``recscale serve`` on a retrieval model over loopback: QPS and latency of ``POST /retrieve`` at
several concurrencies, batching on and off, every answer checked against the model queried alone offline.

    python bench/retrieval_load.py MODEL_DIR --users-per-request 1 --concurrency 1 8 32 --seconds 10

MODEL_DIR is a ``recscale retrieval build`` output. The clients, the server start and the closed / open loop are
``bench/serve.py``'s (``start_server``, ``load``); a request is ``--users-per-request`` users of the catalog in
turn, and it counts as answered when its items equal those ``recommend`` gives each of its users alone (item ids
in order; the ranker's logits may differ in their last digits when users are scored together).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
from pathlib import Path

from report_files import print_report
from serve import load, start_server

from recscale.quiet import quiet_upstream
from recscale.serve.retrieval_artifact import load_retriever, recommend


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path)
    p.add_argument("--users-per-request", type=int, nargs="+", default=[1])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=5000, help="requests per level at most")
    p.add_argument("--seconds", type=float, default=10, help="seconds per level at most")
    p.add_argument("--batching", choices=["on", "off"], nargs="+", default=["on", "off"])
    p.add_argument("--server-args", default="", help='more options of recscale serve, e.g. "--threads 2"')
    p.add_argument("--out", type=Path, help="write OUT.md and OUT.csv")
    args = p.parse_args()
    quiet_upstream()
    model, catalog = load_retriever(args.model_dir)
    users = catalog.user_keys
    alone = {u: [x["item"] for x in items] for u, items in recommend(model, catalog, users).items()}
    results = []
    for mode in args.batching:
        proc, port = start_server(args.model_dir, mode == "on", 1, shlex.split(args.server_args))
        try:
            for n in args.users_per_request:
                asked = [users[i : i + n] for i in range(0, len(users) - n + 1, n)]
                bodies = [json.dumps({"users": a}).encode() for a in asked]

                def right(k: int, data: bytes, asked: list[list[str]] = asked) -> bool:
                    got = json.loads(data)["items"]
                    return {u: [x["item"] for x in got[u]] for u in got} == {u: alone[u] for u in asked[k]}

                for c in args.concurrency:
                    m = load(port, bodies, right, n, c, args.requests, args.seconds, path="/retrieve")
                    m = {"batching": mode, "users_per_request": n, "concurrency": c, **m}
                    results.append(m)
                    print(json.dumps(m), flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    lines = [
        f"Server: `recscale serve MODEL_DIR {args.server_args}`; closed loop, each client sends its next request when "
        "the last is answered; answers checked against each user queried alone.",
        "",
        "| batching | users/request | clients | requests | wrong | failed | QPS | p50 ms | p95 ms | p99 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {m['batching']} | {m['users_per_request']} | {m['concurrency']} | {m['requests']} | {m['wrong']} | "
        f"{m['failed']} | {m['qps']:,.0f} | {m['p50_ms']:.1f} | {m['p95_ms']:.1f} | {m['p99_ms']:.1f} |"
        for m in results
    ]
    print_report(lines, results, args.out)


if __name__ == "__main__":
    main()
