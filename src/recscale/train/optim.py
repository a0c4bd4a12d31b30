"""Optimizers: TorchRec fused optimizers for embedding tables, torch optimizers for the dense part.

Embedding tables get their optimizer *in backward* (``apply_optimizer_in_backward``); when
``DistributedModelParallel`` shards them, fbgemm fuses the update into the table-batched backward
kernel (row-wise Adagrad by default), so dense gradients of huge tables are never materialised.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from recscale.config import OptimizerConfig, TrainConfig
from recscale.errors import ConfigError

# fbgemm's CPU kernels implement only these fused table optimizers (GPU adds adam and others).
CPU_SPARSE_OPTIMIZERS = ("rowwise_adagrad", "adagrad", "sgd")


def sparse_optimizer(
    cfg: OptimizerConfig, device: torch.device, dense_tables: bool = False
) -> tuple[type[torch.optim.Optimizer], dict]:
    """(optimizer class, kwargs) for ``apply_optimizer_in_backward`` on embedding tables.

    With ``dense_tables`` (every table data_parallel) the trainer steps a torch optimizer over the
    replicas' dense gradients, so any optimizer works on CPU and ``weight_decay`` is the coupled L2 of
    whole tables (FuxiCTR's embedding_regularizer under Adam). fbgemm-gpu-cpu 1.8's fused kernels
    ignore weight decay (measured), so it is refused for them (config validation).
    """
    if device.type == "cpu" and not dense_tables and cfg.name not in CPU_SPARSE_OPTIMIZERS:
        raise ConfigError(
            f"train.sparse_optimizer.name '{cfg.name}' has no fused CPU kernel in fbgemm; "
            f"on CPU use one of {', '.join(CPU_SPARSE_OPTIMIZERS)}, or make every table "
            "data_parallel (distributed.sharding=data_parallel) to train them with a torch optimizer"
        )
    decay = {"weight_decay": cfg.weight_decay} if cfg.weight_decay else {}
    table = {
        "rowwise_adagrad": (RowWiseAdagrad, {"lr": cfg.lr, "eps": cfg.eps, **decay}),
        "adagrad": (torch.optim.Adagrad, {"lr": cfg.lr, "eps": cfg.eps, **decay}),
        "sgd": (torch.optim.SGD, {"lr": cfg.lr, **decay}),
        "adam": (torch.optim.Adam, {"lr": cfg.lr, "eps": cfg.eps, **decay}),
    }
    return table[cfg.name]


def dense_optimizer_factory(cfg: OptimizerConfig) -> Callable[[Iterable], torch.optim.Optimizer]:
    lr, wd, eps = cfg.lr, cfg.weight_decay, cfg.eps
    factories: dict[str, Callable[[Iterable], torch.optim.Optimizer]] = {
        "adam": lambda p: torch.optim.Adam(p, lr=lr, eps=eps, weight_decay=wd),
        "adamw": lambda p: torch.optim.AdamW(p, lr=lr, eps=eps, weight_decay=wd),
        "sgd": lambda p: torch.optim.SGD(p, lr=lr, weight_decay=wd),
        "adagrad": lambda p: torch.optim.Adagrad(p, lr=lr, eps=eps, weight_decay=wd),
    }
    return factories[cfg.name]


def lr_factor(cfg: TrainConfig, step: int, total_steps: int) -> float:
    """Multiplier of the dense learning rate at ``step``: linear warm-up, then none/linear/cosine decay."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_decay == "none" or total_steps <= cfg.warmup_steps:
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    if cfg.lr_decay == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))
