"""Peak memory of loading a large preprocessing artifact (``preprocess.json``), as every serving worker,
``recscale eval`` and ``recscale predict`` load it, and of indexing it for scoring requests.

    python bench/vocab_memory.py --ids 4000000
    python bench/vocab_memory.py --ids 4000000 --formats 1        # only the version-1 file (list of ids)

A schema of one string field (Criteo-like 8-hex-digit ids) and one integer field, each with ``--ids`` distinct
ids, is saved by this recscale (``Preprocessor.save``) and, for comparison, in the version-1 layout (every id
a JSON list element). Each file is then loaded in a fresh process (``Preprocessor.load``, then every field's
``vocab_index``, as ``Scorer`` does on start), which reports its peak resident memory above
its baseline after imports (VmHWM), and its resident memory once loaded (VmRSS); the lookups of a sample of ids are checked
equal across the files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa

from recscale.data.preprocess import Preprocessor
from recscale.data.schema import Schema, SparseFeature

SCHEMA = Schema(sparse=[SparseFeature(name="s"), SparseFeature(name="i")])


def _status_mb(key: str) -> float:
    """A memory figure of this process from /proc/self/status (Linux), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise SystemExit(f"no {key} in /proc/self/status: this benchmark needs Linux")


def _rss_mb() -> float:
    return _status_mb("VmRSS")


def _peak_mb() -> float:
    # VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over exec from the parent at fork, whose
    # lists of ids would then count as this process's peak.
    return _status_mb("VmHWM")


def measure(path: Path, sample: Path) -> dict[str, float | str]:
    """Run in a fresh process: the memory of loading and indexing ``path``; a digest of ``sample``'s lookups."""
    base = _rss_mb()
    pre = Preprocessor.load(path)
    loaded_peak, loaded_rss = _peak_mb(), _rss_mb()
    if hasattr(pre, "index_vocabularies"):  # as Scorer does on start
        pre.index_vocabularies()
    else:  # a recscale from before it (PYTHONPATH=OLD/src), for the figures before
        for name in ("s", "i"):
            pre.vocab_index(name)
    indexed_peak, indexed_rss = _peak_mb(), _rss_mb()
    values = pa.array(json.loads(sample.read_text()), pa.string())
    ids = np.concatenate([pre.lookup(name, values) for name in ("s", "i")])
    return {
        "load_peak_mb": loaded_peak - base,
        "loaded_rss_mb": loaded_rss - base,
        "index_peak_mb": indexed_peak - base,
        "indexed_rss_mb": indexed_rss - base,
        "lookups": hashlib.sha256(ids.tobytes()).hexdigest()[:16],
        "vocab_types": ",".join(str(pre.vocabs[n].type) for n in ("s", "i")),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ids", type=int, default=4_000_000, help="distinct ids per field")
    p.add_argument("--formats", nargs="+", default=["1", "current"], help="artifact layouts to load")
    p.add_argument("--measure", nargs=2, type=Path, help=argparse.SUPPRESS)  # the child process
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return
    rng = np.random.default_rng(0)
    ints = rng.choice(1 << 40, size=args.ids, replace=False)
    strs = pa.array(np.char.mod("%08x", ints % (1 << 32)).astype(object)).cast(pa.string())
    strs = pa.array(np.unique(strs.to_numpy(zero_copy_only=False)), pa.string())
    pre = Preprocessor(SCHEMA, {"s": strs, "i": pa.array(ints, pa.int64())})
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        if "current" in args.formats:
            files["current"] = Path(tmp, "current.json")
            pre.save(files["current"])
        if "1" in args.formats:
            files["1"] = Path(tmp, "v1.json")
            vocabs = {
                "s": {"type": "str", "values": strs.to_pylist()},
                "i": {"type": "int", "values": ints.tolist()},
            }
            v1 = {"version": 1, "schema": SCHEMA.model_dump(), "vocabs": vocabs}
            files["1"].write_text(json.dumps(v1))
            del vocabs, v1
        sample = Path(tmp, "sample.json")
        picks = rng.integers(0, args.ids, 64)
        probe = [strs[int(i)].as_py() for i in picks] + [str(ints[int(i)]) for i in picks] + ["absent", "-1"]
        sample.write_text(json.dumps(probe))
        results = []
        for fmt, path in files.items():
            out = subprocess.run(
                [sys.executable, __file__, "--measure", str(path), str(sample)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            m = {
                "format": fmt,
                "ids_per_field": args.ids,
                "file_mb": path.stat().st_size / 1e6,
                **json.loads(out),
            }
            results.append(m)
            print(json.dumps(m), flush=True)
    same = len({m["lookups"] for m in results}) == 1
    print(f"lookups identical across formats: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
