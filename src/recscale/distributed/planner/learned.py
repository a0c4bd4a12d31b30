"""``distributed.sharding: learned``: the tables of a model planned by the learned planner, as the
explicit per-table plans (``TablePlan``) that ``sharding.plan_tables`` turns into a TorchRec plan."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recscale.config import LearnedConfig, TablePlan
from recscale.distributed.planner.cost_model import SHIPPED, CostModels
from recscale.distributed.planner.features import TableFeatures, from_batch, synthetic_table
from recscale.distributed.planner.search import LearnedPlanner, Plan


def table_features(tables: list[EmbeddingBagConfig], sample: KeyedJaggedTensor | None) -> list[TableFeatures]:
    """Each table's features from ``sample`` (a batch of its feature's ids); a table the sample lacks
    is assumed to take one id per example, uniformly over its rows."""
    rows = {c.feature_names[0]: c.num_embeddings for c in tables}
    dims = {c.feature_names[0]: c.embedding_dim for c in tables}
    seen = from_batch(sample, rows, dims) if sample is not None else {}
    out = []
    for c in tables:
        f = seen.get(c.feature_names[0])
        if f is None:
            f = synthetic_table(
                c.feature_names[0], c.num_embeddings, c.embedding_dim, 1.0, 0.0, np.random.default_rng(0)
            )[0]
        out.append(f)
    return out


def learned_specs(
    tables: list[EmbeddingBagConfig], sample: KeyedJaggedTensor | None, world: int, cfg: LearnedConfig
) -> tuple[dict[str, TablePlan], Plan, list[TableFeatures]]:
    """Table name -> its plan (table_wise on one rank, or column_wise over distinct ranks), the
    planner's prediction, and the features it planned with (in ``tables`` order)."""
    features = table_features(tables, sample)
    models = CostModels.load(Path(cfg.cost_models) if cfg.cost_models else SHIPPED)
    cap = math.ceil(cfg.memory_cap_mb * 2**20) if cfg.memory_cap_mb is not None else None
    plan = LearnedPlanner(models, world, cap).plan(features)
    specs = {}
    for t, c in enumerate(tables):
        ranks = plan.ranks_of(t)
        specs[c.name] = TablePlan(type="table_wise" if len(ranks) == 1 else "column_wise", ranks=ranks)
    return specs, plan, features
