"""Where one training step's time goes: the recipe's ``Trainer.train_step`` on prebuilt batches.

    python bench/profile_step.py configs/frappe/wukong.yaml train.precision=bf16
    python bench/profile_step.py configs/frappe/wukong.yaml train.precision=bf16 train.compile=true

Builds the run's trainer (data prepared as ``recscale train`` does), takes 3 warm-up steps, times 9 steps
(examples/s and dense GFLOP/s, 3 x the analytic forward FLOPs), then profiles 5 steps with torch.profiler and
prints the ops by self CPU time, grouped by input shape (ms per step).
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from recscale.config import load_config
from recscale.data.batch import Batch
from recscale.data.dataset import epoch_batches, iterate
from recscale.train.loop import Trainer


@contextmanager
def warm_trainer(argv: list[str], usage: str, steps: int) -> Iterator[tuple[Trainer, list[Batch]]]:
    """The run's trainer for ``CONFIG [key=value ...]`` (``argv``) after 3 warm-up steps and 9 timed ones
    (examples/s and dense GFLOP/s printed), with ``steps`` more batches to measure."""
    if argv[:1] in (["-h"], ["--help"]):  # else read as the config's path: a traceback, "config file --help"
        print(f"usage: {usage} CONFIG [key=value ...]\n{sys.modules['__main__'].__doc__}")
        raise SystemExit(0)
    if not argv:
        raise SystemExit(f"usage: {usage} CONFIG [key=value ...]")
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    cfg = load_config(Path(argv[0]), ["train.progress=false", "data.num_workers=0", *argv[1:]])
    with tempfile.TemporaryDirectory(prefix="recscale-profile-") as tmp:
        trainer = Trainer(cfg, Path(tmp) / "run")
        batch = cfg.train.batch_size
        index = epoch_batches(len(trainer.train_ds), batch, seed=0, epoch=0, drop_last=True)
        batches = list(iterate(trainer.train_ds, index[: 12 + steps]))
        trainer.module.train()
        for b in batches[:3]:
            trainer.train_step(b)
        t0 = time.perf_counter()
        for b in batches[3:12]:
            trainer.train_step(b)
        rate = 9 * batch / (time.perf_counter() - t0)
        flops = 3 * trainer.built.flops_per_example
        print(
            f"{rate:,.0f} examples/s, {flops * rate / 1e9:.0f} dense GFLOP/s ({flops / 3e6:.2f} MFLOP/example)"
        )
        yield trainer, batches[12:]


def main() -> None:
    with warm_trainer(sys.argv[1:], "profile_step.py", 5) as (trainer, batches):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for b in batches:
                trainer.train_step(b)
    events = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
    print(f"profiled: {sum(e.self_cpu_time_total for e in events) / 5e3:.0f} ms/step")
    for e in events[:30]:
        print(
            f"{e.key:45s} {e.count / 5:5.0f}/step {e.self_cpu_time_total / 5e3:7.1f} ms  {str(e.input_shapes)[:90]}"
        )


if __name__ == "__main__":
    main()
