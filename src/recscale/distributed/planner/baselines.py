"""Placements of other planners: TorchRec's planner and greedy heuristics. The learned planner scores
them alongside its own search's plans (so it keeps one of them where its search finds nothing
predicted better), and bench/sharding.py measures them as baselines."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import cast

import torch
from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.types import ModuleSharder, ParameterSharding
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recscale.distributed.planner.features import BATCH, TableFeatures
from recscale.distributed.planner.search import Shard

# Per-table loads the greedy baselines balance.
GREEDY_KEYS: dict[str, Callable[[TableFeatures], float]] = {
    "size": lambda f: f.memory(),
    "dim": lambda f: f.dim,
    "lookup": lambda f: f.dim * f.pooling,
}


def greedy(tables: list[TableFeatures], world: int, key: Callable[[TableFeatures], float]) -> list[Shard]:
    """Whole tables by ``key``, largest first, each on the rank with the smallest sum of ``key`` so far."""
    load = [0.0] * world
    out = []
    for t in sorted(range(len(tables)), key=lambda t: -key(tables[t])):
        r = min(range(world), key=lambda r: load[r])
        load[r] += key(tables[t])
        out.append(Shard(t, 0, tables[t].dim, r))
    return out


def torchrec_plan(
    tables: list[TableFeatures], world: int, local_world: int, fused_only: bool = True
) -> dict[str, ParameterSharding]:
    """TorchRec's planner with its defaults on CPU, told each table's pooling factor and the batch size,
    restricted to the fused kernel (as ``distributed.sharding: planner`` runs it) unless not
    ``fused_only``. Table ``i`` is named ``t{i}``."""
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=f.dim, num_embeddings=f.rows, feature_names=[f"f{i}"])
        for i, f in enumerate(tables)
    ]
    constraints = {
        f"t{i}": ParameterConstraints(
            compute_kernels=["fused"] if fused_only else None, pooling_factors=[f.pooling]
        )
        for i, f in enumerate(tables)
    }
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    quiet = logging.getLogger("torchrec")
    level = quiet.level
    # Its planner warns on every data_parallel option it drops and on a directly built Topology.
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # on its default storage reservation
            topology = Topology(world_size=world, local_world_size=local_world, compute_device="cpu")
            planner = EmbeddingShardingPlanner(topology=topology, batch_size=BATCH, constraints=constraints)
            plan = planner.plan(ebc, [cast(ModuleSharder[nn.Module], EmbeddingBagCollectionSharder())])
    finally:
        quiet.setLevel(level)
    return cast(dict[str, ParameterSharding], plan.plan[""])


def torchrec_shards(tables: list[TableFeatures], world: int, local_world: int) -> list[Shard]:
    """``torchrec_plan``'s placement (fused kernels) as shards."""
    out = []
    for name, ps in torchrec_plan(tables, world, local_world).items():
        assert ps.sharding_spec is not None, (name, ps.sharding_type)  # fused kernels: never replicated
        out += [
            Shard(int(name[1:]), m.shard_offsets[1], m.shard_sizes[1], m.placement.rank())
            for m in ps.sharding_spec.shards
        ]
    return out


def candidates(tables: list[TableFeatures], world: int, local_world: int) -> list[list[Shard]]:
    """The baselines' placements of ``tables``: each greedy one's, and TorchRec's planner's where it
    finds one (it refuses tables beyond its own memory model; the learned planner then goes without)."""
    out = [greedy(tables, world, k) for k in GREEDY_KEYS.values()]
    try:
        out.append(torchrec_shards(tables, world, local_world))
    except PlannerError:
        pass
    return out
