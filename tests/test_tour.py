"""The README's tour runs as written, in order, in a fresh checkout's layout (../shared beside it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def tour_lines() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## A tour of the CLI") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "the README's tour has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


@pytest.mark.slow
def test_readme_tour_runs_as_written(tmp_path, shared_data):
    lines = tour_lines()
    assert lines[0].startswith("source .venv/bin/activate")
    # A checkout without runs/: the repository's files by link, ../shared beside it.
    clone = tmp_path / "main"
    clone.mkdir()
    for name in ("configs", ".venv"):
        (clone / name).symlink_to(REPO / name)
    (tmp_path / "shared").symlink_to(shared_data.parent)
    script = "set -euo pipefail\n" + "\n".join(lines) + "\n"
    # This checkout's code, whichever one the venv's install points at (a venv shared by several clones).
    env = os.environ | {"PYTHONPATH": str(REPO / "src")}
    r = subprocess.run(
        ["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "resumed from" in r.stderr and "(step 10," in r.stderr
    assert json.loads((clone / "runs" / "frappe" / "report.json").read_text())["steps"] == 20
    scores = [json.loads(x) for x in r.stdout.splitlines() if x.startswith('{"auc"')]
    assert len(scores) == 2 and scores[0]["rows"] == 57722 and scores[0]["auc"] > 0.8
    # --split valid: the run's own valid rows, valid.csv as the run read it: the same scores, grouped by user too
    assert scores[1] == scores[1] | scores[0] and scores[1]["gauc_by"] == "user"
    assert "usage: recscale train" in r.stdout
    assert "scored 57,722 rows: runs/frappe-scores.csv" in r.stdout
    assert len((clone / "runs" / "frappe-scores.csv").read_text().splitlines()) == 57723
