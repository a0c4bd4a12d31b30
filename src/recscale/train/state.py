"""What a run carries between steps and across a resume: its progress, the RNG, its metric log."""

from __future__ import annotations

import base64
import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recscale.config import EarlyStopping
from recscale.io import atomic_write_text, naming, strict_json

HIGHER_IS_BETTER = {"auc": True, "logloss": False, "ne": False, "gauc": True}


def watched_metric(metrics: dict[str, float], es: EarlyStopping) -> str:
    """The metric early stopping compares in ``metrics``: ``es.metric``, or LogLoss where that is AUC or NE
    and the split has one class. Both are undefined (NaN) there at every evaluation, so the run stopped
    after ``patience`` of them at step 0; LogLoss still measures the model. NaN with a LogLoss that is not
    NaN means one class: NaN logits (a diverged model) make the LogLoss NaN too, and count as no
    improvement."""
    if math.isnan(metrics[es.metric]) and not math.isnan(metrics["logloss"]):
        return "logloss"
    return es.metric


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
    # The open log window (train.log_every): the sum over its steps of the loss (mean over ranks), its steps,
    # its wall seconds. Checkpointed, so a resumed run logs the windows an uninterrupted one logs: its first
    # covered only the steps since the resume, logged at a step of the full interval.
    window_loss: float = 0.0
    window_steps: int = 0
    window_seconds: float = 0.0

    def improves(self, metrics: dict[str, float], es: EarlyStopping) -> bool:
        """Whether ``metrics`` beat the best evaluation so far by more than ``es.min_delta``. A NaN metric
        (AUC of a one-class split, a diverged loss) is worse than any number and never improves: kept as
        the best, it made every later comparison false. A NaN best (a checkpoint written before that)
        counts as none. A split of one class is compared by LogLoss (``watched_metric``)."""
        metric = watched_metric(metrics, es)
        value, sign = metrics[metric], 1 if HIGHER_IS_BETTER[metric] else -1
        if math.isnan(value):
            return False
        return self.best is None or math.isnan(self.best) or sign * (value - self.best) > es.min_delta

    def record_eval(self, metrics: dict[str, float], improved: bool, es: EarlyStopping) -> bool:
        """Update early stopping after an evaluation (a plateau may cut the LR); True to restore
        the best weights now (``es.restore_best``, on a plateau that does not stop the run)."""
        if improved:
            self.best, self.best_step, self.bad_evals = metrics[watched_metric(metrics, es)], self.step, 0
            return False
        self.bad_evals += 1
        self.stopped_early = self.bad_evals >= es.patience
        if es.reduce_lr_factor is not None:
            self.lr_scale *= es.reduce_lr_factor
        return es.restore_best and not self.stopped_early


def rng_state() -> dict[str, str]:
    """The global torch generator's state and, on a GPU, the current device's: dropout draws from the
    device's generator there, which a resume otherwise restarted from the seed (masks of the first steps)."""
    s = {"torch": _encode(torch.get_rng_state())}
    if torch.cuda.is_available():
        s["cuda"] = _encode(torch.cuda.get_rng_state())
    return s


def set_rng_state(s: dict[str, str]) -> None:
    """Restore ``rng_state``'s generators; a device's state only on a GPU (a CPU resume of a GPU run has none)."""
    torch.set_rng_state(_decode(s["torch"]))
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(_decode(s["cuda"]))


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def _decode(text: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype=np.uint8).copy())


def _quiet_tb_writer(args: threading.ExceptHookArgs) -> None:
    """``threading.excepthook``, less the traceback of TensorBoard's writer thread dead of an OSError (a full
    disk): the writer raises that error again in the thread that logs, at its next call, which ``RunLog``
    names tb/ in, the command's one line."""
    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    if not (isinstance(args.thread, _AsyncWriterThread) and isinstance(args.exc_value, OSError)):
        _THREAD_HOOK(args)


_THREAD_HOOK = threading.excepthook


class RunLog:
    """metrics.jsonl and TensorBoard, written by rank 0 only."""

    def __init__(self, run_dir: Path, main: bool, resumed_at: int | None = None) -> None:
        """``resumed_at``: the step a resumed run continues from; TensorBoard then hides what a killed
        attempt logged after it (as ``truncate`` drops it from metrics.jsonl)."""
        from torch.utils.tensorboard import SummaryWriter

        self.path, self.tb_dir = run_dir / "metrics.jsonl", run_dir / "tb"
        purge = None if resumed_at is None else resumed_at + 1
        if main:
            threading.excepthook = _quiet_tb_writer
        with naming(self.tb_dir):
            self.tb = SummaryWriter(str(self.tb_dir), purge_step=purge) if main else None
        if main:  # there from the start, as the README lists it: a run that logs no record has it empty
            with naming(self.path):
                self.path.touch()

    def __call__(self, record: dict[str, Any]) -> None:
        if self.tb is None:
            return
        with naming(self.path), open(self.path, "a") as f:
            f.write(strict_json(record) + "\n")
        with naming(self.tb_dir):
            for k, v in record.items():
                if isinstance(v, int | float) and k not in ("step", "epoch"):
                    self.tb.add_scalar(f"{record.get('split', 'train')}/{k}", v, record["step"])

    def truncate(self, step: int) -> None:
        """Forget the records after ``step`` (what a killed attempt logged after its last checkpoint)."""
        if self.tb is None or not self.path.is_file():
            return
        keep = []
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by the kill
                continue
            # Anything else that is not one of our records (an edited file) goes too: the log is rewritten.
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
                keep.append(line + "\n")
        atomic_write_text(self.path, "".join(keep))

    def close(self) -> None:
        if self.tb is not None:
            with naming(self.tb_dir):
                self.tb.close()
