"""A benchmark's result table as OUT.md (with the command that made it) and its rows as OUT.csv."""

from __future__ import annotations

import csv
import sys
from pathlib import Path


def write_report(out: Path, text: str, rows: list[dict]) -> None:
    out.with_suffix(".md").write_text(text + "\n\nCommand: `" + " ".join(["python", *sys.argv]) + "`\n")
    write_csv(out, rows)


def print_report(lines: list[str], rows: list[dict], out: Path | None) -> None:
    """Print a bench's markdown ``lines``; with ``out``, also write them as OUT.md and ``rows`` as OUT.csv."""
    text = "\n".join(lines)
    print(text)
    if out:
        write_report(out, text, rows)


def write_csv(out: Path, rows: list[dict]) -> None:
    """``rows`` as OUT.csv, with the first row's keys as the header."""
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
