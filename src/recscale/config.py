"""One validated config for a run: YAML in, typed object out.

``load_config(path, overrides)`` reads YAML, applies dotted ``key=value`` overrides (values parsed
as YAML, so ``train.dense_optimizer.lr=0.01`` is a float and ``model.fmb_mlp=[64,64]`` a list), and validates
everything. Any unknown key, wrong type or impossible value becomes one ``ConfigError`` line that
names the key.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from recscale.config_files import apply_overrides, load_raw, not_a_file
from recscale.data.readers import WEIGHTED_FORMATS, validate_options
from recscale.data.schema import Schema
from recscale.data.synthetic import SyntheticSpec
from recscale.errors import ConfigError
from recscale.models.embedding import EmbeddingConfig
from recscale.models.quant import QuantConfig
from recscale.models.registry import model_names, params_class
from recscale.settings import Settings

# The smallest per-step shrink of train.table_weight_decay that fp16 table rows resolve: fp16 holds 11
# significant bits, so w * (1 - shrink) rounds back to w for rows whose mantissa is near 1.
FP16_SHRINK = 2**-11


class DataConfig(Settings):
    """Where the data is and how to read it. Relative paths are resolved against the working directory; a
    leading ``~`` is the home directory."""

    format: Literal["csv", "libsvm", "criteo", "movielens", "parquet", "synthetic"]
    train: str | None = None
    valid: str | None = None
    test: str | None = None
    schema_: Schema | None = Field(None, alias="schema")
    options: dict[str, Any] = {}
    synthetic: SyntheticSpec | None = None
    # Hold this fraction of the valid rows out of every selection decision (early stopping, LR drops, the
    # kept checkpoint): valid is the rest, and the held-out rows are scored once, at the end, as the
    # report's "report" split, on which nothing was tuned.
    report_fraction: float | None = Field(None, gt=0, lt=1)
    # One file and no valid split of its own: this fraction of data.train's rows (a fixed hash of the row's
    # position among the rows read) is the valid split, and the training split is the rest: vocabularies
    # and scalers are fitted on the rest only. report_fraction then cuts those valid rows in two.
    valid_fraction: float | None = Field(None, gt=0, lt=1)
    # Negative downsampling (He et al., "Practical Lessons from Predicting Clicks on Ads at Facebook"): train on
    # every positive and this fraction w of the training split's negatives (a fixed hash of the row picks
    # them), with log(1/w) added to the logits in the training loss only: the model's own predictions stay
    # calibrated to the unsampled data (valid, test, eval, serve), with no recalibration step.
    negative_sampling_rate: float | None = Field(None, gt=0, le=1)
    chunk_rows: int = Field(65536, ge=1)
    on_bad_row: Literal["error", "skip"] = "error"
    num_workers: int = Field(1, ge=0)
    # A directory written by `recscale data prepare` from this same data section: the run reads its
    # vocabularies and splits (never writes them), so several runs share one preparation.
    prepared: str | None = Field(None, min_length=1)

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @field_validator("train", "valid", "test", "prepared")
    @classmethod
    def _home(cls, v: str | None) -> str | None:
        # "~/data/x.csv" in YAML or an override: no shell expands it there, and it was "no such file".
        return os.path.expanduser(v) if v is not None and v.startswith("~") else v

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.format == "synthetic":
            # No reader runs: a path or a schema given here would be dropped without a word (the run trained
            # on the teacher's data, not on the file data.train names).
            given = [k for k, v in (("train", self.train), ("valid", self.valid), ("test", self.test),
                                    ("schema", self.schema_), ("valid_fraction", self.valid_fraction))
                     if v is not None]  # fmt: skip
            if given:
                raise ValueError(
                    f"data.{given[0]}: format 'synthetic' reads no file and takes no {given[0]} (its splits "
                    "are data.synthetic.rows, its features data.synthetic); set data.format to the file's "
                    f"format or drop data.{given[0]}"
                )
            if self.synthetic is None:
                self.synthetic = SyntheticSpec()
            if "train" not in self.synthetic.rows:
                raise ValueError(
                    "data.synthetic.rows has no train split: give its rows, e.g. "
                    "data.synthetic.rows={train: 100000, valid: 10000, test: 10000}"
                )
        else:
            if self.synthetic is not None:
                raise ValueError(
                    f"data.synthetic: format '{self.format}' reads data.train, not the synthetic teacher's "
                    "data; drop data.synthetic or set data.format=synthetic"
                )
            if self.train is None:
                raise ValueError("data.train is required: the path of the training file")
            if self.schema_ is None:
                raise ValueError(
                    f"data.schema is required for format '{self.format}': list the label and features"
                )
            if self.schema_.weight is not None and self.format not in WEIGHTED_FORMATS:
                raise ValueError(
                    f"data.schema.weight: format '{self.format}' has a fixed layout with no column of row weights "
                    "(csv and parquet read one); drop data.schema.weight"
                )
            if self.valid_fraction is not None and (self.valid is not None or self.format == "movielens"):
                which = (
                    "data.valid names a file of its own"
                    if self.format != "movielens"
                    else "format movielens splits its ratings by time into train, valid and test"
                )
                raise ValueError(
                    f"data.valid_fraction holds rows of data.train out as the valid split, but {which}: "
                    "drop data.valid_fraction"
                )
            if self.format == "movielens":
                # One directory holds all splits; the split is a reader option.
                self.valid = self.valid or self.train
                self.test = self.test or self.train
        return self

    @property
    def schema(self) -> Schema:  # type: ignore[override]  # shadows pydantic's deprecated v1 BaseModel.schema()
        if self.format == "synthetic":
            from recscale.data.synthetic import synthetic_schema

            assert self.synthetic is not None  # _check fills it
            return synthetic_schema(self.synthetic)
        assert self.schema_ is not None  # _check requires it for file formats
        return self.schema_


class ModelConfig(Settings):
    """``name`` picks the model from the registry; the other keys are that model's parameters."""

    name: str
    embedding: EmbeddingConfig = EmbeddingConfig()
    # Low-precision GEMMs of the model's linear layers (recscale.models.quant); a declared field, so
    # not one of the model's own parameters (those are ``model_extra``).
    quant: QuantConfig | None = None
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # the extras: the model's parameters

    @model_validator(mode="after")
    def _known(self) -> ModelConfig:
        if self.name not in model_names():
            raise ValueError(f"unknown model '{self.name}'; known models: {', '.join(model_names())}")
        return self

    @property
    def params(self) -> BaseModel:
        return params_class(self.name).model_validate(self.model_extra or {})


