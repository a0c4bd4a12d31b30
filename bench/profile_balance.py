"""Where a balanced multi-rank step of bench/balance.py's sequence job spends its time (docs/SEQUENCES.md).

    PYTHONPATH=src .venv/bin/python bench/profile_balance.py --world 2

The heavy setting of docs/SEQUENCES.md (batch 128, histories up to 512 ids with Zipf(1.0) lengths, d = 64,
2 causal blocks, pow2 buckets, ``distributed.balance: flops``) on ``--world`` gloo ranks, one thread each:
4 warm-up steps, then ``torch.profiler`` around ``--steps`` steps of the trainer's ``train_step``. Rank 0
prints the mean step time and its profile by total CPU time (gloo collectives, TorchRec's awaitables,
optimizers and kernels).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

from balance import REPO, overrides  # bench/ is on sys.path


def worker(root: str, steps: int) -> None:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from recscale.config import load_config
    from recscale.distributed.env import shutdown
    from recscale.train.loop import Trainer

    logging.disable(logging.WARNING)
    args = argparse.Namespace(batch=128, steps=steps + 4, max_len=512, alpha=1.0, dim=64, encoder_layers=2,
                              buckets="pow2")  # fmt: skip
    cfg = load_config(REPO / "configs/demo.yaml", [*overrides(args), "distributed.balance=flops"])
    trainer = Trainer(cfg, Path(root) / "run")
    batches = [b for _, b in zip(range(args.steps), trainer._epoch(), strict=False)]
    for b, size in batches[:4]:
        trainer.train_step(b, size)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for b, size in batches[4:]:
            trainer.train_step(b, size)
        dist.barrier()
        step_ms = (time.perf_counter() - t0) / steps * 1e3
    if dist.get_rank() == 0:
        print(f"step {step_ms:.1f} ms (mean of {steps}); profile of rank 0 over those steps:")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=45, max_name_column_width=60))
    trainer.log.close()
    shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="profiled steps, after 4 warm-up steps")
    args = p.parse_args()
    from recscale.distributed.launch import launch

    with tempfile.TemporaryDirectory(prefix="recscale-profile-") as tmp:
        launch([__file__, "worker", tmp, str(args.steps)], args.world, args.world, 0)


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2], int(sys.argv[3]))
    else:
        main()
