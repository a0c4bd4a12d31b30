"""Where one training step's time goes, op by op, without the profiler's overhead: every aten op of 3 steps of
the recipe's ``Trainer.train_step`` timed synchronously under a ``TorchDispatchMode`` (after autocast, so each op's
dtype is its real one), grouped by op and input shapes/dtypes/strides, then by op.

    python bench/op_time.py configs/frappe/wukong.yaml train.precision=bf16

Prints the untimed examples/s of 9 steps first (the dispatch mode itself costs a little per op).
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch
from profile_step import warm_trainer  # bench/profile_step.py (this script's folder is on sys.path)
from torch.utils._python_dispatch import TorchDispatchMode

STEPS = 3


def _signature(args: tuple) -> str:
    def one(a: torch.Tensor) -> str:
        strides = "" if a.is_contiguous() else f"s{a.stride()}"
        return f"{tuple(a.shape)}{str(a.dtype).removeprefix('torch.')}{strides}"

    return ",".join(one(a) for a in args if isinstance(a, torch.Tensor))


class OpTimer(TorchDispatchMode):
    """Seconds and calls per (op, input signature)."""

    def __init__(self) -> None:
        super().__init__()
        self.acc: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        entry = self.acc[(str(func), _signature(args))]
        entry[0] += 1
        entry[1] += time.perf_counter() - t0
        return out


def main() -> None:
    timer = OpTimer()
    with warm_trainer(sys.argv[1:], "op_time.py", STEPS) as (trainer, batches), timer:
        for b in batches:
            trainer.train_step(b)
    rows = sorted(timer.acc.items(), key=lambda kv: -kv[1][1])
    print(f"timed ops: {sum(v[1] for _, v in rows) / STEPS * 1e3:.0f} ms/step")
    for (op, sig), (calls, secs) in rows[:35]:
        print(f"{secs / STEPS * 1e3:7.1f} ms {calls / STEPS:4.0f}x {op[:34]:34s} {sig[:150]}")
    by_op: dict[str, float] = defaultdict(float)
    for (op, _), (_, secs) in rows:
        by_op[op] += secs / STEPS
    print("--- by op")
    for op, secs in sorted(by_op.items(), key=lambda kv: -kv[1])[:30]:
        print(f"{secs * 1e3:7.1f} ms {op}")


if __name__ == "__main__":
    main()