class OptimizerConfig(Settings):
    name: str
    lr: float = Field(gt=0)
    weight_decay: float = Field(0.0, ge=0)
    eps: float = Field(1e-8, gt=0)


class EarlyStopping(Settings):
    # auc and ne are undefined on a valid split of one class: early stopping compares logloss there (warned).
    # gauc: group AUC over train.group_by's ids (a user's rows ranked among themselves).
    metric: Literal["auc", "logloss", "ne", "gauc"] = "auc"
    patience: int = Field(2, ge=1)
    min_delta: float = Field(0.0, ge=0)
    # Multiply every learning rate (dense and tables) by this on each evaluation without improvement.
    reduce_lr_factor: float | None = Field(None, gt=0, lt=1)
    # Also go back to the best weights (optimizer state kept) on each evaluation without improvement, so the
    # reduced LR fine-tunes the peak instead of weights that have already overfitted.
    restore_best: bool = False

    @model_validator(mode="after")
    def _patience_leaves_room(self) -> EarlyStopping:
        # Both act on an evaluation without improvement that does not stop the run: with patience 1 the first
        # such evaluation stops it, and they were dropped without a word.
        given = [k for k in ("reduce_lr_factor", "restore_best") if getattr(self, k)]
        if given and self.patience == 1:
            raise ValueError(
                f"{given[0]} acts on an evaluation without improvement that does not stop the run, and with "
                "patience 1 the first one stops it; raise patience or drop it"
            )
        return self


