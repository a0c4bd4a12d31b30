"""CPU-seconds of the one-pass data preparation of a Criteo TSV, single-threaded: read, fit the
vocabularies, map the ids, write the column files (``prepare``), and the same file mapped again with
the fitted vocabularies (``map``, as a valid or test split is).

    OMP_NUM_THREADS=1 python bench/prepare_cpu.py --tsv /tmp/criteo500k.tsv --repeat 3
    PYTHONPATH=OLD/src OMP_NUM_THREADS=1 python bench/prepare_cpu.py --tsv /tmp/criteo500k.tsv   # code in OLD

The file is bench/pipeline.py's Criteo-shaped one (written to ``--tsv`` if it is not there, reused if
it is, so two versions of the code can read the same bytes). recscale's worker threads and pyarrow's
pool are set to one thread: the figure is the CPU the work takes (``time.process_time``), steadier
than a wall-clock rate on a shared machine, though still moved by what shares the cores. Prints one
JSON line: seconds per repeat, and the recscale source measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from pipeline import criteo_table, schema_for

import recscale
import recscale.data.chunks
from recscale.data.materialize import materialize
from recscale.data.readers import read_batches


def criteo_tsv(path: Path, rows: int) -> None:
    """bench/pipeline.py's Criteo-shaped file as a raw Criteo TSV at ``path``, unless it is there already."""
    if not path.exists():
        table = criteo_table(rows)
        table = table.set_column(0, "label", pc.cast(table["label"], pa.int8()))
        options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
        pacsv.write_csv(table, path, options)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tsv", type=Path, required=True, help="the Criteo TSV (written first if missing)")
    p.add_argument("--rows", type=int, default=500_000, help="rows of the file when it is written")
    p.add_argument("--repeat", type=int, default=1)
    args = p.parse_args()
    criteo_tsv(args.tsv, args.rows)
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    recscale.data.chunks.ordered_map.__defaults__ = (1,)  # its worker count
    schema = schema_for("criteo")
    prepare, mapped, rows = [], [], 0
    with tempfile.TemporaryDirectory(prefix="recscale-prepare-cpu-") as d:
        for i in range(args.repeat):
            t0 = time.process_time()
            pre = materialize(read_batches(args.tsv, "criteo", schema), schema, Path(d) / f"train{i}")
            t1 = time.process_time()
            materialize(read_batches(args.tsv, "criteo", schema), schema, Path(d) / f"valid{i}", pre=pre)
            t2 = time.process_time()
            prepare.append(round(t1 - t0, 3))
            mapped.append(round(t2 - t1, 3))
            rows = json.loads((Path(d) / f"train{i}" / "meta.json").read_text())["rows"]
            shutil.rmtree(Path(d) / f"train{i}")
            shutil.rmtree(Path(d) / f"valid{i}")
    source = str(Path(recscale.__file__).resolve().parents[1])
    print(json.dumps({"bench": "prepare_cpu", "rows": rows, "prepare_cpu_s": prepare, "map_cpu_s": mapped,
                      "source": source}))  # fmt: skip


if __name__ == "__main__":
    main()
