"""Exported-model variants of one trained run: AUC / LogLoss against the fp32 export, and size.

    python bench/export.py RUN_DIR --data ../shared/data/frappe/valid.csv --out docs/serving_export

Exports the run once per variant (``recscale export --tables T --dense D``) into a temporary
directory, scores ``--data`` with each (``Scorer.score_file``: the run's reader and vocabularies), and
checks the fp32 export against ``recscale eval`` of the run itself. Writes OUT.md and OUT.csv.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from report_files import print_report
from safetensors.torch import load_file

from recscale.distributed.env import shutdown
from recscale.quiet import quiet_upstream
from recscale.serve.artifact import WEIGHTS, artifact_bytes
from recscale.serve.export import export_run
from recscale.serve.scorer import Scorer
from recscale.train.metrics import ctr_metrics
from recscale.train.runs import eval_run

VARIANTS = [
    ("fp32", "fp32"),
    ("fp16", "fp32"),
    ("int8", "fp32"),
    ("int4", "fp32"),
    ("fp32", "bf16"),
    ("int8", "bf16"),
    ("int8", "int8"),
]


def table_bytes(model_dir: Path) -> int:
    tensors = load_file(model_dir / WEIGHTS)
    return sum(t.numel() * t.element_size() for k, t in tensors.items() if k.startswith("embedding.ebc."))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--data", required=True, type=Path)
    p.add_argument("--out", type=Path, help="write OUT.md and OUT.csv")
    args = p.parse_args()
    quiet_upstream()
    rows = []
    with tempfile.TemporaryDirectory(prefix="recscale-bench-export-") as tmp:
        reference = eval_run(args.run_dir, str(args.data))
        for tables, dense in VARIANTS:
            out = Path(tmp) / f"{tables}-{dense}"
            export_run(args.run_dir, out, tables, dense)
            scorer = Scorer(out)
            t0 = time.perf_counter()
            logits, labels = scorer.score_file(args.data)
            seconds = time.perf_counter() - t0
            m = ctr_metrics(torch.from_numpy(logits), torch.from_numpy(labels))
            rows.append({"tables": tables, "dense": dense, "auc": m["auc"], "logloss": m["logloss"],
                         "artifact_bytes": sum(artifact_bytes(out).values()), "table_bytes": table_bytes(out),
                         "rows_per_s": len(labels) / seconds})  # fmt: skip
    shutdown()
    base = rows[0]
    lines = [
        f"`recscale eval` of the run on {args.data.name}: AUC {reference['auc']:.6f}, LogLoss {reference['logloss']:.6f} "
        f"(fp32 export: {base['auc']:.6f}, {base['logloss']:.6f})",
        "",
        "| tables | dense | AUC | Δ AUC | LogLoss | Δ LogLoss | artifact bytes | × smaller | table bytes | × smaller | rows/s (score_file) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['tables']} | {r['dense']} | {r['auc']:.5f} | {r['auc'] - base['auc']:+.5f} | {r['logloss']:.5f} | "
            f"{r['logloss'] - base['logloss']:+.5f} | {r['artifact_bytes']:,} | {base['artifact_bytes'] / r['artifact_bytes']:.2f} | "
            f"{r['table_bytes']:,} | {base['table_bytes'] / r['table_bytes']:.2f} | {r['rows_per_s']:,.0f} |"
        )
    print_report(lines, rows, args.out)


if __name__ == "__main__":
    main()
