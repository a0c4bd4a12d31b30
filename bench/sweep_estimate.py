"""Estimate a sweep's wall time from short measured runs, without running it.

    OMP_NUM_THREADS=1 python bench/sweep_estimate.py configs/sweeps/small.yaml   # prints one JSON line

Per model size of the sweep, the real ``Trainer`` is built on a few batches of the same data and model,
and timed: start-up (model and sharding), training examples/s (``bench/speed.py``'s step loop, after
warm-up) and evaluation rows/s. Data preparation (generating or reading, fitting the vocabularies,
materialising) is timed once on ``--data-rows`` training rows. The estimate scales these to the
sweep's rows: data once, then per run (every length and seed of a size) start-up + its training rows
(its length, else the whole split) / examples/s + (2 x valid + test rows) / eval rows/s (the trainer
evaluates valid at the end of the epoch and again for the report).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
import warnings
from pathlib import Path

from speed import measure


def with_rows(cfg, rows: dict[str, int]):
    data = cfg.data.model_copy(update={"synthetic": cfg.data.synthetic.model_copy(update={"rows": rows})})
    return cfg.model_copy(update={"data": data})


def time_data(cfg, rows: int, tmp: Path) -> float:
    """Seconds per training row to fit the preprocessing and materialise the split."""
    from recscale.train.data import fit_train_split

    small = with_rows(cfg, {"train": rows})
    t0 = time.perf_counter()
    fit_train_split(small.data, tmp / "data-probe", progress=False)
    return (time.perf_counter() - t0) / rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("sweep")
    p.add_argument("--steps", type=int, default=6, help="timed training steps per run")
    p.add_argument("--data-rows", type=int, default=200_000)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from recscale.scaling.sweep import load_sweep
    from recscale.train.evaluate import eval_batch_size, evaluate
    from recscale.train.loop import Trainer

    _, runs = load_sweep(args.sweep)
    base = runs[0].config
    if base.data.format != "synthetic":
        raise SystemExit("sweep_estimate scales synthetic rows; give a sweep on synthetic data")
    full = base.data.synthetic.rows
    sizes: dict[tuple[str, str], list] = {}  # the runs of each (family, size): one timing serves them all
    for run in runs:
        sizes.setdefault((run.family, json.dumps(run.knobs)), []).append(run)
    estimates = []
    with tempfile.TemporaryDirectory(prefix="recscale-estimate-") as d:
        tmp = Path(d)
        data_s = time_data(base, args.data_rows, tmp) * sum(full.values())
        for mine in sizes.values():
            run = mine[0]
            batch = run.config.train.batch_size
            cfg = with_rows(run.config, {"train": batch * args.steps, "valid": 4 * batch, "test": batch})
            t0 = time.perf_counter()
            trainer = Trainer(cfg, tmp / run.name)
            startup = time.perf_counter() - t0
            speed = measure(trainer, batch, args.steps, warmup=2)
            rate = speed["examples_per_s"]
            t0 = time.perf_counter()
            evaluate(trainer.module, trainer.valid_ds, eval_batch_size(batch), 0, cfg.train.precision)
            eval_rate = 4 * batch / (time.perf_counter() - t0)
            per_run = startup + (2 * full["valid"] + full["test"]) / eval_rate
            seconds = sum(per_run + (r.length or full["train"]) / rate for r in mine)
            estimates.append({"size": run.point, "runs": len(mine), "mflops_per_example": speed["mflops_per_example"],
                              "examples_per_s": round(rate), "seconds": round(seconds)})  # fmt: skip
    total = data_s + sum(e["seconds"] for e in estimates)
    print(json.dumps({"bench": "sweep_estimate", "sweep": args.sweep, "runs": len(runs), "data_s": round(data_s),
                      "total_s": round(total), "total_min": round(total / 60, 1), "sizes": estimates}))  # fmt: skip


if __name__ == "__main__":
    main()
