"""Upstream notices a user cannot act on, silenced in every recscale process (the CLI, and the server's
worker processes, which start afresh): ShardedTensor and torch.jit deprecations inside TorchRec, fbgemm
and DCP. Every other warning reaches the user; recscale's own as one line, ``warning: ...``."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

_NOISY = (
    (FutureWarning, r"torch\.distributed\.checkpoint|torchrec"),
    (DeprecationWarning, r"torch\.jit|fbgemm_gpu|torchrec|torchmetrics"),
)


_PACKAGE = Path(__file__).resolve().parent
_format_upstream = warnings.formatwarning


def _format(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    # Python's format (path, line number, category, the source line) is for developers; recscale's
    # warnings are for users, worded as its errors are.
    if Path(filename).resolve().is_relative_to(_PACKAGE):
        return f"warning: {message}\n"
    return _format_upstream(message, category, filename, lineno, line)


def quiet_upstream() -> None:
    warnings.formatwarning = _format
    for category, module in _NOISY:
        warnings.filterwarnings("ignore", category=category, module=module)
    # Raised (from torch.autograd) on every backward through fbgemm's dense (replicated-table) lookup. Its
    # gradients are right: data_parallel tables train alike with one or N ranks (tests/test_distributed.py).
    warnings.filterwarnings(
        "ignore", r"fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel", UserWarning
    )
    # Collectives TorchRec's row-wise reduce-scatter and FSDP2 call, deprecated in torch: each rank warned once.
    warnings.filterwarnings(
        "ignore",
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        FutureWarning,
    )
    # TorchRec's sharded tables are ShardedTensors; torch warns wherever one is touched (export, checkpoints).
    warnings.filterwarnings(
        "ignore", r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning
    )
    for name in ("torchrec", "torch.distributed", "torch.fx", "fbgemm_gpu"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
