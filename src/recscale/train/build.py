"""Model assembly: one ``build(cfg, features, env) -> Built`` for the flat and the DMT model alike.

    flat: the model from the registry -> tables under TorchRec's DistributedModelParallel (sharded,
          fused optimizer in backward), the dense part DDP or FSDP2
    DMT:  towers of tables per host, tower modules, a data-parallel top (``distributed.dmt``)

Either way the trainer gets the module to call, the user's model behind it, the tables' and the
dense optimizers by name, the unsharded model's parameter counts and its forward FLOPs per example.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.model_parallel import get_unwrapped_module
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recscale.config import RunConfig
from recscale.data.dataset import ArrayDataset
from recscale.data.preprocess import Preprocessor
from recscale.data.schema import Schema
from recscale.distributed.env import DistEnv
from recscale.distributed.planner.features import BATCH
from recscale.distributed.sharding import shard_model
from recscale.errors import ConfigError, ResourceError
from recscale.models.base import RecModel, TrainableModel, count_parameters
from recscale.models.blocks.sequence import SequenceConfig, SequenceEncoder
from recscale.models.embedding import FeatureSet, SparseInput, check_feature_options, check_table_names
from recscale.models.quant import quantize_model
from recscale.models.registry import build_model
from recscale.train.memory import failed_allocation
from recscale.train.optim import dense_optimizer_factory, sparse_optimizer

if TYPE_CHECKING:
    from recscale.distributed.dmt.transform import DMTModel, LocalDMT


@dataclass
class Built:
    """A model ready to train on this rank."""

    module: nn.Module  # what to call: (dense (B, n_dense), sparse KJT) -> logits (B,)
    model: TrainableModel  # the user's model inside ``module`` (a DMT model is its own)
    tables: KeyedOptimizer  # the tables' optimizer (fused in backward, or over replicated tables)
    dense: KeyedOptimizer  # the dense parameters' optimizer
    parameters: dict[str, int]  # {"dense": n, "sparse": n} of the whole unsharded model
    flops_per_example: int  # forward, dense computation
    opt: CombinedOptimizer = field(init=False)  # both as one (zero_grad, step, state_dict), tables first

    def __post_init__(self) -> None:
        self.opt = CombinedOptimizer([self.tables, self.dense])

    def trainable_dense(self) -> dict[str, torch.Tensor]:
        """The dense optimizer's trainable parameters by name."""
        return {k: q for k, q in self.dense.params.items() if q.requires_grad}

    def table_shards(self) -> list[torch.Tensor]:
        """This rank's table storage: local shards (views of the fused weights) or replicated tables."""
        return [x for w in self.tables.params.values() for x in local_tensors(w)]


def local_tensors(w: torch.Tensor) -> list[torch.Tensor]:
    """A table's tensors on this rank: its local shards, or the (replicated) table itself."""
    return [x.tensor for x in w.local_shards()] if isinstance(w, ShardedTensor) else [w.data]


def feature_set(pre: Preprocessor) -> FeatureSet:
    return schema_features(pre.schema, pre.num_embeddings)


def schema_features(schema: Schema, rows: Callable[[str], int] = lambda _: 1) -> FeatureSet:
    """The model's inputs for ``schema``, each table of ``rows(name)`` rows (one by default: no dense
    shape depends on a table's rows, so the model's layers are known before any data is read)."""
    sparse = tuple(
        SparseInput(f.name, rows(f.name), "mean" if f.multi else "sum", f.weighted, f.max_len, f.vocabulary)
        for f in schema.sparse
    )
    return FeatureSet(sparse=sparse, num_dense=len(schema.dense))


def planner_sample(cfg: RunConfig, ds: ArrayDataset) -> KeyedJaggedTensor | None:
    """The ids of the first ``BATCH`` training rows, from which the learned planner reads its table
    features (None unless it plans this run)."""
    if cfg.distributed.sharding != "learned" or cfg.dmt is not None:
        return None
    return ds.gather(np.arange(min(len(ds), BATCH))).sparse


