"""Data pipeline rows/s: CSV, libsvm, Criteo TSV and Parquet files end to end to KeyedJaggedTensor batches.

    OMP_NUM_THREADS=1 python bench/pipeline.py                  # 500,000 rows; prints one JSON line
    OMP_NUM_THREADS=1 python bench/pipeline.py --rows 100000 --formats csv parquet
    OMP_NUM_THREADS=1 python bench/pipeline.py --formats criteo csv --fuxictr-venv /tmp/fuxictr-venv

The files are written into a temporary directory from the synthetic generator, Criteo-shaped: a label,
13 dense fields ``I1..I13`` and 26 single-id fields ``C1..C26`` (Zipf ids over 100,000-id
vocabularies; libsvm carries only the 26 id fields, it has no dense values). Per format, the stages a
run goes through, timed apart:

- ``read``: the reader alone (parse, check and convert every row to the raw layout), nothing kept;
- ``prepare``: the preparation a run (or ``recscale data prepare``) does, in its one pass: read, fit
  the vocabularies, map the ids, write the memory-mapped column files;
- ``map``: the same file prepared again with the fitted vocabularies, as a valid or test split is;
- ``loader``: every shuffled batch of ``--batch`` rows as a ``Batch`` (dense tensor, KJT, labels),
  built in this process (``data.num_workers: 0``): what training consumes each epoch;
- ``end_to_end``: rows / (prepare + loader).

``pandas`` is the same file read by a plain ``pandas.read_csv`` (``read_parquet`` for Parquet), single
threaded: a reference for the reading alone, without vocabularies or batching. With ``--fuxictr-venv``,
``fuxictr`` is FuxiCTR's own preprocessing (``bench/fuxictr_prepare.py``: read with polars, fit the
vocabularies, transform, write parquet) of the CSV file, run in that venv right after recscale's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from recscale.data.dataset import ArrayDataset, epoch_batches, iterate
from recscale.data.materialize import materialize
from recscale.data.readers import read_batches
from recscale.data.schema import DenseFeature, Schema, SparseFeature
from recscale.data.synthetic import SyntheticSpec, synthetic_batches

DENSE = [f"I{i}" for i in range(1, 14)]
SPARSE = [f"C{i}" for i in range(1, 27)]
FORMATS = ("csv", "libsvm", "criteo", "parquet")


def criteo_table(rows: int) -> pa.Table:
    spec = SyntheticSpec(rows={"train": rows}, num_sparse=26, num_multi=0, num_dense=13, vocab_sizes=100_000)
    table = pa.Table.from_batches(list(synthetic_batches(spec, "train")))
    names = {"label": "label", **{f"d{j}": n for j, n in enumerate(DENSE)}}
    names |= {f"s{i}": n for i, n in enumerate(SPARSE)}
    return table.rename_columns([names[c] for c in table.column_names])


def write_files(table: pa.Table, tmp: Path) -> dict[str, Path]:
    label = pc.cast(table["label"], pa.int8())
    text = table.set_column(0, "label", label)
    paths = {f: tmp / f"data.{f}" for f in FORMATS}
    pacsv.write_csv(text, paths["csv"], pacsv.WriteOptions(quoting_style="none"))
    pacsv.write_csv(text, paths["criteo"], pacsv.WriteOptions(include_header=False, delimiter="\t",
                                                              quoting_style="none"))  # fmt: skip
    pq.write_table(table, paths["parquet"])
    tokens = [pc.binary_join_element_wise(pc.cast(table[c], pa.string()), "1", ":") for c in SPARSE]
    lines = pc.binary_join_element_wise(pc.cast(label, pa.string()), *tokens, " ")
    paths["libsvm"].write_text("\n".join(lines.to_pylist()) + "\n")
    return paths


def schema_for(fmt: str) -> Schema:
    dense = [] if fmt == "libsvm" else [DenseFeature(name=n) for n in DENSE]
    return Schema(dense=dense, sparse=[SparseFeature(name=n) for n in SPARSE])


def pandas_read(fmt: str, path: Path) -> float:
    import pandas as pd

    t0 = time.perf_counter()
    if fmt == "parquet":
        pd.read_parquet(path)
    elif fmt == "csv":
        pd.read_csv(path)
    elif fmt == "criteo":
        pd.read_csv(path, sep="\t", header=None)
    else:  # libsvm: whitespace-separated tokens, one column each
        pd.read_csv(path, sep=" ", header=None)
    return time.perf_counter() - t0


def fuxictr_prepare(venv: Path, path: Path, rows: int) -> int:
    """FuxiCTR's preprocessing rows/s on ``path``, in its own interpreter."""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": str(here.parents[1] / "shared" / "peers" / "fuxictr" / "src")}
    out = subprocess.run(
        [str(venv / "bin" / "python"), str(here / "fuxictr_prepare.py"), str(path), str(rows)],
        capture_output=True, text=True, check=True, env=env, cwd=path.parent,
    )  # fmt: skip
    return int(json.loads(out.stdout.strip().splitlines()[-1])["fuxictr_prepare_rows_per_s"])


def bench_format(fmt: str, path: Path, rows: int, batch: int, tmp: Path, fuxictr: Path | None) -> dict:
    schema = schema_for(fmt)
    t0 = time.perf_counter()
    read = sum(b.num_rows for b in read_batches(path, fmt, schema))
    t1 = time.perf_counter()
    pre = materialize(read_batches(path, fmt, schema), schema, tmp / f"split-{fmt}")
    t2 = time.perf_counter()
    materialize(read_batches(path, fmt, schema), schema, tmp / f"again-{fmt}", pre=pre)
    t3 = time.perf_counter()
    ds = ArrayDataset(tmp / f"split-{fmt}")
    index = epoch_batches(len(ds), batch, seed=0, epoch=0, drop_last=False)
    served = sum(b.size for b in iterate(ds, index))
    t4 = time.perf_counter()
    assert served == rows == read, (served, rows, read)
    pandas_s = pandas_read(fmt, path)
    rates = {
        "read": round(rows / (t1 - t0)),
        "prepare": round(rows / (t2 - t1)),
        "map": round(rows / (t3 - t2)),
        "loader": round(rows / (t4 - t3)),
        "end_to_end": round(rows / (t2 - t1 + t4 - t3)),
        "pandas": round(rows / pandas_s),
    }
    if fuxictr is not None and fmt == "csv":  # FuxiCTR reads CSV with a header only
        rates["fuxictr"] = fuxictr_prepare(fuxictr, path, rows)
    return {"format": fmt, "mb": round(path.stat().st_size / 1e6, 1), "rows_per_s": rates}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=500_000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument(
        "--fuxictr-venv",
        type=Path,
        help="also time FuxiCTR's preprocessing of the CSV file (setup.sh's venv)",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="recscale-pipeline-") as d:
        tmp = Path(d)
        paths = write_files(criteo_table(args.rows), tmp)
        results = [
            bench_format(f, paths[f], args.rows, args.batch, tmp, args.fuxictr_venv) for f in args.formats
        ]
    print(json.dumps({"bench": "pipeline", "rows": args.rows, "batch": args.batch, "formats": results}))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
