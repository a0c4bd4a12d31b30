"""Sharding plans for embedding tables: TorchRec's planner, constrained to fused kernels.

Without constraints TorchRec 1.8 plans small tables on CPU as ``data_parallel`` with the dense
kernel: the tables are then replicated, trained by the dense optimizer, and the fused row-wise
Adagrad never runs. Constraining every table to a fused kernel keeps the sparse optimizer in the
fbgemm backward kernel, as in production DLRM training.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingPlan, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

FUSED = "fused"


def table_names(model: nn.Module) -> list[str]:
    return [
        cfg.name
        for m in model.modules()
        if isinstance(m, EmbeddingBagCollection)
        for cfg in m.embedding_bag_configs()
    ]


def plan_tables(
    model: nn.Module,
    device: torch.device,
    sharding_type: str = ShardingType.TABLE_WISE.value,
    local_world_size: int | None = None,
) -> ShardingPlan:
    """A plan that shards every table of ``model`` with ``sharding_type`` and the fused kernel."""
    world = dist.get_world_size()
    constraints = {
        name: ParameterConstraints(sharding_types=[sharding_type], compute_kernels=[FUSED])
        for name in table_names(model)
    }
    topology = Topology(
        world_size=world, compute_device=device.type, local_world_size=local_world_size or world
    )
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    return planner.collective_plan(model, pg=dist.GroupMember.WORLD)
