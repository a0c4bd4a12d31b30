"""Training speed against FuxiCTR's WuKong, side by side: same data (Frappe), same model config, same run.

    python bench/vs_fuxictr.py --rounds 3                       # FuxiCTR, recscale fp32, recscale bf16
    python bench/vs_fuxictr.py --rounds 1 --precision bf16

Each round trains FuxiCTR's WuKong (``../shared/peers/fuxictr/examples/frappe``: d = 64, 3 layers,
n_F = n_L = k = 16, FMB MLP [512], final MLP [512, 256], dropout 0.3, batch 4096, Adam) and then
``recscale train configs/frappe/wukong.yaml`` (the same model) once per precision, 2 epochs each, in turn,
so drift of the shared machine hits every variant alike. Both at the machine's default thread count.

The figure is the same for both: examples/s of the second epoch's training, from its first step's end
to its last step's end (data loading included, evaluation and the first step's warm-up excluded).
FuxiCTR: the epoch's wall time between its log lines, less its first iteration (tqdm's first s/it);
recscale: ``train.log_every=1``, the per-step records of ``metrics.jsonl``. The medians over rounds and
their ratios to FuxiCTR's are printed as a markdown table, with recscale's dense FLOP utilisation: training
FLOP/s (3 x the model's analytic forward FLOPs per example x examples/s) over the matmul peak of its
precision (bench/speed.py's ``matmul_peak``, the better of a measurement before and after the rounds).

FuxiCTR's environment is made once by ``../shared/peers/fuxictr/setup.sh`` (``--fuxictr-venv``).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

import torch
from speed import matmul_peak  # bench/speed.py (this script's folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]
PEER = REPO.parent / "shared" / "peers" / "fuxictr"
DATA = REPO.parent / "shared" / "data"
EXPID = "WuKong_frappe_suite"
STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def fuxictr_config(root: Path) -> Path:
    """The peer's example config with its DATA and ROOT placeholders filled in."""
    cfg = root / "config"
    cfg.mkdir(parents=True)
    for f in (PEER / "examples" / "frappe").glob("*.yaml"):
        text = f.read_text().replace("DATA", str(DATA)).replace("ROOT", str(root))
        (cfg / f.name).write_text(text)
    return cfg


def stamp(line: str) -> datetime | None:
    m = STAMP.search(line)  # tqdm's bar may stand before it on the same line
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f") if m else None


def fuxictr_rate(log: str, epoch: int = 2) -> float:
    """Examples/s of ``epoch``'s training in a FuxiCTR log (see the module doc)."""
    rows = int(re.search(r"Train samples: total/(\d+)", log).group(1))  # type: ignore[union-attr]
    batch = int(re.search(r'"batch_size": "(\d+)"', log).group(1))  # type: ignore[union-attr]
    start = end = first = None
    seen = 0
    for line in log.replace("\r", "\n").splitlines():
        t = stamp(line)
        if t and ("Epoch=1 start" in line or "end ****" in line):
            seen += 1
            if seen == epoch:
                start = t
        elif start and end is None:
            # tqdm prints a fast first step as it/s, a slow one as s/it
            m = re.search(r"\s1/\d+ \[[^,]*,\s+([\d.]+)(s/it|it/s)\]", line)
            if m and first is None:
                first = float(m.group(1)) if m.group(2) == "s/it" else 1 / float(m.group(1))
            if t and "Train loss" in line:
                end = t
    if start is None or end is None or first is None:
        raise SystemExit(f"FuxiCTR's log has no complete epoch {epoch}; its tail:\n{log[-2000:]}")
    return (rows - batch) / ((end - start).total_seconds() - first)


def recscale_rate(run: Path, epoch: int = 1) -> float:
    """Examples/s of 0-based ``epoch``'s training in a run logged every step (see the module doc)."""
    report = json.loads((run / "report.json").read_text())
    batch = report["examples"] // report["steps"]
    steps = [
        json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in line
    ]
    # The first window starts the epoch's loader; FuxiCTR's first iteration is dropped alike.
    rates = [r["examples_per_s"] for r in steps if r["epoch"] == epoch][1:]
    return len(rates) * batch / sum(batch / r for r in rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--fuxictr-venv", default="/tmp/fuxictr-venv")
    args = ap.parse_args()
    venv = Path(args.fuxictr_venv)
    if not (venv / "bin" / "python").exists():
        subprocess.run(["bash", str(PEER / "setup.sh"), str(venv)], check=True)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    peaks = {p: matmul_peak({}, dtype=dtypes[p]) for p in args.precision}
    rates: dict[str, list[float]] = {"FuxiCTR WuKong": [], **{f"recscale {p}": [] for p in args.precision}}
    mflops = 0.0
    exe = Path(sys.executable).with_name("recscale")
    with tempfile.TemporaryDirectory(prefix="recscale-vs-fuxictr-") as tmp:
        cfg = fuxictr_config(Path(tmp) / "fuxictr")
        for i in range(args.rounds):
            log = subprocess.run(
                ["bash", str(PEER / "run.sh"), str(venv), str(cfg), EXPID],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                check=True,
            ).stdout  # fmt: skip (its tqdm bars go to stdout, its log lines to stderr)
            rates["FuxiCTR WuKong"].append(fuxictr_rate(log))
            for p in args.precision:
                out = Path(tmp) / f"recscale-{p}-{i}"
                subprocess.run(
                    [str(exe), "train", "configs/frappe/wukong.yaml", "--out", str(out), "train.epochs=2",
                     "train.log_every=1", "train.progress=false", f"train.precision={p}"],
                    cwd=REPO, check=True, capture_output=True,
                )  # fmt: skip
                rates[f"recscale {p}"].append(recscale_rate(out))
                mflops = json.loads((out / "report.json").read_text())["mflops_per_example"]
            print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in rates.items()), flush=True)
    peaks = {p: max(peak, matmul_peak({}, dtype=dtypes[p])) for p, peak in peaks.items()}
    base = statistics.median(rates["FuxiCTR WuKong"])
    print(f"\nmatmul peak GFLOP/s: {', '.join(f'{p} {v:.0f}' for p, v in peaks.items())}; "
          f"{mflops:.2f} MFLOP/example forward, {torch.get_num_threads()} threads")  # fmt: skip
    print("\n| trainer | examples/s (median) | rounds | ratio to FuxiCTR | dense FLOP utilisation |")
    print("|---|---|---|---|---|")
    for name, values in rates.items():
        med = statistics.median(values)
        p = name.removeprefix("recscale ")
        util = f"{3 * mflops * 1e6 * med / 1e9 / peaks[p]:.0%} of {p} peak" if p in peaks else ""
        print(
            f"| {name} | {med:,.0f} | {', '.join(f'{v:,.0f}' for v in values)} | {med / base:.2f} | {util} |"
        )


if __name__ == "__main__":
    main()
