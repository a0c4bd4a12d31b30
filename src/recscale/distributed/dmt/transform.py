"""DMT's semantic-preserving tower transform (SPTT): the embedding layer routed through host towers.

Each host h owns tower h, a group of sparse features. One training step on rank (h, l) (host h,
local rank l) with a local batch of B samples:

1. ids: for every tower t, the ids of t's features for the B samples go to the *peer* rank (t, l),
   the same local rank on host t (``route_ids``: two all_to_all_single over the peer group, lengths
   then values). Rank (t, l) now holds its tower's ids for H·B samples.
2. lookup: host t's tables are sharded over host t's ranks only (TorchRec DMP on the host's
   process group), so the lookup's all-to-alls never leave the host.
3. tower module: (H·B, n_t, d) -> (H·B, c_t, d), replicated over the host (DDP on the host group).
4. return: each peer's B rows go back over the peer group (``_ReturnToOwners``); every rank
   concatenates the towers' outputs for its own B samples and runs the data-parallel top (DDP over
   all ranks).

Only steps 1 and 4 cross hosts, and only between peers. With identity tower modules the towers'
vectors are put back in the flat model's order, so the model computes exactly the flat function.

Gradient scale: TorchRec divides the pooled embeddings' gradients by its group's size (L, the host)
and the return path divides by H, so tables and tower modules get the gradient of the mean loss over
the global batch, as the flat model's do. The routing assumes every rank's batch has the same size
(the trainer's batches and evaluation slices do).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.model_parallel import get_unwrapped_module
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recscale.distributed.topology import Topology
from recscale.models.base import RecModel
from recscale.models.embedding import EmbeddingLayer, ids_as


@dataclass(frozen=True)
class DMTGroups:
    peer: dist.ProcessGroup  # this local rank on every host, in host order: tower t is member t
    host: dist.ProcessGroup  # this host's ranks

    @classmethod
    def create(cls, topology: Topology, rank: int) -> DMTGroups:
        """Every rank must call this (new_group is collective), in the same order."""
        hosts, local = topology.num_hosts, topology.local_world_size
        peers = [dist.new_group([h * local + i for h in range(hosts)]) for i in range(local)]
        host_groups = [dist.new_group(topology.ranks_of_host(h)) for h in range(hosts)]
        return cls(peers[rank % local], host_groups[topology.host_of(rank)])


def _exchange(x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def tower_parts(sparse: KeyedJaggedTensor, towers: list[list[str]]) -> list[KeyedJaggedTensor]:
    """A KJT of all features -> one KJT per tower, of its features (same batch)."""
    keys = sparse.keys()
    return sparse.permute([keys.index(f) for t in towers for f in t]).split([len(t) for t in towers])


def route_ids(
    sparse: KeyedJaggedTensor, towers: list[list[str]], mine: int, group: dist.ProcessGroup
) -> KeyedJaggedTensor:
    """This rank's batch (B samples, all features) -> tower ``mine``'s features for the B samples of
    every peer, peer by peer: a KJT of batch H·B (see module doc, step 1)."""
    h, b, k = len(towers), sparse.stride(), len(towers[mine])
    parts = tower_parts(sparse, towers)
    lengths = _exchange(
        torch.cat([p.lengths() for p in parts]), [k * b] * h, [len(t) * b for t in towers], group
    )
    per_block = lengths.view(h, k, b).sum(2)  # ids per (source peer, feature)
    sent = [p.values().numel() for p in parts]
    received = per_block.sum(1).tolist()
    values = _exchange(torch.cat([p.values() for p in parts]), received, sent, group)
    weights = None
    if sparse.weights_or_none() is not None:
        weights = _exchange(torch.cat([p.weights() for p in parts]), received, sent, group)

    def key_major(x: Tensor) -> Tensor:  # (peer, feature) blocks -> (feature, peer), KJT's layout
        blocks = x.split(per_block.flatten().tolist())
        return torch.cat([blocks[s * k + j] for j in range(k) for s in range(h)])

    return KeyedJaggedTensor(
        keys=towers[mine],
        values=key_major(values),
        weights=key_major(weights) if weights is not None else None,
        lengths=lengths.view(h, k, b).transpose(0, 1).reshape(-1),
        stride=h * b,
    )


class _ReturnToOwners(torch.autograd.Function):
    """All-to-all of flat tensors over the peer group; the backward sends gradients the other way,
    scaled by ``scale`` (1/H, see module doc)."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], group: Any, scale: float
    ) -> Tensor:
        ctx.args = (out_splits, in_splits, group, scale)
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        out_splits, in_splits, group, scale = ctx.args
        return _exchange(grad, in_splits, out_splits, group) * scale, None, None, None, None