class TrainConfig(Settings):
    batch_size: int = Field(4096, ge=1)
    epochs: int = Field(10, ge=1)
    max_steps: int | None = Field(None, ge=1)
    dense_optimizer: OptimizerConfig = OptimizerConfig(name="adam", lr=1e-3)
    sparse_optimizer: OptimizerConfig = OptimizerConfig(name="rowwise_adagrad", lr=0.05)
    warmup_steps: int = Field(0, ge=0)
    lr_decay: Literal["none", "cosine", "linear"] = "none"
    grad_clip: float | None = Field(None, gt=0)
    # L2 penalty on the batch's embedding vectors X0, added to the loss: regularises the looked-up
    # rows of the tables (frequent ids more).
    embedding_l2: float = Field(0.0, ge=0)
    # Decoupled weight decay of every table row after each step (row *= 1 - table lr x this): shrinks
    # rows that are rarely looked up too, like FuxiCTR's embedding_regularizer (an L2 on whole tables,
    # which fbgemm's fused kernels cannot take through the loss).
    table_weight_decay: float = Field(0.0, ge=0)
    # Evaluate, keep as best and report an exponential moving average of the dense weights (per-step
    # decay; the tables are not averaged: the fused kernels own them). None trains and reports the raw weights.
    ema_decay: float | None = Field(None, gt=0, lt=1)
    # After training, fit Platt scaling (sigmoid(a·logit + b)) of the kept model on the valid split (the
    # selection rows under data.report_fraction) by LogLoss; stored in the model, so eval, export and serve
    # apply it. Fixes over-confidence without moving AUC.
    calibrate: bool = False
    eval_every: int | None = Field(None, ge=1)  # steps; None = once per epoch
    # A single-id sparse feature (e.g. user_id): every evaluation also reports the group AUC over its ids
    # (gauc, gauc_groups, gauc_rows), which early_stopping.metric=gauc can stop on.
    group_by: str | None = None
    early_stopping: EarlyStopping | None = EarlyStopping()
    keep_checkpoints: int = Field(2, ge=1)
    log_every: int = Field(50, ge=1)
    progress: bool = True
    # Compute precision of the dense network: bf16 = autocast mixed precision (fp32 master weights,
    # optimizer state, loss and metrics; see recscale.train.precision).
    precision: Literal["fp32", "bf16"] = "fp32"
    # Keep memory a step frees for the next step (glibc's malloc without mmap, high trim threshold; see
    # train/memory.py): no page faults on each step's large activations. Process-wide until
    # Trainer.fit() returns or raises, which undoes it; false = the C library's defaults.
    reuse_memory: bool = True
    # torch.compile the model's dense interaction (not the embedding lookups); see docs/BENCHMARKS.md
    compile: bool = False
    # Warm start: a run directory whose kept model (best/, else its latest checkpoint) this run starts from,
    # dense weights and tables, on new data mapped with that run's vocabularies and scalers (ids it never
    # saw are out of vocabulary); the optimizer state, the step count and the learning-rate schedule start
    # afresh. The model section must be that run's.
    init_from: str | None = Field(None, min_length=1)

    @field_validator("init_from")
    @classmethod
    def _home(cls, v: str | None) -> str | None:
        return os.path.expanduser(v) if v is not None and v.startswith("~") else v

    @model_validator(mode="after")
    def _optimizers(self) -> TrainConfig:
        dense_ok, sparse_ok = (
            ("adam", "adamw", "sgd", "adagrad"),
            ("rowwise_adagrad", "adagrad", "sgd", "adam"),
        )
        if self.dense_optimizer.name not in dense_ok:
            raise ValueError(
                f"train.dense_optimizer.name '{self.dense_optimizer.name}': use one of {dense_ok}"
            )
        if self.sparse_optimizer.name not in sparse_ok:
            raise ValueError(
                f"train.sparse_optimizer.name '{self.sparse_optimizer.name}': use one of {sparse_ok}"
            )
        for key, opt in (
            ("dense_optimizer", self.dense_optimizer),
            ("sparse_optimizer", self.sparse_optimizer),
        ):
            # SGD divides by no running average: an eps would be dropped without a word.
            if opt.name == "sgd" and opt.changed("eps"):
                raise ValueError(f"train.{key}.eps: sgd takes no eps; drop it or choose another optimizer")
        return self


ShardingTypeName = Literal[
    "data_parallel", "table_wise", "column_wise", "row_wise", "table_row_wise", "table_column_wise"
]


