"""Sharding plans for embedding tables: explicit per-table plans, or TorchRec's planner on fused kernels.

Every sharding type is available on CPU and GPU: TorchRec 1.8's planner offers no row-wise types on
CPU, yet its sharders run hand-written row-wise and table-row-wise plans on gloo, so explicit plans
are built here shard by shard (``ParameterSharding`` with an ``EnumerableShardingSpec``).

Kernels: every model-parallel table uses the fused kernel, so the table optimizer (row-wise Adagrad
by default) runs inside fbgemm's backward. Unconstrained, TorchRec 1.8 plans small tables on CPU as
``data_parallel`` with the dense kernel, which silently hands the tables to the dense optimizer.
``data_parallel`` tables do need the dense kernel (TorchRec has no fused one for them); ``shard_model``
gives them the table optimizer itself.

Initial weights: on CPU, TorchRec initialises each shard on its own, so the values would depend on
the plan and the world size. ``load_full_tables`` copies the unsharded model's tables into the
shards, so every plan at every world size starts from the same weights.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.remote_device import _remote_device
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
from torchrec.distributed.model_parallel import get_unwrapped_module
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner import Topology as PlannerTopology
from torchrec.distributed.sharding_plan import (
    calculate_shard_sizes_and_offsets,
    get_default_sharders,
    placement,
)
from torchrec.distributed.types import (
    Awaitable,
    CommOp,
    EmbeddingModuleShardingPlan,
    EnumerableShardingSpec,
    ModuleSharder,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
)
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recscale.config import DistributedConfig, TablePlan
from recscale.distributed.codecs import MXInt8Codec, RowwiseFP8Codec
from recscale.distributed.dense import dense_wrapper
from recscale.distributed.env import DistEnv
from recscale.distributed.planner.features import STATE_BYTES, WEIGHT_BYTES, TableFeatures
from recscale.distributed.planner.search import Plan
from recscale.distributed.topology import Topology
from recscale.errors import ConfigError

FUSED, DENSE = "fused", "dense"


@dataclass(frozen=True)
class Prediction:
    """What the learned planner predicts for the tables it placed (``tables[i]`` is table i of ``plan``)."""

    tables: list[str]
    plan: Plan
    features: list[TableFeatures]


# fbgemm's kernels need every column shard to be a multiple of this many columns.
_COLUMN_MULTIPLE = 4


Collection: TypeAlias = EmbeddingBagCollection | EmbeddingCollection


def embedding_collections(model: nn.Module) -> dict[str, Collection]:
    """Module path -> EBC (pooled tables) or EC (sequence tables), the modules DMP shards."""
    return {
        path: m
        for path, m in model.named_modules()
        if isinstance(m, EmbeddingBagCollection | EmbeddingCollection)
    }


def table_configs(collection: Collection) -> list[BaseEmbeddingConfig]:
    if isinstance(collection, EmbeddingBagCollection):
        return list(collection.embedding_bag_configs())
    return list(collection.embedding_configs())


def table_names(model: nn.Module) -> list[str]:
    return [c.name for m in embedding_collections(model).values() for c in table_configs(m)]


def table_keys(model: nn.Module, plan: ShardingPlan) -> dict[str, str]:
    """State-dict key of every planned table -> its sharding type."""
    collections = embedding_collections(model)
    return {
        f"{path}.{'embedding_bags' if isinstance(collections[path], EmbeddingBagCollection) else 'embeddings'}"
        f".{table}.weight": ps.sharding_type
        for path, module_plan in plan.plan.items()
        for table, ps in module_plan.items()
    }


def plan_tables(
    model: nn.Module,
    env: DistEnv,
    cfg: DistributedConfig,
    pg: dist.ProcessGroup | None = None,
    sample: KeyedJaggedTensor | None = None,
) -> ShardingPlan:
    """The plan for every table of ``model`` over the ranks of ``pg`` (default: all): the planner's,
    the learned planner's (its features from ``sample``, a batch of the data) or the configured type,
    then the per-feature entries of ``cfg.tables``."""
    return predicted_plan(model, env, cfg, pg, sample)[0]


def predicted_plan(
    model: nn.Module,
    env: DistEnv,
    cfg: DistributedConfig,
    pg: dist.ProcessGroup | None = None,
    sample: KeyedJaggedTensor | None = None,
) -> tuple[ShardingPlan, Prediction | None]:
    """``plan_tables``, with the learned planner's prediction for the tables it placed (None unless
    ``cfg.sharding`` is learned)."""
    collections = embedding_collections(model)
    configs = [c for m in collections.values() for c in table_configs(m)]
    by_feature: dict[str, str] = {}
    for c in configs:  # a feature a shared sequence table also embeds is named by its own table
        for f in c.feature_names:
            by_feature.setdefault(f, c.name)
    unknown = sorted(set(cfg.tables) - set(by_feature))
    if unknown:
        raise ConfigError(
            f"distributed.tables names unknown sparse features {unknown}; features: {sorted(by_feature)}"
        )
    explicit = {by_feature[f]: spec for f, spec in cfg.tables.items()}
    prediction = None
    planned = [c for c in configs if c.name not in explicit]
    builder = _ExplicitPlanner(env)
    built: dict[str, ParameterSharding] = {}
    if cfg.sharding == "learned" and planned:
        from recscale.distributed.planner.learned import learned_specs

        # The explicit tables first: the learned planner's memory cap counts what they take on each rank.
        for _, ebc, i, c in _tables_in_order(collections):
            if c.name in explicit:
                built[c.name] = _sharding(builder, ebc, c, explicit[c.name], i)
        reserved = [0] * env.world_size
        for name, ps in built.items():
            for rank, rows, cols in _shard_sizes(ps, next(c for c in configs if c.name == name)):
                reserved[rank] += rows * (cols * WEIGHT_BYTES + STATE_BYTES)
        specs, predicted, features = _planned_once(
            pg, lambda: learned_specs(planned, sample, env.topology, cfg.learned, reserved)
        )
        explicit = specs | explicit
        prediction = Prediction([c.name for c in planned], predicted, features)
    plan = _planner_plan(model, env, pg) if cfg.sharding == "planner" else ShardingPlan({})
    for path, ebc, i, c in _tables_in_order(collections):
        module_plan = plan.plan.setdefault(path, EmbeddingModuleShardingPlan())
        spec = explicit.get(c.name)
        if spec is None and cfg.sharding != "planner":
            spec = TablePlan(type=cfg.sharding)
        if c.name in built:
            module_plan[c.name] = built[c.name]
        elif spec is not None:
            module_plan[c.name] = _sharding(builder, ebc, c, spec, i)
    if env.device.type == "cpu":
        _check_row_blocks(plan, collections)
    return plan, prediction


def _planned_once(pg: dist.ProcessGroup | None, plan: Callable[[], Any]) -> Any:
    """``plan()`` on the group's first rank only, its result (or its error) taken by every rank: a plan
    searched on each rank could differ between hosts whose floating point differs, which would leave
    the ranks sharding the same tables differently (and the other ranks skip the search's CPU)."""
    if not dist.is_initialized() or dist.get_world_size(pg) == 1:
        return plan()
    box: list[Any] = [None]
    if dist.get_rank(pg) == 0:
        try:
            box[0] = plan()
        except Exception as e:  # every rank raises it, none is left waiting for a plan
            box[0] = e
    dist.broadcast_object_list(box, group=pg, group_src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def _check_row_blocks(plan: ShardingPlan, collections: dict[str, Collection]) -> None:
    """TorchRec cuts a row-wise table into blocks of ceil(rows / ranks) rows, so a small table leaves the
    last ranks empty blocks. A rank whose blocks of one row-wise type are all empty has an empty fused
    table group, which fbgemm's CPU lookup fails on ("weights[0] must be a GPU or MTIA tensor")."""
    for path, module_plan in plan.plan.items():
        features = {c.name: c.feature_names[0] for c in table_configs(collections[path])}
        for kind in (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value):
            rows: dict[int, int] = {}
            for ps in module_plan.values():
                if ps.sharding_type == kind and ps.sharding_spec is not None:
                    for m in cast(EnumerableShardingSpec, ps.sharding_spec).shards:
                        rows[m.placement.rank()] = rows.get(m.placement.rank(), 0) + m.shard_sizes[0]
            empty = sorted(r for r, n in rows.items() if n == 0)
            if empty:
                small = [features[t] for t, ps in module_plan.items() if ps.sharding_type == kind]
                raise ConfigError(
                    f"distributed: {kind} leaves rank(s) {empty} no rows of tables {small}: TorchRec cuts a "
                    "table into blocks of ceil(rows / ranks) rows, and fbgemm's CPU lookup fails on a rank "
                    f"with none; give them another type (e.g. distributed.tables.{small[0]}={{type: table_wise}}) "
                    "or train on fewer ranks"
                )


def _tables_in_order(
    collections: dict[str, Collection],
) -> Iterator[tuple[str, Collection, int, BaseEmbeddingConfig]]:
    """(module path, collection, index in it, table config) of every table, in model order."""
    for path, ebc in collections.items():
        for i, c in enumerate(table_configs(ebc)):
            yield path, ebc, i, c


def _sharding(
    builder: _ExplicitPlanner, ebc: Collection, c: BaseEmbeddingConfig, spec: TablePlan, index: int
) -> ParameterSharding:
    if spec.type == "data_parallel" and isinstance(ebc, EmbeddingCollection):
        raise ConfigError(
            f"distributed: the sequence table of {c.feature_names[0]!r} cannot be data_parallel "
            "(TorchRec 1.8's replicated EmbeddingCollection fails on CPU); give it another type in "
            f"distributed.tables.{c.feature_names[0]}, e.g. {{type: table_wise}}"
        )
    return builder.sharding(c, spec, index)


def _shard_sizes(ps: ParameterSharding, table: BaseEmbeddingConfig) -> list[tuple[int, int, int]]:
    """(rank, rows, columns) of each shard of a planned table; a data_parallel one is whole on every rank."""
    if ps.sharding_spec is None:
        return [(r, table.num_embeddings, table.embedding_dim) for r in ps.ranks or []]
    shards = cast(EnumerableShardingSpec, ps.sharding_spec).shards
    return [(m.placement.rank(), m.shard_sizes[0], m.shard_sizes[1]) for m in shards]


def _planner_plan(model: nn.Module, env: DistEnv, pg: dist.ProcessGroup | None) -> ShardingPlan:
    # Only fused kernels: the planner then picks among the sharding types it offers on the device.
    constraints = {name: ParameterConstraints(compute_kernels=[FUSED]) for name in table_names(model)}
    topology = PlannerTopology(
        world_size=env.world_size, compute_device=env.device.type, local_world_size=env.local_world_size
    )
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    # The same sharders with and without a job: ``shard plan`` must plan the sequence tables (an EC) too.
    sharders = get_default_sharders()
    if not dist.is_initialized():  # planning without a job (``recscale shard plan``)
        return planner.plan(model, sharders)
    return planner.collective_plan(model, sharders, pg=pg or dist.GroupMember.WORLD)


class _ExplicitPlanner:
    """Builds one table's ``ParameterSharding``; unset placements balance the tables over ranks."""

    def __init__(self, env: DistEnv) -> None:
        self.hosts: Topology = env.topology
        self.world = env.world_size
        self.device_type = env.device.type
        self.load = [0] * env.world_size  # bytes of table shards placed on each rank so far

    def sharding(self, table: BaseEmbeddingConfig, spec: TablePlan, index: int) -> ParameterSharding:
        rows, cols = table.num_embeddings, table.embedding_dim
        where = f"distributed: table of feature {table.feature_names[0]!r}"
        kind = spec.type
        if kind == ShardingType.DATA_PARALLEL.value:
            return ParameterSharding(kind, DENSE, list(range(self.world)), None)
        if spec.ranks is not None and max(spec.ranks) >= self.world:
            raise ConfigError(
                f"{where}: ranks {spec.ranks} do not exist in a world of {self.world} "
                f"rank{'s' * (self.world != 1)}"
            )
        if spec.host is not None and spec.host >= self.hosts.num_hosts:
            raise ConfigError(f"{where}: host {spec.host} does not exist; the job has {self.hosts.num_hosts}")
        if spec.host is not None:
            host = spec.host
        else:  # the host of the given ranks, else round-robin
            host = self.hosts.host_of(spec.ranks[0]) if spec.ranks else index % self.hosts.num_hosts
        if kind == ShardingType.TABLE_WISE.value:
            rank = spec.ranks[0] if spec.ranks else min(range(self.world), key=lambda r: self.load[r])
            return self._build(kind, [([rows, cols], [0, 0], rank)])
        if kind in (ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value):
            pool = (
                list(range(self.world))
                if kind == ShardingType.COLUMN_WISE.value
                else self.hosts.ranks_of_host(host)
            )
            if spec.ranks is not None and not set(spec.ranks) <= set(pool):
                raise ConfigError(f"{where}: ranks {spec.ranks} are not all on host {host} (ranks {pool})")
            ranks = spec.ranks or self._column_ranks(cols, pool)
            width, rest = divmod(cols, len(ranks))
            if rest or width % _COLUMN_MULTIPLE:
                raise ConfigError(
                    f"{where}: {cols} columns do not split into {len(ranks)} shards of a multiple of "
                    f"{_COLUMN_MULTIPLE} columns"
                )
            return self._build(kind, [([rows, width], [0, i * width], r) for i, r in enumerate(ranks)])
        # row_wise over all ranks, table_row_wise over the ranks of one host
        pool = (
            list(range(self.world)) if kind == ShardingType.ROW_WISE.value else self.hosts.ranks_of_host(host)
        )
        # TorchRec's row-wise kernels assume its own block split: ceil(rows / ranks) rows per rank.
        sizes, offsets = calculate_shard_sizes_and_offsets(
            torch.empty(rows, cols, device="meta"), self.world, len(pool), kind
        )
        return self._build(kind, [(s, o, r) for s, o, r in zip(sizes, offsets, pool, strict=True)])

    def _column_ranks(self, cols: int, pool: list[int]) -> list[int]:
        """As many column shards as ``pool`` allows, on its least-loaded ranks."""
        k = max(
            n for n in range(1, len(pool) + 1) if cols % n == 0 and (cols // n) % _COLUMN_MULTIPLE == 0
        ) if cols % _COLUMN_MULTIPLE == 0 else 1  # fmt: skip
        return sorted(sorted(pool, key=lambda r: self.load[r])[:k])

    def _build(self, kind: str, shards: list[tuple[list[int], list[int], int]]) -> ParameterSharding:
        for size, _, rank in shards:
            self.load[rank] += size[0] * size[1]
        spec = EnumerableShardingSpec(
            [
                ShardMetadata(
                    shard_sizes=size,
                    shard_offsets=offset,
                    placement=placement(self.device_type, rank, self.hosts.local_world_size),
                )
                for size, offset, rank in shards
            ]
        )
        return ParameterSharding(kind, FUSED, [rank for _, _, rank in shards], spec)


def _keys_in_order(keys: list[str]) -> Callable[[nn.Module, Any, Any], KeyedTensor]:
    """Forward hook on a sharded EBC: its pooled embeddings in the unsharded EBC's key order.

    A sharded EBC orders its output by sharding type and rank, not by table; models read the
    columns of ``values()`` by position, as the unsharded EBC lays them out.
    """

    def hook(module: nn.Module, inputs: Any, out: Any) -> KeyedTensor:
        kt = out.wait() if isinstance(out, Awaitable) else out
        if kt.keys() == keys:
            return kt
        cols = dict(zip(kt.keys(), kt.values().split(kt.length_per_key(), dim=1), strict=True))
        return KeyedTensor(
            keys=keys,
            length_per_key=[cols[k].shape[1] for k in keys],
            values=torch.cat([cols[k] for k in keys], dim=1),
        )

    return hook


def _global_placements(plan: ShardingPlan, pg: dist.ProcessGroup, device_type: str) -> None:
    """A plan over a subgroup names shards' ranks within it (``ParameterSharding.ranks``, as the
    sharders read them) but their placements by global rank (as ``ShardedTensor`` checks them);
    rewrite the placements in place (what TorchRec's ``DMPCollection`` does for its groups)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    for module_plan in plan.plan.values():
        for ps in module_plan.values():
            for shard in ps.sharding_spec.shards if ps.sharding_spec is not None else []:
                rank = dist.get_global_rank(pg, shard.placement.rank())
                shard.placement = _remote_device(placement(device_type, rank, local_world))


@torch.no_grad()
def load_full_tables(sharded: dict[str, Tensor], full: dict[str, Tensor]) -> None:
    """Copy full (unsharded) tables into the sharded state ``sharded`` (from ``dmp.state_dict()``)."""
    for key, src in full.items():
        dst = sharded[key]
        if isinstance(dst, ShardedTensor):
            for shard in dst.local_shards():
                m = shard.metadata
                index = tuple(slice(o, o + s) for o, s in zip(m.shard_offsets, m.shard_sizes, strict=True))
                shard.tensor.copy_(src[index])
        else:  # data_parallel: a replica of the whole table
            dst.copy_(src)


def qcomm_sharders(cfg: DistributedConfig, device: torch.device) -> list[ModuleSharder[nn.Module]] | None:
    """Sharders whose all-to-all / reduce-scatter encode with ``cfg.qcomms`` (None: TorchRec's defaults):
    fbgemm's codecs, and recscale's own (``distributed/codecs.py``) where fp8 or mxint8 is asked for."""
    q = cfg.qcomms
    if q.forward == q.backward == "fp32":
        return None
    own = {"fp8": RowwiseFP8Codec, "mxint8": MXInt8Codec}

    def fbgemm_codecs(as_fp16: tuple[str, ...]) -> dict[str, QuantizedCommCodecs]:
        """fbgemm's codecs for ``q``, the precisions in ``as_fp16`` built as fp16."""
        fwd, bwd = (CommType("fp16" if p in as_fp16 else p) for p in (q.forward, q.backward))
        codecs = get_qcomm_codecs_registry(
            QCommsConfig(forward_precision=fwd, backward_precision=bwd),
            device=device,  # its default: cuda
        )
        assert codecs is not None  # not both fp32
        return codecs

    # fbgemm's codecs for everything but recscale's own (built as fp16, then swapped for them below).
    codecs = fbgemm_codecs(tuple(own))
    # A reduce-scatter (row-wise tables) sums what it carries, so its forward cannot be row-wise bytes, and
    # TorchRec's backward for it takes no row-wise codec (fbgemm's int8 and mx4 failed there with an
    # AssertionError): fp16 in place of every row-wise format.
    scatter = CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.name
    codecs[scatter] = fbgemm_codecs((*own, "int8", "mx4"))[scatter]
    for op, pair in codecs.items():
        if op != scatter:
            codecs[op] = QuantizedCommCodecs(
                forward=own[q.forward](is_fwd=True) if q.forward in own else pair.forward,
                backward=own[q.backward](is_fwd=False) if q.backward in own else pair.backward,
            )
    # Sequence tables (an EC) keep fp32 collectives: the codecs above are for pooled embeddings.
    return [
        cast(ModuleSharder[nn.Module], EmbeddingBagCollectionSharder(qcomm_codecs_registry=codecs)),
        cast(ModuleSharder[nn.Module], EmbeddingCollectionSharder()),
    ]


def shard_model(
    model: nn.Module,
    env: DistEnv,
    cfg: DistributedConfig,
    table_optimizer: tuple[type[torch.optim.Optimizer], dict],
    pg: dist.ProcessGroup | None = None,
    dense_dtype: torch.dtype = torch.float32,
    sample: KeyedJaggedTensor | None = None,
) -> tuple[DistributedModelParallel, KeyedOptimizer]:
    """``model`` under DMP over the ranks of ``pg`` (default: all; ``env`` then describes that
    group): tables sharded by ``plan_tables`` starting from the unsharded model's values, the dense
    part wrapped per ``cfg.dense`` (FSDP2 gathering it in ``dense_dtype``). Returns DMP and the tables' optimizer: the fused one, plus
    ``table_optimizer`` (class, kwargs) over the data_parallel tables' replicas. ``sample``: a batch of
    the data, from which the learned planner reads its table features."""
    plan = plan_tables(model, env, cfg, pg, sample)
    if pg is not None:
        _global_placements(plan, pg, env.device.type)
    kinds = table_keys(model, plan)
    # Tables built on the meta device (distributed.materialize: shards) are initialised by TorchRec.
    full = {k: v for k, v in model.state_dict().items() if k in kinds and not v.is_meta}
    orders = {
        path: [f for c in ebc.embedding_bag_configs() for f in c.feature_names]
        for path, ebc in embedding_collections(model).items()
        if isinstance(ebc, EmbeddingBagCollection)
    }
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(pg) if pg is not None else None,
        device=env.device,
        plan=plan,
        data_parallel_wrapper=dense_wrapper(cfg.dense, cfg.count_bytes, cfg.qcomms.dense, dense_dtype),
        sharders=qcomm_sharders(cfg, env.device),
    )
    load_full_tables(dmp.state_dict(), full)
    unwrapped = get_unwrapped_module(dmp)
    for path, keys in orders.items():
        unwrapped.get_submodule(path).register_forward_hook(_keys_in_order(keys))
    replicated = {n: p for n, p in dmp.named_parameters() if kinds.get(n) == ShardingType.DATA_PARALLEL.value}
    if not replicated:
        return dmp, dmp.fused_optimizer
    opt_cls, kwargs = table_optimizer
    replicas = KeyedOptimizerWrapper(replicated, lambda params: opt_cls(params, **kwargs))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, replicas])
