"""``recscale shard plan CONFIG --out PLAN``: the sharding plan a run of CONFIG would train with, as
readable JSON: each table's TorchRec ``ParameterSharding`` (type, kernel, ranks, shards) and, for
``distributed.sharding: learned``, the features it was planned with and the predicted per-rank cost
and memory."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from recscale.config import RunConfig
from recscale.distributed.env import DistEnv
from recscale.distributed.sharding import Prediction, predicted_plan
from recscale.errors import ConfigError
from recscale.io import atomic_write_text, scratch_dir
from recscale.models.registry import build_model
from recscale.train.build import feature_set, planner_sample
from recscale.train.data import prepare_run_data


def shard_plan(cfg: RunConfig, world: int, local_world: int, out: Path) -> dict[str, Any]:
    """Plan CONFIG's tables over ``world`` ranks (``local_world`` per host), write the plan to ``out``."""
    if cfg.dmt is not None:  # a flat plan of distributed.sharding would not be the plan it trains with
        raise ConfigError(
            "shard plan: the config trains DMT (dmt:), where each host shards its tower's tables by "
            f"dmt.sharding ({cfg.dmt.sharding}) over its own ranks; shard plan plans flat runs: drop dmt"
        )
    # Planning reads the vocabularies and a sample of training rows: the valid and test files are not read.
    data = cfg.data
    if data.format != "synthetic" and data.prepared is None:
        data = data.model_copy(update={"valid": None, "test": None, "report_fraction": None})
    with scratch_dir("recscale-shard-plan-") as tmp:
        show = cfg.train.progress and sys.stderr.isatty()
        pre, splits, _ = prepare_run_data(data, Path(tmp), resume=False, main=True, progress=show)
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model.name, feature_set(pre), cfg.model.embedding, cfg.model.params)
        env = DistEnv(0, world, local_world, torch.device("cpu"), "gloo")
        start = time.perf_counter()
        plan, prediction = predicted_plan(
            model, env, cfg.distributed, None, planner_sample(cfg, splits["train"])
        )
        seconds = time.perf_counter() - start
    tables = {
        name: {
            "type": ps.sharding_type,
            "kernel": ps.compute_kernel,
            "ranks": ps.ranks,
            "shards": [
                {"rank": m.placement.rank(), "offsets": m.shard_offsets, "sizes": m.shard_sizes}
                for m in (ps.sharding_spec.shards if ps.sharding_spec is not None else [])
            ],
        }
        for module_plan in plan.plan.values()
        for name, ps in module_plan.items()
    }
    doc = {
        "sharding": cfg.distributed.sharding,
        "world_size": world,
        "local_world_size": local_world,
        "planning_seconds": round(seconds, 3),
        "predicted": _predicted(prediction, tables) if prediction is not None else None,
        "tables": tables,
    }
    atomic_write_text(out, json.dumps(doc, indent=2) + "\n")
    return doc


def _predicted(p: Prediction, tables: dict[str, dict]) -> dict[str, Any]:
    for name, f in zip(p.tables, p.features, strict=True):
        tables[name]["features"] = {"rows": f.rows, "dim": f.dim, "pooling": round(f.pooling, 3),
                                    "access_histogram": [round(h, 4) for h in f.hist]}  # fmt: skip
    return {
        "cost_ms": round(p.plan.cost_ms, 3),
        "comm_ms": round(p.plan.comm_ms, 3),
        "ranks": [
            {"rank": r, "compute_ms": round(c, 3), "memory_mb": round(m / 2**20, 3)}
            for r, (c, m) in enumerate(zip(p.plan.compute_ms, p.plan.memory, strict=True))
        ],
    }