class TablePlan(Settings):
    """Where one feature's table goes. Unset placements are chosen to balance the ranks."""

    type: ShardingTypeName
    # table_column_wise / column_wise: one per shard (table_column_wise: of its host)
    ranks: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)
    host: int | None = Field(None, ge=0)  # table_row_wise / table_column_wise: the host holding the table

    @model_validator(mode="after")
    def _placement(self) -> TablePlan:
        if self.ranks is not None and self.type not in ("table_wise", "column_wise", "table_column_wise"):
            raise ValueError(
                f"ranks applies to table_wise, column_wise and table_column_wise tables, not {self.type}"
            )
        if self.ranks is not None and self.type == "table_wise" and len(self.ranks) != 1:
            raise ValueError(f"a table_wise table lives on one rank; got ranks {self.ranks}")
        if self.host is not None and self.type not in ("table_row_wise", "table_column_wise"):
            raise ValueError(f"host applies to table_row_wise and table_column_wise tables, not {self.type}")
        return self


CommPrecision = Literal["fp32", "fp16", "bf16", "int8", "mx4", "fp8", "mxint8"]


class QComms(Settings):
    """``distributed.qcomms``: precision on the wire. On CPU (gloo) fbgemm's codecs take fp16 for every
    sharding type and int8 / mx4 for table- and column-wise all-to-alls; bf16 becomes fp16 on CPU; fp8
    and mxint8 are recscale's row-wise codecs (``distributed/codecs.py``; mxint8 is int8 with one E8M0 byte
    per 32 values: ÷3.88 where fbgemm's int8 gives ÷3.2; row-wise tables' reduce-scatter stays fp16)."""

    forward: CommPrecision = "fp32"
    backward: CommPrecision = "fp32"
    dense: Literal["fp32", "fp16", "bf16"] = "fp32"  # DDP's gradient all-reduce


class LearnedConfig(Settings):
    """``distributed.sharding: learned``: the learned planner's memory cap and cost models."""

    memory_cap_mb: float | None = Field(None, gt=0)  # per rank: table weights and optimizer state
    cost_models: str | None = None  # a file of bench/train_cost_models.py; None: the shipped models


class DistributedConfig(Settings):
    """How a multi-process run splits the model: tables sharded by TorchRec, the dense part data-parallel."""

    # Every table not listed in ``tables``: one sharding type, or "planner" for TorchRec's planner
    # (restricted to fused kernels; on CPU it offers table_wise, column_wise and table_column_wise), or
    # "learned" for recscale's learned planner (distributed/planner/, docs/SHARDING.md).
    sharding: Literal["planner", "learned"] | ShardingTypeName = "table_wise"
    learned: LearnedConfig = LearnedConfig()
    tables: dict[str, TablePlan] = {}  # sparse feature name -> its table's explicit plan
    dense: Literal["ddp", "fsdp"] = "ddp"  # fsdp: FSDP2 fully_shard, for dense networks too big to replicate
    # full: every rank builds the whole model, then keeps its shards (the same initial tables whatever
    # the plan, so plans compare step for step); shards: the tables are built on the meta device and
    # TorchRec allocates and initialises only this rank's shards (tables larger than one process).
    materialize: Literal["full", "shards"] = "full"
    # Seconds a rank waits on a collective (and on rank 0 preprocessing the data) before failing.
    timeout_s: float = Field(1800, gt=0)
    # Count the bytes every collective sends (intra/inter host) into metrics.jsonl. Off by default:
    # it wraps torch.distributed's collectives and routes DDP's all-reduce through a Python hook.
    count_bytes: bool = False
    # Quantized collectives: the embedding all-to-all / reduce-scatter through TorchRec's codecs
    # (forward: pooled embeddings, backward: their gradients), and the dense all-reduce (DDP hook).
    qcomms: QComms = QComms()
    # FreeScale-style balancing (recscale/distributed/balance.py): split each global batch across ranks by
    # predicted cost (1 + history tokens, 1 + tokens² for attention, or the model's FLOPs per sample
    # from its history lengths) instead of contiguous slices.
    balance: Literal["none", "tokens", "tokens2", "flops"] = "none"

    @model_validator(mode="after")
    def _learned_options(self) -> DistributedConfig:
        # A cap or cost models under another sharding would be dropped without a word.
        given = [k for k, v in self.learned.model_dump().items() if v is not None]
        if given and self.sharding != "learned":
            raise ValueError(
                f"learned.{given[0]} applies to sharding: learned, and sharding is {self.sharding}; "
                "set distributed.sharding=learned or drop it"
            )
        return self

    @model_validator(mode="after")
    def _qcomms_need_an_all_to_all(self) -> DistributedConfig:
        # Replicated tables send no embeddings: the codecs would be dropped without a word.
        q = self.qcomms
        if (
            self.sharding == "data_parallel"
            and all(t.type == "data_parallel" for t in self.tables.values())  # none sharded by a plan either
            and (q.forward, q.backward) != ("fp32", "fp32")
        ):
            raise ValueError(
                "qcomms.forward and qcomms.backward quantize the embedding all-to-all, which data_parallel "
                "tables do not send; shard the tables (e.g. distributed.sharding=table_wise) or leave them fp32"
            )
        return self

    @model_validator(mode="after")
    def _dense_qcomms_need_ddp(self) -> DistributedConfig:
        # Found by the config, before any rank starts (the wrapper found it after the launch).
        if self.dense == "fsdp" and self.qcomms.dense != "fp32":
            raise ValueError(
                "qcomms.dense compresses DDP's all-reduce, which FSDP (dense: fsdp) does not run; "
                "leave qcomms.dense fp32 or set dense: ddp"
            )
        return self

    def check_world_size(self, world_size: int) -> None:
        """What needs more than one rank. Not a validator: the number of ranks is known only at launch."""
        # One process sends nothing between ranks: TorchRec skips the embedding codecs in a group of one
        # (its all-to-all hands the input back), while DDP's compression hook (qcomms.dense) still rounds
        # every dense gradient to fp16/bf16, with nothing sent: neither is what qcomms means.
        if world_size == 1 and self.qcomms != QComms():
            raise ConfigError(
                "distributed.qcomms quantizes the collectives between ranks, and this run is one process "
                "(no collectives); train on more ranks (CLI: --nproc N) or leave qcomms fp32"
            )