class Tower(nn.Module):
    """One tower: tower KJT (batch B') -> its tables' embeddings (B', n_t, d) -> tower module (B', c_t, d)."""

    def __init__(self, embedding: EmbeddingLayer, module: nn.Module) -> None:
        super().__init__()
        self.embedding, self.module = embedding, module

    def forward(self, sparse: KeyedJaggedTensor) -> Tensor:
        no_dense = torch.empty(sparse.stride(), 0, device=sparse.values().device)
        return self.module(self.embedding(no_dense, sparse))


class Top(nn.Module):
    """(dense (B, n_dense), towers' vectors (B, Σ c_t, d)) -> logits (B,): the model's dense-feature
    embeddings and interaction, without its tables."""

    def __init__(self, model: RecModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, dense: Tensor, sparse_vectors: Tensor) -> Tensor:
        emb = self.model.embedding
        parts = [] if emb.dense_mlp is None else [emb.dense_mlp(dense).view(dense.shape[0], -1, emb.dim)]
        return self.model.calibration(self.model.interact(torch.cat([*parts, sparse_vectors], dim=1)))


def data_parallel(module: nn.Module, device: torch.device, counted: bool = False) -> nn.Module:
    """DDP over all ranks; ``counted``: its all-reduce issued where ``comms``
    counts it (a Python hook per bucket, so only when bytes are counted)."""
    ddp = DistributedDataParallel(module, device_ids=None if device.type == "cpu" else [device])
    if counted:
        ddp.register_comm_hook(ddp.process_group, allreduce_hook)
    return ddp


class DMTModel(nn.Module):
    """(dense (B, n_dense), sparse KJT of all features) -> logits (B,), through the host towers.

    ``tower`` is this host's tower under DMP on the host group; ``top`` the data-parallel rest.
    ``outputs[t]`` = c_t; ``order`` maps the towers' concatenated vectors to the flat model's
    order (identity tower modules) or is None.
    """

    def __init__(
        self,
        towers: list[list[str]],
        mine: int,
        tower: nn.Module,
        top: nn.Module,
        outputs: list[int],
        dim: int,
        groups: DMTGroups,
        order: list[int] | None,
        dense_flops: int,
    ) -> None:
        super().__init__()
        self.tower_features, self.mine, self.outputs, self.dim, self.groups = (
            towers,
            mine,
            outputs,
            dim,
            groups,
        )
        self.towers = nn.ModuleDict({str(mine): tower})  # keyed by tower: checkpoint keys differ per host
        self.top = top
        self.id_dtype = get_unwrapped_module(top).model.embedding.id_dtype  # ids cross hosts in it
        self.dense_flops = dense_flops  # forward FLOPs per example of the top and every tower's module
        self.order: Tensor | None
        self.register_buffer("order", torch.tensor(order) if order is not None else None, persistent=False)

    def flops_per_example(self) -> int:
        return self.dense_flops

    def x0_sources(self) -> list[tuple[nn.Module, float]]:
        """Where the flat model's embedding vectors X0 are computed, with the weight of each part's
        squared norm in an L2 penalty over this rank's B samples (see ``train.regularizers.EmbeddingL2``): the
        tower's embedding layer serves H·B samples and its gradient is divided by L, so 1/H gives the
        tables the flat gradient (divided by H·L); the dense-feature MLP (top, DDP over all ranks) 1."""
        tower = get_unwrapped_module(self.towers[str(self.mine)])
        sources: list[tuple[nn.Module, float]] = [(tower.embedding, 1 / len(self.tower_features))]
        dense_mlp = get_unwrapped_module(self.top).model.embedding.dense_mlp
        return sources + ([(dense_mlp, 1.0)] if dense_mlp is not None else [])

    def forward(self, dense: Tensor, sparse: KeyedJaggedTensor) -> Tensor:
        b, d, h = sparse.stride(), self.dim, len(self.tower_features)
        ids = route_ids(ids_as(sparse, self.id_dtype), self.tower_features, self.mine, self.groups.peer)
        y = self.towers[str(self.mine)](ids)  # (H·B, c_mine, d), peer by peer
        splits = [b * c * d for c in self.outputs]
        back = _ReturnToOwners.apply(
            y.flatten(), splits, [b * self.outputs[self.mine] * d] * h, self.groups.peer, 1 / h
        )
        x = torch.cat([p.view(b, -1, d) for p in back.split(splits)], dim=1)
        if self.order is not None:
            x = x[:, self.order]
        return self.top(dense, x)


