"""Load test of ``recscale serve`` over loopback: QPS and latency at several concurrencies, every answer
checked against the offline scores, batching on and off, against the offline scoring rate.

    python bench/serve.py MODEL_DIR --data ../shared/data/frappe/valid.csv --rows-per-request 1 16 \\
        --concurrency 1 8 64 --requests 2000 --seconds 20 --out docs/serving_load
    python bench/serve.py MODEL_DIR --data ... --rows-per-request 16 --concurrency 64 --rate 0.5

Closed loop (the default): each client sends its next request as soon as the last is answered, so the
levels measure the most the server answers; with C clients the latency is C / QPS, whatever the server.
Open loop (``--rate F``): the clients together offer F x the offline rows/s, each on a fixed schedule
(evenly staggered), and a latency runs from the request's *scheduled* time, so a server that falls
behind shows it in the tail instead of slowing the clients down (no coordinated omission). A level
sustains the rate when the answered rows/s reach the offered ones.

For each batching mode the server is started as its own process (``recscale serve``, default options
otherwise), waited for on /readyz, loaded by C client threads (``http.client``) each sending requests
back to back on its own keep-alive connection (bounded by --requests and --seconds per level), then
stopped with SIGTERM. (An asyncio httpx client was tried first: at 64 connections it, not the server,
was the bottleneck, 20x below these threads.)
A request counts as answered when it gets a 200 whose scores all match the offline scores of its
rows (``Scorer.score_file`` in this process) within --tol; otherwise it is failed (an error status,
a transport error or a timeout) or wrong. The offline rate is ``Scorer.score_file``'s rows/s over the
same rows (the run's reader, vocabularies and model at batch 8192, as ``recscale eval`` scores).
"""

from __future__ import annotations

import argparse
import gc
import http.client
import itertools
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from report_files import print_report

from recscale.data.readers import read_batches
from recscale.data.schema import LABEL
from recscale.quiet import quiet_upstream
from recscale.serve.scorer import Scorer

HEADERS = {"Content-Type": "application/json"}


def offline(scorer: Scorer, data: Path, limit: int) -> tuple[list[dict], np.ndarray, float]:
    """The first ``limit`` rows of ``data`` as request rows, their offline probabilities, and the offline
    rate (rows/s of ``score_file`` over the whole file, best of 3)."""
    cfg = scorer.config.data
    batch = pa.Table.from_batches(list(read_batches(data, cfg.format, scorer.pre.schema, cfg.options))).slice(
        0, limit
    )
    rows = batch.drop_columns([LABEL]).to_pylist()
    probs = torch.sigmoid(scorer.logits(batch.combine_chunks().to_batches()[0])).numpy()
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        logits, _ = scorer.score_file(data)
        best = max(best, len(logits) / (time.perf_counter() - t0))
    return rows, probs, best