class TowerModuleConfig(Settings):
    """DMT's tower module: compresses a tower's n_t embeddings to ceil(n_t / compression) before they
    leave the host. identity (compression 1) computes exactly what the flat model computes."""

    type: Literal["identity", "lcb", "projection", "wukong"] = "identity"
    compression: float = Field(1.0, ge=1)

    @model_validator(mode="after")
    def _identity(self) -> TowerModuleConfig:
        if self.type == "identity" and self.compression != 1:
            raise ValueError("an identity tower module cannot compress; use lcb, projection or wukong")
        return self


class DMTConfig(Settings):
    """Disaggregated Multi-Tower training (docs/DMT.md): one tower of features per host."""

    towers: Annotated[int, Field(ge=1)] | Literal["auto"] = (
        "auto"  # must equal the number of hosts; auto = that number
    )
    # round_robin | random (over features in schema order) | a JSON file from `recscale dmt partition`
    # | an explicit {feature: tower} mapping
    assignment: Literal["round_robin", "random"] | str | dict[str, Annotated[int, Field(ge=0)]] = (
        "round_robin"
    )
    tower_module: TowerModuleConfig = TowerModuleConfig()
    # How each host shards its tower's tables over its own ranks.
    sharding: Literal["table_wise", "row_wise", "column_wise"] = "table_wise"


