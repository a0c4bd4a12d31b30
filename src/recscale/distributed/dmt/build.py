"""Build a run's model as DMT (``dmt:`` in the config): towers per host, tower modules, data-parallel top.

Every rank first builds the whole flat model with the run's seed, exactly as the flat path does, and
the towers' tables are filled from it: DMT and flat training start from the same tables, and with
identity tower modules from the same model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizer, KeyedOptimizerWrapper

from recscale.config import DistributedConfig, RunConfig
from recscale.distributed.dmt.assignment import resolve_assignment
from recscale.distributed.dmt.towers import build_tower_module, tower_outputs
from recscale.distributed.dmt.transform import DMTGroups, DMTModel, LocalDMT, Top, Tower, data_parallel
from recscale.distributed.env import DistEnv
from recscale.distributed.sharding import shard_model
from recscale.errors import ConfigError
from recscale.models.base import RecModel, count_parameters
from recscale.models.embedding import EmbeddingConfig, EmbeddingLayer, FeatureSet, SparseInput
from recscale.models.flops import module_flops
from recscale.models.registry import build_model


def _tower_embedding(features: FeatureSet, names: list[str], cfg: EmbeddingConfig) -> EmbeddingLayer:
    sparse = tuple(f for f in features.sparse if f.name in names)
    mine = {
        key: {f: m for f, m in getattr(cfg, key).items() if f in names}
        for key in ("multi_embedding", "qr_buckets")
    }
    tower_cfg = cfg.model_copy(update={"dense_embeddings": 0, **mine})
    return EmbeddingLayer(FeatureSet(sparse=sparse, num_dense=0), tower_cfg)


def _vector_order(features: FeatureSet, towers: list[list[str]], cfg: EmbeddingConfig) -> list[int]:
    """Index into the towers' concatenated vectors giving the flat model's order of sparse vectors."""
    concat = [(f, j) for t in towers for f in t for j in range(cfg.multi_embedding.get(f, 1))]
    flat = [(f.name, j) for f in features.sparse for j in range(cfg.multi_embedding.get(f.name, 1))]
    where = {v: i for i, v in enumerate(concat)}
    return [where[v] for v in flat]


@dataclass
class UnshardedDMT:
    """Every tower (tables filled from the flat model) and the top, unsharded, as every rank builds
    them: the same on every rank and for every topology with as many hosts."""

    towers: list[list[str]]  # per tower, its features in schema order
    modules: list[Tower]
    top: RecModel  # the model without its tables
    outputs: list[int]  # c_t
    order: list[int] | None  # see DMTModel
    counts: dict[str, int]  # dense and sparse parameters of the whole model
    dense_flops: int  # forward FLOPs per example of the top and every tower's module


def check_topology(cfg: RunConfig, hosts: int) -> None:
    """The run's ``dmt`` section can train on ``hosts`` hosts (the launcher checks it before starting ranks)."""
    assert cfg.dmt is not None
    if cfg.dmt.towers != "auto" and cfg.dmt.towers != hosts:
        raise ConfigError(
            f"dmt.towers={cfg.dmt.towers}: DMT runs one tower per host and this job has {hosts} "
            f"host{'s' * (hosts != 1)}; set dmt.towers=auto or run it on {cfg.dmt.towers} "
            f"host{'s' * (cfg.dmt.towers != 1)} (e.g. --nproc {2 * cfg.dmt.towers} --local-world-size 2)"
        )