def start_server(
    model_dir: Path, batching: bool, workers: int, extra: list[str]
) -> tuple[subprocess.Popen[bytes], int]:
    """The server, once each of its ``workers`` processes has answered /readyz (a worker not yet ready
    accepts no connections, so the clients' keep-alive connections would all land on the others)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "recscale.cli", "serve", str(model_dir), "--port", str(port)]
    argv += ["--workers", str(workers)] + ([] if batching else ["--no-batching"]) + extra
    proc = subprocess.Popen(argv, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    ready: set[int] = set()
    while True:
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=5) as r:
                ready.add(json.loads(r.read())["pid"])
            if len(ready) == workers:
                return proc, port
            time.sleep(0.1)
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"the server did not become ready (exit code {proc.poll()})") from None
            time.sleep(0.5)


def load(
    port: int,
    bodies: list[bytes],
    right: Callable[[int, bytes], bool],
    rows: int,
    concurrency: int,
    requests: int,
    seconds: float,
    interval: float | None = None,
    path: str = "/score",
) -> dict[str, float]:
    """``concurrency`` threads, each on its own keep-alive connection, send requests (``bodies``, of ``rows``
    rows each, to ``path``) back to back, or (``interval``) each one request every ``interval`` seconds, client
    i starting i / concurrency of an interval after the clock. ``right(k, answer)``: whether the 200 answer to
    body k is right."""
    latencies: list[float] = []
    counts = {"answered": 0, "failed": 0, "wrong": 0}
    next_request = iter(range(requests))
    lock = threading.Lock()
    clock: dict[str, float] = {}
    # Every client has connected and warmed up before the clock starts.
    start = threading.Barrier(concurrency, action=lambda: clock.update(t0=time.perf_counter()))

    def worker(client: int, first: bytes) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", path, first, HEADERS)
        conn.getresponse().read()
        start.wait()
        for sent, i in enumerate(next_request):
            if time.perf_counter() - clock["t0"] > seconds:
                break
            k = i % len(bodies)
            t0 = time.perf_counter()
            if interval is not None:  # the scheduled time, from which the latency counts
                t0 = clock["t0"] + (client / concurrency + sent) * interval
                time.sleep(max(0.0, t0 - time.perf_counter()))
            try:
                conn.request("POST", path, bodies[k], HEADERS)
                r = conn.getresponse()
                data = r.read()
            except (OSError, http.client.HTTPException):
                outcome = "failed"
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            else:
                latency = time.perf_counter() - t0
                outcome = "failed" if r.status != 200 else "answered" if right(k, data) else "wrong"
                with lock:
                    latencies.append(latency)
            with lock:
                counts[outcome] += 1
        conn.close()

    threads = [threading.Thread(target=worker, args=(i, bodies[i % len(bodies)])) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - clock["t0"]
    lat = np.array(latencies) * 1000
    sent = sum(counts.values())
    return {"requests": sent, **counts, "qps": sent / wall, "rows_per_s": sent * rows / wall,
            "p50_ms": float(np.percentile(lat, 50)), "p95_ms": float(np.percentile(lat, 95)),
            "p99_ms": float(np.percentile(lat, 99))}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path)
    p.add_argument("--data", required=True, type=Path, help="rows to send (a file in the run's format)")
    p.add_argument("--rows-per-request", type=int, nargs="+", default=[1, 16])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--requests", type=int, default=2000, help="requests per level at most")
    p.add_argument("--seconds", type=float, default=20, help="seconds per level at most")
    p.add_argument("--batching", choices=["on", "off"], nargs="+", default=["on", "off"])
    p.add_argument("--workers", type=int, default=1, help="recscale serve --workers (default 1)")
    p.add_argument("--repeat", type=int, default=1, help="measure each level this many times (tails vary)")
    p.add_argument("--server-args", default="", help='more options of recscale serve, e.g. "--threads 2"')
    p.add_argument("--tol", type=float, default=1e-5, help="largest allowed |server - offline| score")
    p.add_argument("--rate", type=float, help="open loop: offer this fraction of the offline rows/s")
    p.add_argument("--out", type=Path, help="write OUT.md and OUT.csv")
    args = p.parse_args()
    quiet_upstream()
    scorer = Scorer(args.model_dir)
    most = max(args.rows_per_request) * args.requests
    rows, probs, offline_rate = offline(scorer, args.data, most)
    print(f"offline: {offline_rate:,.0f} rows/s (Scorer.score_file, batch 8192)", flush=True)
    results = []
    for mode in args.batching:
        proc, port = start_server(args.model_dir, mode == "on", args.workers, shlex.split(args.server_args))
        try:
            for r in args.rows_per_request:
                n = len(rows) // r
                bodies = [json.dumps({"rows": rows[i * r : (i + 1) * r]}).encode() for i in range(n)]
                expected = [probs[i * r : (i + 1) * r] for i in range(n)]

                def right(k: int, data: bytes, expected: list[np.ndarray] = expected) -> bool:
                    got = np.asarray(json.loads(data)["scores"], dtype=np.float64)
                    return got.shape == expected[k].shape and np.abs(got - expected[k]).max() <= args.tol

                # The request rows and bodies are a million long-lived objects: a full collection would
                # pause every client thread for tens of ms and count as server latency.
                gc.collect()
                gc.freeze()
                for c, run in itertools.product(args.concurrency, range(1, args.repeat + 1)):
                    # open loop: each of c clients sends r rows every `interval` s
                    interval = c * r / (args.rate * offline_rate) if args.rate else None
                    m = load(port, bodies, right, r, c, args.requests, args.seconds, interval)
                    m = {"batching": mode, "workers": args.workers, "rows_per_request": r, "concurrency": c,
                         "run": run, "offered_rows_per_s": args.rate * offline_rate if args.rate else None, **m,
                         "of_offline": m["rows_per_s"] / offline_rate}  # fmt: skip
                    results.append(m)
                    print(json.dumps(m), flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    lines = [
        f"Offline rate: {offline_rate:,.0f} rows/s (`Scorer.score_file`, batch 8192). Answers checked against the "
        f"offline scores within {args.tol:g}.",
        "",
        (
            f"Open loop: the clients offer {args.rate:g} x the offline rate ({args.rate * offline_rate:,.0f} rows/s); "
            "latency from each request's scheduled time."
        )
        if args.rate
        else "Closed loop: each client sends its next request when the last is answered.",  # fmt: skip
        "",
        f"Server: `{f'recscale serve MODEL_DIR --workers {args.workers} {args.server_args}'.strip()}` (other options "
        "default).",
        "",
        "| batching | rows/request | clients | run | requests | wrong | failed | QPS | rows/s | % of offline | p50 ms | p95 ms | p99 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in results:
        lines.append(
            f"| {m['batching']} | {m['rows_per_request']} | {m['concurrency']} | {m['run']} | {m['requests']} | {m['wrong']} | "
            f"{m['failed']} | {m['qps']:,.0f} | {m['rows_per_s']:,.0f} | {100 * m['of_offline']:.1f} | "
            f"{m['p50_ms']:.1f} | {m['p95_ms']:.1f} | {m['p99_ms']:.1f} |"
        )
    print_report(lines, results, args.out)


if __name__ == "__main__":
    main()