def check_features(cfg: RunConfig, features: FeatureSet) -> None:
    """Feature names the config gives the embedding layer exist, the model's parameters fit these
    features and each other, and ``model.quant`` names layers of this model (a ConfigError naming the key)."""
    emb = cfg.model.embedding
    try:
        check_feature_options([f.name for f in features.sparse if f.max_len is None], emb)
        check_table_names(features.sparse, emb)
    except ValueError as e:
        raise ConfigError(f"model.embedding: {e}") from None
    sequences = [f.name for f in features.sparse if f.max_len is not None]
    # Without a sequence feature the encoder is never built: a history declared without max_len would
    # train as a plain mean-pooled bag. (Compared with the default: a run's config.yaml holds it.)
    if not sequences and emb.sequence != SequenceConfig():
        raise ConfigError(
            "model.embedding.sequence is set but no sparse feature is a sequence, so no encoder would run; "
            "give the history its max_len (e.g. {name: history, multi: true, max_len: 50}) or drop "
            "model.embedding.sequence"
        )
    if sequences and emb.sequence.encoder != "causal":
        single = sorted(f.name for f in features.sparse if f.max_len is None and f.pooling == "sum")
        if emb.sequence.target not in single:
            raise ConfigError(
                f"model.embedding.sequence.target: the {emb.sequence.encoder} encoder of sequence features "
                f"{sequences} needs the candidate's single-id feature, one of {single} (or encoder: causal)"
            )
    if sequences and cfg.dmt is not None:
        raise ConfigError(f"dmt: sequence features {sequences} are not supported with DMT towers; drop dmt")
    # What a model's constructor refuses (DHEN heads that do not divide the dim, a FinalMLP context that
    # is no feature, ...), found on a table-free copy: one line naming model, not an internal error.
    one_row = FeatureSet(
        tuple(dataclasses.replace(f, num_embeddings=1) for f in features.sparse), features.num_dense
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the real build warns
            model = build_model(cfg.model.name, one_row, emb, cfg.model.params, device=torch.device("meta"))
    except ValueError as e:
        raise ConfigError(f"model ({cfg.model.name}): {e}") from None
    quantize_model(model, cfg.model.quant)  # a model.quant naming no layer of this model: ConfigError


def check_model(cfg: RunConfig) -> None:
    """``check_features`` from the config's schema alone, before any data is read: the launcher checks
    once what every rank's build would otherwise refuse after the launch and the data's preparation."""
    check_features(cfg, schema_features(cfg.data.schema))


def flat_model(cfg: RunConfig, features: FeatureSet) -> RecModel:
    """The user's model (not DMT), unsharded on the CPU (DMP moves it), seeded by ``cfg.seed``.

    With ``distributed.materialize: shards`` the tables stay on the meta device, for DMP to allocate and
    initialise this rank's shards only, and the dense part takes its initial values from the same model
    built with one-row tables (no dense shape depends on a table's rows), so every rank starts alike.
    """
    torch.manual_seed(cfg.seed)
    name, emb, params = cfg.model.name, cfg.model.embedding, cfg.model.params
    if cfg.distributed.materialize == "full":
        model = build_model(name, features, emb, params)
    else:
        one_row = tuple(dataclasses.replace(f, num_embeddings=1) for f in features.sparse)
        init = build_model(name, FeatureSet(one_row, features.num_dense), emb, params)
        model = build_model(name, features, emb, params, device=torch.device("meta"))
        collections = {"embedding.ebc": model.embedding.ebc, "embedding.ec": model.embedding.ec}
        tables = {m for c in collections.values() if c is not None for m in c.modules()}
        for m in model.modules():
            if m not in tables:
                m.to_empty(device="cpu", recurse=False)
        values = dict(itertools.chain(init.named_parameters(), init.named_buffers()))
        with torch.no_grad():
            for key, t in itertools.chain(model.named_parameters(), model.named_buffers()):
                if not key.startswith(tuple(f"{path}." for path in collections)):
                    t.copy_(values[key])
    if cfg.model.quant is not None:  # emulated low-precision GEMMs (before FLOPs are counted: same)
        quantize_model(model, cfg.model.quant)
    return model


def _model_does_not_fit(cfg: RunConfig, features: FeatureSet, env: DistEnv, tried: int) -> ResourceError:
    """The out-of-memory line of a rank whose model's allocation of ``tried`` bytes (0: not said) failed."""
    model = build_model(cfg.model.name, features, cfg.model.embedding, cfg.model.params, torch.device("meta"))
    size = 2 if cfg.model.embedding.storage == "fp16" else 4
    ec = model.embedding.ec
    configs = [
        *model.embedding.ebc.embedding_bag_configs(),
        *(ec.embedding_configs() if ec is not None else []),
    ]
    need = sum(c.num_embeddings * c.embedding_dim * size for c in configs)
    failed = f"; the allocation that failed: {tried:,} bytes" if tried else ""
    # A causal encoder's position embeddings (max_len x dim, dense: neither shards nor more ranks shrink
    # them) are the allocation that failed when its size is theirs.
    for name, enc in (model.embedding.encoders or {}).items():
        w = enc.positions.weight if isinstance(enc, SequenceEncoder) and enc.positions is not None else None
        if tried and w is not None and tried == w.numel() * w.element_size():
            return ResourceError(
                f"rank {env.rank}: out of memory allocating the position embeddings of sequence feature "
                f"'{name}' (max_len {w.shape[0]:,} x model.embedding.dim {w.shape[1]}{failed}): the "
                f"{cfg.model.embedding.sequence.encoder} encoder learns one per position up to max_len; "
                f"lower the max_len of '{name}' in data.schema.sparse"
            )
    n = env.world_size
    how = (
        "every rank first builds all of them: set distributed.materialize: shards"
        if cfg.distributed.materialize == "full"
        else f"this rank holds its share of them over {n} rank{'s' * (n > 1)}: run on more ranks (--nproc)"
    )
    return ResourceError(
        f"rank {env.rank}: out of memory allocating the embedding tables ({need:,} bytes in all{failed}); "
        f"{how}, or shrink them (model.embedding.dim, hash_buckets, qr_buckets)"
    )


def build(
    cfg: RunConfig,
    features: FeatureSet,
    env: DistEnv,
    sample: KeyedJaggedTensor | None = None,
    dmt_hosts: int | None = None,
) -> Built:
    """The run's model on this rank, seeded by ``cfg.seed`` (every rank builds the same one first).
    ``sample``: a batch of training ids, from which the learned sharding planner reads table features.
    ``dmt_hosts``: a DMT model of that many hosts' towers, all in this one process (to score a run),
    instead of one tower per host of this job."""
    check_features(cfg, features)
    opt_cls, opt_kw = sparse_optimizer(cfg.train.sparse_optimizer, env.device, cfg.dense_tables())
    if cfg.dmt is not None:
        from recscale.distributed.dmt.build import build_dmt, build_local

        dmt: DMTModel | LocalDMT
        if dmt_hosts is None:
            dmt, tables, u = build_dmt(cfg, features, env, (opt_cls, opt_kw))
        else:
            dmt, tables, u = build_local(cfg, features, env, (opt_cls, opt_kw), dmt_hosts)
        module, model = dmt, dmt
        counts, flops = u.counts, u.dense_flops
        table_params = {id(p) for p in tables.params.values()}
        dense_params = {
            n: p
            for n, p in in_backward_optimizer_filter(module.named_parameters())
            if id(p) not in table_params
        }
    else:
        try:
            flat = flat_model(cfg, features)
            counts, flops = count_parameters(flat), flat.flops_per_example()
            # apply_optimizer_in_backward adds its own keys to the kwargs it is given: hand it a copy.
            apply_optimizer_in_backward(opt_cls, flat.embedding.table_parameters(), dict(opt_kw))
            dense_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
            module, tables = shard_model(
                flat, env, cfg.distributed, (opt_cls, opt_kw), dense_dtype=dense_dtype, sample=sample
            )
        except RuntimeError as e:
            if (tried := failed_allocation(e)) is None:
                raise
            raise _model_does_not_fit(cfg, features, env, tried) from None
        model = get_unwrapped_module(module)
        dense_params = {
            n: p for n, p in in_backward_optimizer_filter(module.named_parameters()) if n not in tables.params
        }
        if cfg.train.compile:  # the dense part only: TorchRec's sharded lookups and KJTs do not trace well
            flat.interact = torch.compile(flat.interact)  # type: ignore[method-assign]
    dense = KeyedOptimizerWrapper(dense_params, dense_optimizer_factory(cfg.train.dense_optimizer))
    return Built(module, model, tables, dense, counts, int(flops))