class RunConfig(Settings):
    seed: int = Field(0, ge=0, lt=2**63)  # torch and numpy take 64-bit seeds
    data: DataConfig
    model: ModelConfig
    train: TrainConfig = TrainConfig()
    distributed: DistributedConfig = DistributedConfig()
    dmt: DMTConfig | None = None

    @model_validator(mode="after")
    def _table_weight_decay(self) -> RunConfig:
        # Only replicated tables (dense kernel, a torch optimizer) take it; fbgemm's fused kernels ignore it.
        if self.train.sparse_optimizer.weight_decay and not self.dense_tables():
            raise ValueError(
                "train.sparse_optimizer.weight_decay needs every table data_parallel "
                "(distributed.sharding=data_parallel, no distributed.tables, no dmt): fbgemm's fused "
                "kernels ignore it; otherwise regularise with train.embedding_l2 or train.table_weight_decay"
            )
        replicated = self.distributed.sharding == "data_parallel" or any(
            t.type == "data_parallel" for t in self.distributed.tables.values()
        )
        if self.model.embedding.storage == "fp16" and replicated:
            raise ValueError(
                "model.embedding.storage=fp16 needs tables sharded with the fused optimizer (fp32 state): "
                "a data_parallel table would be stepped by a torch optimizer on fp16 weights; choose "
                "another distributed.sharding (e.g. table_wise) or storage fp32"
            )
        shrink = self.train.sparse_optimizer.lr * self.train.table_weight_decay
        if self.model.embedding.storage == "fp16" and 0 < shrink < FP16_SHRINK:
            # The decay would do nothing, without a word.
            raise ValueError(
                f"train.table_weight_decay shrinks each row by table lr x decay = {shrink:.2g} a step, "
                "under what model.embedding.storage=fp16 resolves (2^-11 = 4.9e-4): the fp16 rows would "
                "round the shrink away; use storage fp32, or train.embedding_l2"
            )
        es = self.train.early_stopping
        if es is not None and es.metric == "gauc" and self.train.group_by is None:
            raise ValueError(
                "train.early_stopping.metric=gauc is the group AUC over train.group_by's ids, which is not set: "
                "name the single-id feature to group by (e.g. train.group_by=user_id)"
            )
        synthetic = self.data.synthetic if self.data.format == "synthetic" else None
        if (
            ("valid" not in synthetic.rows)
            if synthetic
            else self.data.valid is None and self.data.valid_fraction is None
        ):
            where = (
                "data.synthetic.rows has no valid"
                if synthetic
                else "data.valid is not set (nor data.valid_fraction)"
            )
            # Both need a valid split: report_fraction without one was dropped without a word.
            if self.train.calibrate:
                raise ValueError(f"train.calibrate fits on the valid split, and {where}: give one")
            if self.data.report_fraction is not None:
                raise ValueError(
                    f"data.report_fraction holds out rows of the valid split, and {where}: give one"
                )
        return self

    @model_validator(mode="after")
    def _dense_mlp_needs_dense_features(self) -> RunConfig:
        # The dense MLP is built from the dense features: without any, its widths were dropped without a word.
        if self.model.embedding.dense_hidden and not self.data.schema.dense:
            raise ValueError(
                "model.embedding.dense_hidden: the data has no dense feature, so no dense MLP is built; drop it"
            )
        return self

    @model_validator(mode="after")
    def _sequence_encoder_reads(self) -> RunConfig:
        # Each encoder reads its own keys only: another's would be dropped without a word. (Compared with
        # the defaults: a run's config.yaml holds every key.)
        seq = self.model.embedding.sequence
        unread = {"causal": ("target", "attention_hidden", "softmax"), "din": ("layers", "heads")}
        bad = [k for k in unread.get(seq.encoder, ()) if seq.changed(k)]
        if bad:
            raise ValueError(
                f"model.embedding.sequence.{bad[0]}: the {seq.encoder} encoder does not use it "
                f"({'causal_din or din' if seq.encoder == 'causal' else 'causal_din or causal'} does); "
                f"drop it or choose that encoder"
            )
        return self

    @model_validator(mode="after")
    def _balance_needs_sequences(self) -> RunConfig:
        # Every cost model prices a sample by its history lengths: without one, all samples cost the same and
        # the "balanced" split is the even one, without a word.
        balance = self.distributed.balance
        if balance != "none" and not any(f.sequence for f in self.data.schema.sparse):
            raise ValueError(
                f"distributed.balance={balance} splits batches by history length, and the schema has no "
                "sequence feature (a sparse feature with max_len); set distributed.balance=none"
            )
        return self

    @model_validator(mode="after")
    def _dmt_supports(self) -> RunConfig:
        # Checked here, once, rather than by every rank after a --nproc launch (one line, not N + 1).
        if self.dmt is None:
            return self
        unsupported = {
            "model.embedding.small_dim_features": bool(self.model.embedding.small_dim_features),
            "train.compile": self.train.compile,
            "model.quant": self.model.quant is not None,
            "distributed.dense=fsdp": self.distributed.dense == "fsdp",
            "distributed.tables (a host's tables follow dmt.sharding)": bool(self.distributed.tables),
            # DMT shards each tower by dmt.sharding, from a whole model every rank builds: both were dropped.
            "distributed.sharding (a host's tables follow dmt.sharding)": (
                self.distributed.sharding != "table_wise"
            ),
            "distributed.materialize=shards": self.distributed.materialize == "shards",
            # DMT's towers and top are sharded and wrapped without the codecs or the compression hook.
            "distributed.qcomms": self.distributed.qcomms != QComms(),
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(
                f"dmt: not supported together with {', '.join(bad)}; drop {'them' if len(bad) > 1 else 'it'} or dmt"
            )
        return self

    def dense_tables(self) -> bool:
        """Every table is data_parallel: trained by a torch optimizer on the dense kernel's weights."""
        return (
            self.dmt is None
            and self.distributed.sharding == "data_parallel"
            and all(t.type == "data_parallel" for t in self.distributed.tables.values())
        )

    def to_yaml(self) -> str:
        return yaml.safe_dump(
            self.model_dump(mode="json", by_alias=True, exclude_none=False), sort_keys=False
        )


def _item_name(raw: object, loc: tuple[int | str, ...]) -> str | None:
    """The ``name`` of the innermost list item on ``loc``'s path through ``raw`` (a schema feature), if any."""
    name = None
    for step in loc:
        if isinstance(raw, dict) and step in raw:
            raw = raw[step]
        elif isinstance(raw, list) and isinstance(step, int) and 0 <= step < len(raw):
            raw = raw[step]
            if isinstance(raw, dict) and isinstance(raw.get("name"), str):
                name = raw["name"]
        elif step != "function-after":
            break
    return name


# The tags pydantic puts in an error's location for the branch of a union type it tried; a plain type name
# only as the last step (a feature may be called "str", but a type name ends a location).
_UNION_BRANCH = re.compile(r"literal\[.*\]|constrained-\w+|(list|dict|function-\w+)\[.*\]")
_UNION_LEAF = re.compile(r"int|float|str|bool|none")


def field_paths(cls: type[BaseModel], prefix: str = "") -> Iterator[str]:
    """Every dotted key of ``cls`` and of the models its fields hold (through Optional and unions, not
    through the values of a dict or list, whose keys and indexes are data)."""
    for name, field in cls.model_fields.items():
        yield prefix + (field.alias or name)
        todo, seen = [field.annotation], set()
        while todo:  # the models inside the annotation: X, X | None, Annotated[X | Y, ...]
            a = todo.pop()
            if isinstance(a, type) and issubclass(a, BaseModel) and a not in seen:
                seen.add(a)
                yield from field_paths(a, f"{prefix}{field.alias or name}.")
            elif get_origin(a) in (Union, UnionType, Annotated):  # not into a dict's values: keys are names
                todo += get_args(a)


def _did_you_mean(paths: list[str], where: str, key: str) -> list[str]:
    """Up to three of the dotted ``paths`` the unknown ``where.key`` may have meant: a close spelling at
    its level, else a key of that name one or more levels down."""
    under = f"{where}." if where else ""
    level = [p for p in paths if p.startswith(under) and "." not in p[len(under) :]]
    last = {p: p.rsplit(".", 1)[-1] for p in paths}
    near = [p for p in level if last[p] in difflib.get_close_matches(key, [last[p] for p in level], 3, 0.75)]
    if not near:
        deeper = [p for p in paths if p.startswith(under) and p not in level]
        near = [p for p in deeper if last[p] == key]  # not elsewhere: another section's "type" misleads
    return near[:3]


def format_validation_error(
    e: ValidationError, section: str = "", raw: object = None, keys: list[str] | None = None
) -> str:
    """One line of ``e``'s errors, each named by its dotted key under ``section`` (e.g. ``model``), and by
    the name of the list item it is in where ``raw`` (the validated data) gives one: a feature's index in
    ``data.schema.sparse`` alone does not say which it is. The branches of a union type are one key's
    errors, said once (``distributed.sharding.literal['planner','learned']: ...; distributed.sharding.literal[
    'data_parallel',...]: ...`` left the user to piece the allowed values together). ``keys``: every
    dotted key the config has, so an unknown key can name those it may have meant (``train.lr``:
    train.dense_optimizer.lr)."""
    parts: dict[str, list[str]] = {}
    allowed: dict[str, list[str]] = {}  # per key, the values its Literal errors allow
    for err in e.errors():
        *steps, last = err["loc"] or ("",)
        path = [x for x in steps if x != "function-after" and not _UNION_BRANCH.fullmatch(str(x))]
        if not (_UNION_BRANCH.fullmatch(str(last)) or _UNION_LEAF.fullmatch(str(last))):
            path.append(last)
        loc = ".".join(k for k in (section, ".".join(map(str, path))) if k) or "config"
        loc = loc.replace("schema_", "schema")
        if (name := _item_name(raw, err["loc"])) is not None:
            loc += f" ({name!r})"
        msg = err["msg"].removeprefix("Value error, ")
        # YAML's {format:mxfp4}: an unknown key, or in a mapping of names (rows, qr_buckets) a key without a value.
        if (
            err["loc"]
            and ":" in str(err["loc"][-1])
            and (err["type"] == "extra_forbidden" or err.get("input", 0) is None)
        ):
            name, _, value = str(err["loc"][-1]).partition(":")
            what = "unknown key" if err["type"] == "extra_forbidden" else "a key without a value"
            msg = f"{what} (YAML reads a colon without a space as part of the key: write '{name}: {value}')"
        elif err["type"] == "extra_forbidden":
            where = ".".join(k for k in (section, ".".join(map(str, path[:-1]))) if k)
            near = _did_you_mean(keys, where, str(last)) if keys else []
            hint = f"; did you mean {' or '.join(near)}?" if near else ""
            msg = f"unknown key (check the spelling; see configs/ for examples){hint}"
        elif err["type"] == "literal_error":
            allowed.setdefault(loc, []).extend(re.findall(r"'[^']*'", err["ctx"]["expected"]))
        parts.setdefault(loc, []).append(msg)
    for loc, values in allowed.items():
        if sum(m.startswith("Input should be '") for m in parts[loc]) > 1:  # Literal | Literal
            others = [m for m in parts[loc] if not m.startswith("Input should be '")]
            parts[loc] = [*others, "Input should be one of " + ", ".join(values)]
    return "; ".join(f"{loc}: {', or '.join(msgs)}" for loc, msgs in parts.items())


def validate_config(raw: dict) -> RunConfig:
    try:
        cfg = RunConfig.model_validate(raw)
        model_params = cfg.model.params  # validates the model's own parameters
    except ValidationError as e:
        section = "model" if e.title != "RunConfig" else ""
        within = raw.get("model") if section else raw
        name = raw.get("model", {}).get("name") if isinstance(raw.get("model"), dict) else None
        params = field_paths(params_class(name), "model.") if name in model_names() else ()
        keys = [*field_paths(RunConfig), *params]
        raise ConfigError(f"invalid config: {format_validation_error(e, section, within, keys)}") from None
    if (
        getattr(model_params, "norm", None) == "batch" and cfg.train.batch_size == 1
    ):  # torch's error, mid-training
        raise ConfigError(
            "model.norm=batch normalises over the batch, and train.batch_size is 1 (one value per channel); "
            "train with larger batches or another model.norm"
        )
    if getattr(model_params, "norm", None) == "batch" and cfg.distributed.balance != "none":
        # Each rank normalises over its own rows, and balancing hands them out by history length: the model
        # would depend on the split (not the same losses as without it), and a rank can get a single row.
        raise ConfigError(
            f"model.norm=batch normalises over each rank's rows, which distributed.balance="
            f"{cfg.distributed.balance} picks by history length (the model would depend on the split, and a rank "
            "can hold one row); use model.norm=layer, or distributed.balance=none"
        )
    if cfg.data.format != "synthetic":  # checked now, not when the first file is read
        validate_options(cfg.data.format, cfg.data.options)
    elif cfg.data.options:  # no reader would ever see them
        raise ConfigError(
            f"data.options: format 'synthetic' reads no file and takes none (got {', '.join(cfg.data.options)}); "
            "its settings are data.synthetic"
        )
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(not_a_file(path, "config file"))
    return validate_config(apply_overrides(load_raw(path), overrides or []))