# What DMP (tables: ``towers.T.towers.T.``, dense parameters: ``towers.T._dmp_wrapped_module.`` and its DDP's
# ``module.``) and the top's DDP (``module.``) add to ``DMTModel``'s names.
_WRAPPERS = re.compile(r"^(towers\.(\d+)\.)(?:towers\.\2\.|_dmp_wrapped_module\.module\.)|^(top\.)module\.")


def local_key(key: str) -> str:
    """A name in ``DMTModel``'s state (its state dict or its parameters' names) as ``LocalDMT`` names the
    same tensor."""
    return _WRAPPERS.sub(lambda m: m.group(1) or m.group(3), key, count=1)


class LocalDMT(nn.Module):
    """A DMT model in one process, unsharded (scoring a trained run): every host's tower and the top.
    ``DMTModel``'s function without the routing, and its tensors under the names ``local_key`` gives."""

    def __init__(
        self,
        towers: list[list[str]],
        modules: list[Tower],
        top: Top,
        order: list[int] | None,
        dense_flops: int,
    ) -> None:
        super().__init__()
        self.tower_features, self.dense_flops = towers, dense_flops
        self.towers = nn.ModuleDict({str(t): m for t, m in enumerate(modules)})
        self.top = top
        self.order: Tensor | None
        self.register_buffer("order", torch.tensor(order) if order is not None else None, persistent=False)

    def flops_per_example(self) -> int:
        return self.dense_flops

    def x0_sources(self) -> list[tuple[nn.Module, float]]:
        """As ``DMTModel``'s, but every tower serves only this process's samples: weight 1."""
        sources: list[tuple[nn.Module, float]] = [
            (cast(Tower, t).embedding, 1.0) for t in self.towers.values()
        ]
        dense_mlp = self.top.model.embedding.dense_mlp
        return sources + ([(dense_mlp, 1.0)] if dense_mlp is not None else [])

    def flat_state_dict(self) -> dict[str, Tensor]:
        """With identity tower modules (``order`` set: DMT computes the flat model), the flat model's state
        dict: the towers' embedding layers hold its tables, the top the rest (the same tensors)."""
        assert self.order is not None, "compressing tower modules have no flat form"
        towers = {k.split(".", 1)[1]: v for k, v in self.towers.state_dict().items()}  # "T.embedding.…"
        return towers | self.top.model.state_dict()

    def forward(self, dense: Tensor, sparse: KeyedJaggedTensor) -> Tensor:
        parts = tower_parts(ids_as(sparse, self.top.model.embedding.id_dtype), self.tower_features)
        x = torch.cat([t(p) for t, p in zip(self.towers.values(), parts, strict=True)], dim=1)
        if self.order is not None:
            x = x[:, self.order]
        return self.top(dense, x)
