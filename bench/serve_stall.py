"""How long a large scoring request holds up small ones on one ``recscale serve`` process.

    python bench/serve_stall.py                  # train the demo config 2 steps, export, then measure
    python bench/serve_stall.py --large-rows 4096 --seconds 10

A client sends 1-row requests back to back while another sends ``--large-rows``-row requests back to back
(the demo's synthetic rows, every value a random id or number); reported: the small requests' latency
percentiles and the large requests' parse + score time, in-process (FastAPI's TestClient: the app's own event
loop in a thread, no sockets). Run it with PYTHONPATH pointing at another recscale's src/ to compare.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from fastapi.testclient import TestClient

from recscale.cli import main as cli
from recscale.quiet import quiet_upstream
from recscale.serve.scorer import Scorer
from recscale.serve.server import ServeOptions, create_app

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


def rows(scorer: Scorer, n: int, seed: int) -> list[dict]:
    """``n`` request rows of random values of the model's columns."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        row: dict[str, object] = {}
        for f in scorer.parser.arrow_schema:
            if str(f.type) == "float":
                row[f.name] = float(rng.random())
            elif str(f.type).startswith("list"):
                row[f.name] = [str(x) for x in rng.integers(0, 100, 3)]
            else:
                row[f.name] = str(rng.integers(0, 100))
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--large-rows", type=int, default=4096)
    p.add_argument("--seconds", type=float, default=10)
    args = p.parse_args()
    quiet_upstream()
    with tempfile.TemporaryDirectory() as tmp:
        run, model = Path(tmp, "run"), Path(tmp, "model")
        rows_cfg = "data.synthetic.rows={train: 512, valid: 256, test: 256}"
        argv = [
            "train",
            str(CONFIG),
            "--out",
            str(run),
            "train.max_steps=2",
            rows_cfg,
            "train.progress=false",
        ]
        assert cli(argv) == 0
        assert cli(["export", str(run), "--out", str(model)]) == 0
        scorer = Scorer(model, max_rows=args.large_rows)
    small = json.dumps({"rows": rows(scorer, 1, 0)}).encode()
    large = json.dumps({"rows": rows(scorer, args.large_rows, 1)}).encode()
    t0 = time.perf_counter()
    scorer.parser.parse(large)
    parse_ms = (time.perf_counter() - t0) * 1000
    small_ms: list[float] = []
    large_ms: list[float] = []
    with TestClient(create_app(scorer, ServeOptions())) as c:
        stop = time.perf_counter() + args.seconds

        def send(body: bytes, into: list[float]) -> None:
            while time.perf_counter() < stop:
                t = time.perf_counter()
                assert c.post("/score", content=body).status_code == 200
                into.append((time.perf_counter() - t) * 1000)

        threads = [threading.Thread(target=send, args=a) for a in ((small, small_ms), (large, large_ms))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    lat = np.array(small_ms)
    print(
        json.dumps(
            {
                "large_rows": args.large_rows,
                "large_body_kb": len(large) // 1024,
                "large_parse_ms": round(parse_ms, 1),
                "large_requests": len(large_ms),
                "large_p50_ms": round(float(np.median(large_ms)), 1),
                "small_requests": len(lat),
                **{f"small_p{q}_ms": round(float(np.percentile(lat, q)), 1) for q in (50, 90, 99)},
                "small_max_ms": round(float(lat.max()), 1),
            }
        )
    )


if __name__ == "__main__":
    main()
