"""``distributed.sharding: learned``: the tables of a model planned by the learned planner, as the
explicit per-table plans (``TablePlan``) that ``sharding.plan_tables`` turns into a TorchRec plan."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recscale.config import LearnedConfig, TablePlan
from recscale.distributed.planner.baselines import candidates
from recscale.distributed.planner.cost_model import SHIPPED, CostModels
from recscale.distributed.planner.features import TableFeatures, from_batch, synthetic_table
from recscale.distributed.planner.search import LearnedPlanner, Plan
from recscale.distributed.topology import Topology


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
    tables: list[EmbeddingBagConfig],
    sample: KeyedJaggedTensor | None,
    topology: Topology,
    cfg: LearnedConfig,
    reserved: Sequence[int] | None = None,
) -> tuple[dict[str, TablePlan], Plan, list[TableFeatures]]:
    """Table name -> its plan (table_wise on one rank; column shards on distinct ranks: table_column_wise
    where they share a host of several, else column_wise; row blocks: table_row_wise on one host of
    several, else row_wise), the planner's prediction, and the features
    it planned with (in ``tables`` order). The planner also scores its baselines' placements
    (``baselines.candidates``, TorchRec's planner's among them) and keeps the cheapest predicted.
    ``reserved``: bytes per rank the tables placed explicitly take (the memory cap counts them)."""
    features = table_features(tables, sample)
    models = CostModels.load(Path(cfg.cost_models) if cfg.cost_models else SHIPPED)
    cap = math.ceil(cfg.memory_cap_mb * 2**20) if cfg.memory_cap_mb is not None else None
    world, local = topology.world_size, topology.local_world_size
    plan = LearnedPlanner(models, world, cap, local_world=local, reserved=reserved).plan(
        features, candidates(features, world, local)
    )
    specs = {c.name: table_plan(plan.ranks_of(t), topology, plan.row_split(t)) for t, c in enumerate(tables)}
    return specs, plan, features


def table_plan(ranks: list[int], topology: Topology, by_rows: bool = False) -> TablePlan:
    """The explicit plan of a table whose column shards (``by_rows``: row blocks) lie on ``ranks``."""
    if by_rows:
        if len(ranks) == topology.world_size:
            return TablePlan(type="row_wise")
        (host,) = {topology.host_of(r) for r in ranks}  # the hierarchical search's: one host's ranks
        assert ranks == topology.ranks_of_host(host), ranks
        return TablePlan(type="table_row_wise", host=host)
    if len(ranks) == 1:
        return TablePlan(type="table_wise", ranks=ranks)
    hosts = {topology.host_of(r) for r in ranks}
    if topology.num_hosts > 1 and len(hosts) == 1:
        return TablePlan(type="table_column_wise", ranks=ranks, host=hosts.pop())
    return TablePlan(type="column_wise", ranks=ranks)
