"""Wall time of the one-pass preparation of a Criteo TSV (``materialize`` of ``read_batches``), with the
knobs it was tuned on: the parsing and encoding thread counts, the text chunk size, the re-cut into
65,536-row batches, and glibc's malloc kept from unmapping freed memory.

    python bench/prepare_wall.py --tsv /tmp/criteo500k.tsv                      # the defaults
    python bench/prepare_wall.py --tsv /tmp/criteo500k.tsv --threads 3 2 --block-mb 16 --no-recut
    PYTHONPATH=OLD/src python bench/prepare_wall.py --tsv /tmp/criteo500k.tsv   # code in OLD
    python bench/prepare_wall.py --tsv /tmp/criteo500k.tsv --hash-buckets 1048576  # hashed ids, no vocabularies

The file is bench/prepare_cpu.py's (written if missing). Prints one JSON line: the median over ``--repeat``
preparations of the wall time, and of the part after the last batch was read (fitting the vocabularies
and mapping the ids to their column files). Run variants alternately: the machine's drift is larger than
some of the differences.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
from pipeline import schema_for
from prepare_cpu import criteo_tsv

import recscale.data.chunks as chunks
import recscale.data.materialize as materialize
import recscale.data.readers as readers
import recscale.data.readers.text as text
from recscale.data.schema import Schema, SparseFeature


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tsv", type=Path, required=True)
    p.add_argument("--rows", type=int, default=500_000, help="rows of the file when it is written")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--threads", type=int, nargs=2, metavar=("PARSE", "ENCODE"), help="default: the code's")
    p.add_argument("--block-mb", type=int, help="text chunk size (default: the code's)")
    p.add_argument(
        "--no-recut", action="store_true", help="the reader's chunks go to the encoder as they are"
    )
    p.add_argument(
        "--keep-freed-memory", action="store_true", help="train.reuse_memory's malloc tuning first"
    )
    p.add_argument(
        "--hash-buckets", type=int, help="hash every id field into this many buckets instead of a vocabulary"
    )
    args = p.parse_args()
    criteo_tsv(args.tsv, args.rows)
    if args.threads:
        text.ordered_map = functools.partial(chunks.ordered_map, workers=args.threads[0])
        materialize.ordered_map = functools.partial(chunks.ordered_map, workers=args.threads[1])
    if args.block_mb:
        text.BLOCK_BYTES = args.block_mb << 20
    if args.no_recut:
        readers.rechunk = lambda pieces, rows, concat: pieces
    if args.keep_freed_memory:
        from recscale.train.memory import keep_freed_memory

        keep_freed_memory()
    schema = schema_for("criteo")
    if args.hash_buckets:
        schema = Schema(
            dense=schema.dense,
            sparse=[SparseFeature(name=f.name, hash_buckets=args.hash_buckets) for f in schema.sparse],
        )
    walls, finishes = [], []

    def timed(batches: Iterator[pa.RecordBatch], read: list[float]) -> Iterator[pa.RecordBatch]:
        yield from batches
        read.append(time.perf_counter())

    with tempfile.TemporaryDirectory(prefix="recscale-prepare-wall-") as d:
        for i in range(args.repeat):
            read: list[float] = []
            t0 = time.perf_counter()
            batches = timed(readers.read_batches(args.tsv, "criteo", schema), read)
            materialize.materialize(batches, schema, Path(d) / f"t{i}")
            t1 = time.perf_counter()
            walls.append(t1 - t0)
            finishes.append(t1 - read[0])
    print(json.dumps({"bench": "prepare_wall", "args": {k: v for k, v in vars(args).items() if k != "tsv"},
                      "median_s": round(statistics.median(walls), 3),
                      "median_after_read_s": round(statistics.median(finishes), 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
