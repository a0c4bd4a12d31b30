"""Low precision side by side: each setting against fp32 on the synthetic teacher, paired by seed.

    python bench/precision.py                                    # Wukong, every setting but bf16, seeds 0 1 2
    python bench/precision.py --models wukong dlrm dcnv2 --settings fp32 bf16 mxfp8_e4m3 --seeds 0
    python bench/precision.py --data frappe --models dlrm dcnv2 --settings fp32 bf16 mxfp8_e4m3 mxint8 mxfp4

Every run is ``recscale train configs/demo.yaml`` (the synthetic teacher) with the overrides below plus the
setting's own (printed as it starts, so any row reproduces by hand). ``--data frappe`` trains each model's
suite recipe ``configs/frappe/<model>.yaml`` instead, for a fixed ``--epochs`` without early stopping, so
that a setting and its fp32 twin train the same steps (an early stop would compare different checkpoints:
the stopping step moves with tiny numerical differences); the qcomms settings need table-wise tables, which
the Frappe recipes of DCNv2 and Wukong (replicated tables, Adam) do not take. A setting and the fp32
run of the same seed see the same data and the same initial weights, so the AUC and LogLoss
*differences* are paired: their mean ± std over seeds is what the precision costs, free of seed-to-seed
noise. The qcomms settings train on 2 ranks (table-wise
tables, bytes counted) against ``fp32_2ranks``; bytes per step are the all-to-all and all-reduce bytes of
the run's logged train windows. Writes docs/precision.csv (one row per run) and docs/precision.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from report_files import write_csv  # bench/ is on sys.path

REPO = Path(__file__).resolve().parents[1]
LOG_EVERY = 25  # steps per logged train window (its comm bytes are per window)
DATA = [
    "data.synthetic.rows={train: 200000, valid: 50000, test: 1000}", "data.num_workers=0",
    "train.epochs=1", "train.eval_every=null", f"train.log_every={LOG_EVERY}", "train.progress=false",
]  # fmt: skip
TWO_RANKS = ["--nproc=2", "distributed.sharding=table_wise", "distributed.count_bytes=true"]
SETTINGS: dict[str, list[str]] = {
    "fp32": [],
    "bf16": ["train.precision=bf16"],
    "mxfp8_e4m3": ["model.quant.format=mxfp8_e4m3"],
    "mxfp6_e2m3": ["model.quant.format=mxfp6_e2m3"],
    "mxfp4": ["model.quant.format=mxfp4"],
    "mxint8": ["model.quant.format=mxint8"],
    "fp8_e4m3": ["model.quant.format=fp8_e4m3"],
    "tables_fp16": ["model.embedding.storage=fp16"],
    "fp32_2ranks": TWO_RANKS,
    "qcomms_fp16": [*TWO_RANKS, "distributed.qcomms={forward: fp16, backward: fp16, dense: fp16}"],
    "qcomms_int8": [*TWO_RANKS, "distributed.qcomms={forward: int8, backward: fp16, dense: bf16}"],
    "qcomms_mx4": [*TWO_RANKS, "distributed.qcomms={forward: mx4, backward: fp16}"],
    "qcomms_fp8": [*TWO_RANKS, "distributed.qcomms={forward: fp8, backward: fp8}"],
    "qcomms_int8_both": [*TWO_RANKS, "distributed.qcomms={forward: int8, backward: int8, dense: bf16}"],
    "qcomms_mx4_both": [*TWO_RANKS, "distributed.qcomms={forward: mx4, backward: mx4}"],
    "qcomms_mxint8_both": [*TWO_RANKS, "distributed.qcomms={forward: mxint8, backward: mxint8, dense: bf16}"],
}
MODELS = {"wukong": [], "dlrm": ["model.top_mlp=[256,128]"], "dcnv2": []}


def frappe_overrides(epochs: int) -> list[str]:
    return [f"train.epochs={epochs}", "train.early_stopping=null", f"train.log_every={LOG_EVERY}",
            "train.progress=false"]  # fmt: skip


def baseline(setting: str) -> str:
    return "fp32_2ranks" if "--nproc=2" in SETTINGS[setting] else "fp32"


def train(model: str, setting: str, seed: int, out: Path, frappe_epochs: int | None = None) -> dict:
    if frappe_epochs is None:
        config, data = "configs/demo.yaml", [f"model.name={model}", *MODELS[model], *DATA]
    else:
        config, data = f"configs/frappe/{model}.yaml", frappe_overrides(frappe_epochs)
    overrides = [*data, *SETTINGS[setting], f"seed={seed}"]
    options = [o for o in overrides if o.startswith("--")]
    cmd = ["recscale", "train", config, "--out", str(out), *options,
           *(o for o in overrides if not o.startswith("--"))]  # fmt: skip
    if not (out / "report.json").is_file():
        print("$", shlex.join(cmd), flush=True)
        exe = Path(sys.executable).with_name("recscale")
        subprocess.run([str(exe), *cmd[1:]], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    report = json.loads((out / "report.json").read_text())
    valid = {k: float("nan") if v is None else v for k, v in report["valid"].items()}  # null: a NaN metric
    windows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    comm = [w["comm"] for w in windows if w["split"] == "train" and "comm" in w]
    steps = sum(1 for w in windows if w["split"] == "train") * LOG_EVERY
    per_step = {
        kind: sum(c[kind]["intra"] + c[kind]["inter"] for c in comm) / steps if comm else None
        for kind in ("all_to_all", "all_reduce")
    }
    return {
        "model": model, "setting": setting, "seed": seed, "auc": valid["auc"],
        "logloss": valid["logloss"], "examples_per_s": report["examples_per_s"],
        "a2a_bytes_per_step": per_step["all_to_all"], "allreduce_bytes_per_step": per_step["all_reduce"],
        "command": shlex.join(cmd).replace(f" --out {out}", ""),
    }  # fmt: skip


def mean_std(xs: list[float], fmt: str) -> str:
    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{format(statistics.mean(xs), fmt)} ± {format(statistics.stdev(xs), fmt.lstrip('+'))}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=["wukong"], choices=list(MODELS))
    # bf16 only when asked: on a CPU without bf16 matmul instructions it is emulated, ~80x slower than fp32.
    ap.add_argument(
        "--settings", nargs="*", default=[s for s in SETTINGS if s != "bf16"], choices=list(SETTINGS)
    )
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    ap.add_argument("--data", choices=["synthetic", "frappe"], default="synthetic")
    ap.add_argument("--epochs", type=int, default=3, help="--data frappe: epochs each run trains")
    ap.add_argument("--out", default=str(REPO / "docs" / "precision"))
    args = ap.parse_args()
    settings = list(dict.fromkeys([baseline(s) for s in args.settings] + args.settings))
    frappe = args.data == "frappe"
    runs = REPO / "runs" / "precision" / (f"frappe_{args.epochs}ep" if frappe else "")

    rows = [
        train(m, s, seed, runs / m / s / f"seed{seed}", args.epochs if frappe else None)
        for m in args.models
        for s in settings
        for seed in args.seeds
    ]
    out = Path(args.out)
    write_csv(out, rows)

    by = {(r["model"], r["setting"], r["seed"]): r for r in rows}
    lines = [
        "| model | setting | valid AUC | ΔAUC vs fp32 (paired) | LogLoss | ΔLogLoss % (paired) | examples/s "
        "| ex/s vs fp32 | all-to-all B/step | all-reduce B/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in args.models:
        for s in settings:
            rs = [by[m, s, seed] for seed in args.seeds]
            base = [by[m, baseline(s), seed] for seed in args.seeds]
            d_auc = [r["auc"] - b["auc"] for r, b in zip(rs, base, strict=True)]
            d_ll = [100 * (r["logloss"] / b["logloss"] - 1) for r, b in zip(rs, base, strict=True)]
            speed = statistics.mean(r["examples_per_s"] for r in rs) / statistics.mean(
                b["examples_per_s"] for b in base
            )
            a2a, ar = rs[0]["a2a_bytes_per_step"], rs[0]["allreduce_bytes_per_step"]
            lines.append(
                f"| {m} | {s} | {mean_std([r['auc'] for r in rs], '.4f')} | {mean_std(d_auc, '+.5f')} "
                f"| {mean_std([r['logloss'] for r in rs], '.4f')} | {mean_std(d_ll, '+.2f')} "
                f"| {statistics.mean(r['examples_per_s'] for r in rs):,.0f} | {speed:.2f}x "
                f"| {f'{a2a:,.0f}' if a2a else ''} | {f'{ar:,.0f}' if ar else ''} |"
            )
    seeds = " ".join(map(str, args.seeds))
    data = f"--data frappe --epochs {args.epochs} " if frappe else ""
    cmd = f"python bench/precision.py {data}--models {' '.join(args.models)} --settings {' '.join(args.settings)} --seeds {seeds}"
    # Without --out a rerun would write the default table, docs/precision.
    if Path(args.out).resolve() != (REPO / "docs" / "precision").resolve():
        cmd += f" --out {args.out}"
    text = "\n".join([*lines, "", f"Seeds {seeds}, mean ± std. Command: `{cmd}`"])
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
