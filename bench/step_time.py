"""Training step time of whole ``recscale train`` runs, side by side: the steady-state examples/s the
trainer logs per window of ``train.log_every`` steps (``metrics.jsonl``; the first window, with its
warm-up, is dropped), the median over a run's windows; no start-up, data preparation or evaluation.

    python bench/step_time.py --runs 3 --label new -- .venv/bin/recscale train CONFIG ... \\
        --vs old -- env PYTHONPATH=/tmp/old/src .venv/bin/python -m recscale.cli train CONFIG ...

Each variant is ``--label NAME -- COMMAND...`` (a ``--out DIR`` is appended per run). Variants run in
turn (A B C A B C ...), so drift of a shared machine hits each alike; the table gives each variant's
median examples/s and its ratio to the first variant's median.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

USAGE = "usage: step_time.py [--runs N] --label NAME -- CMD... [--vs NAME -- CMD...]..."


def parse(argv: list[str]) -> tuple[int, list[tuple[str, list[str]]]]:
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{USAGE}\n{__doc__}")
        raise SystemExit(0)
    runs = 3
    if argv[:1] == ["--runs"]:
        if len(argv) < 2 or not argv[1].isdecimal() or int(argv[1]) < 1:
            raise SystemExit(f"--runs takes a number of runs >= 1; {USAGE}")
        runs, argv = int(argv[1]), argv[2:]
    variants: list[tuple[str, list[str]]] = []
    while argv:
        if argv[0] not in ("--label", "--vs") or len(argv) < 3 or argv[2] != "--":
            raise SystemExit(USAGE)
        name, argv = argv[1], argv[3:]
        end = next((i for i, a in enumerate(argv) if a == "--vs"), len(argv))
        variants.append((name, argv[:end]))
        argv = argv[end:]
    if not variants:  # else an IndexError once nothing has run
        raise SystemExit(USAGE)
    return runs, variants


def main() -> None:
    runs, variants = parse(sys.argv[1:])
    rates: dict[str, list[float]] = {name: [] for name, _ in variants}
    with tempfile.TemporaryDirectory(prefix="recscale-steptime-") as tmp:
        for i in range(runs):
            for name, cmd in variants:
                out = Path(tmp) / f"{name}-{i}"
                subprocess.run([*cmd, "--out", str(out)], check=True, capture_output=True)
                records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
                windows = [r["examples_per_s"] for r in records if r["split"] == "train"][1:]
                rates[name].append(statistics.median(windows))
    first = statistics.median(rates[variants[0][0]])
    print("| variant | examples/s (median) | runs | ratio to " + variants[0][0] + " |\n|---|---|---|---|")
    for name, _ in variants:
        med = statistics.median(rates[name])
        print(f"| {name} | {med:,.0f} | {', '.join(f'{r:,.0f}' for r in rates[name])} | {med / first:.3f} |")


if __name__ == "__main__":
    main()
