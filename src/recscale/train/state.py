"""What a run carries between steps and across a resume: its progress, the RNG, its metric log."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


@dataclass
class Progress:
    """Where the run is: enough, with the checkpointed tensors, to continue exactly."""

    epoch: int = 0
    batch: int = 0  # batches of this epoch already trained
    step: int = 0
    best: float | None = None
    best_step: int = 0
    bad_evals: int = 0
    lr_scale: float = 1.0  # reduced on plateau
    train_seconds: float = 0.0
    examples: int = 0
    stopped_early: bool = False


def rng_state() -> dict[str, str]:
    return {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}


def set_rng_state(s: dict[str, str]) -> None:
    torch.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(s["torch"]), dtype=np.uint8).copy()))


class RunLog:
    """metrics.jsonl and TensorBoard, written by rank 0 only."""

    def __init__(self, run_dir: Path, main: bool) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.path = run_dir / "metrics.jsonl"
        self.tb = SummaryWriter(str(run_dir / "tb")) if main else None

    def __call__(self, record: dict[str, Any]) -> None:
        if self.tb is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for k, v in record.items():
            if isinstance(v, int | float) and k not in ("step", "epoch"):
                self.tb.add_scalar(f"{record.get('split', 'train')}/{k}", v, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
