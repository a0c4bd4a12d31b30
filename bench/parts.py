"""Rows/s of ``read_batches`` over a split written in many small parts vs the same rows in one file.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/parts.py --rows 200000 --parts 1000 --format csv
    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/parts.py --rows 200000 --parts 1000 --format parquet

Writes synthetic rows (a label, 2 dense and 8 id columns) to a temporary directory, once as one file and
once as ``--parts`` part files of a Spark job's folder, reads each ``--repeat`` times and prints one JSON
line: the median rows/s of each and the per-part overhead in milliseconds, of wall and of CPU time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from recscale.data.readers import read_batches
from recscale.data.schema import DenseFeature, Schema, SparseFeature

DENSE = ["d0", "d1"]
SPARSE = [f"c{i}" for i in range(8)]


def table(rows: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    cols: dict[str, pa.Array] = {"label": pa.array(rng.integers(0, 2, rows))}
    cols |= {n: pa.array(rng.normal(size=rows)) for n in DENSE}
    cols |= {n: pa.array(rng.integers(0, 10_000, rows).astype(str)) for n in SPARSE}
    return pa.table(cols)


def write(t: pa.Table, path: Path, fmt: str) -> None:
    if fmt == "parquet":
        pq.write_table(t, path)
    else:
        pacsv.write_csv(t, path, pacsv.WriteOptions(quoting_style="none"))


def read_rows(path: Path, fmt: str, schema: Schema) -> tuple[int, float, float]:
    """Rows read, wall seconds, CPU seconds (all threads: steadier than wall time on a shared machine)."""
    start, cpu = time.perf_counter(), time.process_time()
    rows = sum(b.num_rows for b in read_batches(path, fmt, schema))
    return rows, time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--parts", type=int, default=1000)
    p.add_argument("--format", choices=["csv", "parquet"], default="csv")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    schema = Schema(
        dense=[DenseFeature(name=n) for n in DENSE], sparse=[SparseFeature(name=n) for n in SPARSE]
    )
    t = table(args.rows)
    with tempfile.TemporaryDirectory() as tmp:
        one, folder = Path(tmp) / f"whole.{args.format}", Path(tmp) / "parts"
        write(t, one, args.format)
        folder.mkdir()
        bounds = np.linspace(0, args.rows, args.parts + 1).astype(int)
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            write(t.slice(a, b - a), folder / f"part-{i:05d}.{args.format}", args.format)
        (folder / "_SUCCESS").write_bytes(b"")
        times: dict[str, list[float]] = {"one": [], "parts": [], "one_cpu": [], "parts_cpu": []}
        for _ in range(args.repeat):  # alternately: the machine's drift is larger than some differences
            for name, path in (("one", one), ("parts", folder)):
                rows, seconds, cpu = read_rows(path, args.format, schema)
                assert rows == args.rows
                times[name].append(seconds)
                times[f"{name}_cpu"].append(cpu)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        json.dumps(
            {
                "format": args.format,
                "rows": args.rows,
                "parts": args.parts,
                "one_file_rows_per_s": round(args.rows / med["one"]),
                "parts_rows_per_s": round(args.rows / med["parts"]),
                "ms_per_part": round((med["parts"] - med["one"]) / args.parts * 1000, 3),
                "cpu_ms_per_part": round((med["parts_cpu"] - med["one_cpu"]) / args.parts * 1000, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