def build_unsharded(cfg: RunConfig, features: FeatureSet, hosts: int) -> UnshardedDMT:
    assert cfg.dmt is not None
    check_topology(cfg, hosts)
    dmt, emb = cfg.dmt, cfg.model.embedding
    towers = resolve_assignment(dmt.assignment, [f.name for f in features.sparse], hosts, cfg.seed)
    torch.manual_seed(cfg.seed)
    flat = build_model(cfg.model.name, features, emb, cfg.model.params)
    tables = flat.embedding.ebc.state_dict()
    modules = []
    for names in towers:
        embedding = _tower_embedding(features, names, emb)
        embedding.ebc.load_state_dict({k: v for k, v in tables.items() if k in embedding.ebc.state_dict()})
        modules.append(Tower(embedding, build_tower_module(embedding.num_outputs, emb.dim, dmt.tower_module)))
    outputs = [tower_outputs(t.embedding.num_outputs, dmt.tower_module) for t in modules]
    identity = dmt.tower_module.type == "identity"
    if identity:
        top_model = flat
    else:  # the interaction sees Σ c_t vectors: build it on as many one-row placeholder features
        torch.manual_seed(cfg.seed)
        slots = FeatureSet(
            tuple(SparseInput(f"tower_slot{i}", 1) for i in range(sum(outputs))), features.num_dense
        )
        plain = emb.model_copy(update={"multi_embedding": {}, "qr_buckets": {}})
        top_model = build_model(cfg.model.name, slots, plain, cfg.model.params)
    tower_params = sum(p.numel() for t in modules for p in t.module.parameters())
    counts = {
        "dense": count_parameters(top_model)["dense"] + int(tower_params),
        "sparse": count_parameters(flat)["sparse"],
    }
    del top_model.embedding.ebc  # the towers own the tables
    order = _vector_order(features, towers, emb) if identity else None
    flops = top_model.flops_per_example() + sum(module_flops(t.module) for t in modules)
    return UnshardedDMT(towers, modules, top_model, outputs, order, counts, flops)


def build_dmt(
    cfg: RunConfig,
    features: FeatureSet,
    env: DistEnv,
    table_optimizer: tuple[type[torch.optim.Optimizer], dict],
) -> tuple[DMTModel, KeyedOptimizer, UnshardedDMT]:
    """This rank's DMT model, its tables' (fused) optimizer from ``table_optimizer`` (class, kwargs),
    and the unsharded model it was built from (parameter counts, FLOPs)."""
    topo, dmt = env.topology, cfg.dmt
    assert dmt is not None
    u = build_unsharded(cfg, features, topo.num_hosts)
    groups = DMTGroups.create(topo, env.rank)
    mine = topo.host_of(env.rank)
    tower = u.modules[mine]
    opt_cls, table_kw = table_optimizer
    apply_optimizer_in_backward(opt_cls, tower.embedding.ebc.parameters(), dict(table_kw))
    local = topo.local_world_size
    host_env = DistEnv(env.rank % local, local, local, env.device, env.backend)
    host_plan = DistributedConfig(
        sharding=dmt.sharding, timeout_s=cfg.distributed.timeout_s, count_bytes=cfg.distributed.count_bytes
    )
    tower_dmp, table_opt = shard_model(tower, host_env, host_plan, (opt_cls, table_kw), pg=groups.host)
    top = data_parallel(Top(u.top).to(env.device), env.device, counted=cfg.distributed.count_bytes)
    dim = cfg.model.embedding.dim
    model = DMTModel(u.towers, mine, tower_dmp, top, u.outputs, dim, groups, u.order, u.dense_flops)
    return model.to(env.device), table_opt, u


def build_local(
    cfg: RunConfig,
    features: FeatureSet,
    env: DistEnv,
    table_optimizer: tuple[type[torch.optim.Optimizer], dict],
    hosts: int,
) -> tuple[LocalDMT, KeyedOptimizer, UnshardedDMT]:
    """As ``build_dmt``, the model of a run trained on ``hosts`` hosts, but all of it, unsharded, in this
    process (to score the run), with ``table_optimizer`` over its tables."""
    u = build_unsharded(cfg, features, hosts)
    model = LocalDMT(u.towers, u.modules, Top(u.top), u.order, u.dense_flops).to(env.device)
    ids = {id(p) for t in u.modules for p in t.embedding.table_parameters()}
    opt_cls, table_kw = table_optimizer
    tables = KeyedOptimizerWrapper(
        {n: p for n, p in model.named_parameters() if id(p) in ids}, lambda ps: opt_cls(ps, **table_kw)
    )
    return model, tables, u
