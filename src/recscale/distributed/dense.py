"""The dense part of the model, data-parallel: DDP (replicated) or FSDP2 (``fully_shard``, sharded).

Both plug into ``DistributedModelParallel`` as its ``data_parallel_wrapper``, which DMP calls after
sharding the tables, on everything it did not shard.

- DDP: TorchRec's default wrapper. With ``distributed.count_bytes`` every DDP in the model (DMP's,
  and the one TorchRec puts around ``data_parallel`` tables) gets torch's stock ``allreduce_hook``:
  the same averaging all-reduce as DDP's built-in one, but issued through
  ``torch.distributed.all_reduce``, where ``comms`` counts it.
- FSDP2: every submodule without embedding tables is ``fully_shard`` ed: its parameters become
  DTensors sharded over the ranks, gathered for forward/backward, gradients reduce-scattered. For
  dense networks too big to replicate on each rank. With ``param_dtype=bfloat16`` (``train.precision:
  bf16``) FSDP2's mixed-precision policy gathers the parameters in bf16 (half the all-gather bytes) and
  computes in bf16, while the sharded fp32 parameters stay the master copy that the optimizer steps,
  and gradients are reduce-scattered in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, fp16_compress_hook
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.model_parallel import (
    DataParallelWrapper,
    DefaultDataParallelWrapper,
    DistributedModelParallel,
)
from torchrec.distributed.types import ShardedModule, ShardingEnv

from recscale.errors import ConfigError


class HookedDDPWrapper(DefaultDataParallelWrapper):
    """DMP's default DDP with ``hook`` on every DDP in the model: torch's ``allreduce_hook`` issues the
    all-reduces through ``torch.distributed``, where ``comms`` counts them (see module doc); the
    compression hooks all-reduce the gradients in fp16 or bf16 (counted at their real bytes)."""

    def __init__(self, hook: Callable[..., Any]) -> None:
        super().__init__()
        self.hook = hook

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        super().wrap(dmp, env, device)
        for m in dmp.modules():
            if isinstance(m, DistributedDataParallel):
                m.register_comm_hook(m.process_group, self.hook)


class FSDP2Wrapper(DataParallelWrapper):
    """``fully_shard`` every dense submodule over all ranks (see module doc)."""

    def __init__(self, param_dtype: torch.dtype = torch.float32) -> None:
        self.policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        mesh = init_device_mesh(device.type, (env.world_size,))
        _shard_dense(dmp._dmp_wrapped_module, mesh, "", self.policy)


def _holds_tables(module: nn.Module) -> bool:
    return any(isinstance(m, ShardedModule) for m in module.modules())


def _shard_dense(module: nn.Module, mesh: DeviceMesh, prefix: str, policy: MixedPrecisionPolicy) -> None:
    stray = [f"{prefix}{n}" for n, _ in module.named_parameters(recurse=False)]
    if stray:
        raise ConfigError(
            f"distributed.dense: fsdp cannot shard parameters {stray}, which sit beside the embedding "
            "tables in one module; use dense: ddp for this model"
        )
    for name, child in module.named_children():
        if isinstance(child, ShardedModule):
            continue
        if _holds_tables(child):
            _shard_dense(child, mesh, f"{prefix}{name}.", policy)
        elif isinstance(child, nn.Sequential | nn.ModuleList):
            # Layer by layer: only one layer's full parameters are gathered at a time.
            for layer in child:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer, mesh=mesh, mp_policy=policy)
        elif any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh, mp_policy=policy)


def bf16_allreduce_hook(process_group, bucket):
    """torch's ``fp16_compress_hook`` in bf16, on any backend: torch's own bf16 hook insists on NCCL,
    while gloo all-reduces bf16 too (a CPU run with ``qcomms.dense: bf16`` failed with it). Unannotated:
    DDP compares the annotations with its own classes, and this module's are strings; not named
    ``bf16_compress_hook``, which DDP refuses by name off NCCL."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))

    def decompress(fut):
        return buffer.copy_(fut.value()[0])  # in place: no second full-size buffer

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def dense_wrapper(
    kind: Literal["ddp", "fsdp"],
    counted: bool = False,
    compress: Literal["fp32", "fp16", "bf16"] = "fp32",
    param_dtype: torch.dtype = torch.float32,
) -> DataParallelWrapper:
    """``counted``: DDP's all-reduces go through ``torch.distributed`` where ``comms`` counts them;
    ``compress``: DDP's gradients travel in that precision (counted either way); ``param_dtype``: what
    FSDP2 gathers and computes the dense parameters in (DDP computes under the trainer's autocast)."""
    if kind == "fsdp":  # qcomms.dense stays fp32 there (DistributedConfig checks)
        return FSDP2Wrapper(param_dtype)
    if compress != "fp32":
        return HookedDDPWrapper(fp16_compress_hook if compress == "fp16" else bf16_allreduce_hook)
    return HookedDDPWrapper(allreduce_hook) if counted else DefaultDataParallelWrapper()
