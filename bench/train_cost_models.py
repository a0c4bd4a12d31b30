"""Train the learned planner's cost models on the collected cost data and report their held-out error.

    PYTHONPATH=src .venv/bin/python bench/train_cost_models.py docs/sharding

Reads DIR/compute.csv, DIR/compute_plans.csv (where present) and DIR/comm.csv
(bench/sharding_costs.py), holds out every 5th task (compute) and every 5th row (comm), trains on the
rest, prints the MAPE on both parts (and on the plan-like shards alone), writes them to
DIR/cost_models.json and the models to recscale's shipped file (``planner.cost_model.SHIPPED``).
``--score MODELS`` only scores an existing cost-model file on DIR's compute data.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import numpy as np
import torch

from recscale.distributed.planner.cost_model import (
    SHIPPED,
    CommModel,
    ComputeModel,
    CostModels,
    comm_features,
    fit,
    mape,
)
from recscale.distributed.planner.features import TableFeatures
from recscale.io import atomic_write_text

HOLD_OUT_EVERY = 5


def shard_inputs(shards: list[list[list[float]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables of each shard as (N, T_max, inputs) with an (N, T_max) mask."""
    t_max = max(len(s) for s in shards)
    vecs = [[TableFeatures("", int(r[0]), int(r[1]), r[2], tuple(r[3:])).vector() for r in s] for s in shards]
    x = np.zeros((len(shards), t_max, len(vecs[0][0])), dtype=np.float32)
    mask = np.zeros((len(shards), t_max), dtype=np.float32)
    for i, v in enumerate(vecs):
        x[i, : len(v)], mask[i, : len(v)] = v, 1
    return torch.from_numpy(x), torch.from_numpy(mask)


def read(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def errors(pred: np.ndarray, ms: np.ndarray, held: np.ndarray) -> dict[str, float]:
    return {"train_rows": int((~held).sum()), "held_out_rows": int(held.sum()),
            "train_mape": mape(pred[~held], ms[~held]), "held_out_mape": mape(pred[held], ms[held])}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("data", type=Path)
    p.add_argument("--out", type=Path, default=SHIPPED)
    p.add_argument(
        "--score", type=Path, metavar="MODELS", help="only print MODELS' compute MAPE on DIR's shards"
    )
    a = p.parse_args()
    torch.set_num_threads(1)
    report = {}

    plans = a.data / "compute_plans.csv"
    plan_rows = read(plans) if plans.exists() else []
    rows = read(a.data / "compute.csv") + plan_rows
    from_plans = np.arange(len(rows)) >= len(rows) - len(plan_rows)
    held = np.array([int(r["task"]) % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1 for r in rows])
    x, mask = shard_inputs([json.loads(r["tables"]) for r in rows])
    ms = np.array([float(r["ms"]) for r in rows])
    if a.score:
        with torch.no_grad():
            pred = CostModels.load(a.score).compute(x, mask).exp().numpy()
        for name, part in (("compute.csv", ~from_plans), ("compute_plans.csv", from_plans)):
            print(f"{a.score} on {name}: MAPE {mape(pred[part], ms[part]):.1f}%, "
                  f"mean predicted / measured {np.mean(pred[part] / ms[part]):.3f}")  # fmt: skip
        return
    compute = ComputeModel()
    fit(compute, (x[~held], mask[~held]), torch.log(torch.from_numpy(ms[~held]).float()), epochs=3000)
    with torch.no_grad():
        pred = compute(x, mask).exp().numpy()
    report["compute"] = errors(pred, ms, held)
    if plan_rows:
        report["compute_plan_shards"] = errors(pred[from_plans], ms[from_plans], held[from_plans])

    rows = read(a.data / "comm.csv")
    held = np.arange(len(rows)) % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1
    feats = torch.from_numpy(comm_features(np.array([[int(d) for d in r["dims"].split()] for r in rows])))
    ms = np.array([float(r["ms"]) for r in rows])
    comm = CommModel()
    fit(comm, (feats[~held],), torch.log(torch.from_numpy(ms[~held]).float()), epochs=3000)
    with torch.no_grad():
        pred = comm(feats).exp().numpy()
    report["comm"] = errors(pred, ms, held)

    CostModels(compute, comm).save(a.out)
    atomic_write_text(a.data / "cost_models.json", json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
