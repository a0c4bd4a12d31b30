"""Time ``stable_hash`` (the 64-bit FNV-1a of ``hash_buckets`` fields) on id shapes that matter: short ids of
varying length, Criteo's 8-hex-digit ids, and one 200,000-character id among 65,000 short ones. Best of
``--reps`` calls each, one process; compare commits by running it at each.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/hash_ids.py
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pyarrow as pa

from recscale.data.preprocess import stable_hash


def cases(rows: int) -> dict[str, pa.Array]:
    rng = np.random.default_rng(0)
    return {
        f"{rows:,} short ids of 3-10 characters": pa.array(
            [f"id{rng.integers(0, 10 ** rng.integers(1, 9))}" for _ in range(rows)]
        ),
        f"{rows:,} Criteo 8-hex ids": pa.array([f"{rng.integers(0, 2**32):08x}" for _ in range(rows)]),
        "one 200,000-character id among 65,000 short": pa.array(
            ["x" * 200_000] + [f"u{i}" for i in range(65_000)]
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args()
    for name, values in cases(args.rows).items():
        best = float("inf")
        for _ in range(args.reps):
            t = time.perf_counter()
            stable_hash(values)
            best = min(best, time.perf_counter() - t)
        print(f"{name}: {best * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
