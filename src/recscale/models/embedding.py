"""The embedding layer shared by all models: dense and sparse features -> X0 (B, n, d).

X0 stacks, along the embedding axis, in this order:

1. ``dense_embeddings`` vectors from an MLP on the dense features (DLRM's bottom MLP);
2. one vector per sparse feature from its table, or ``m`` vectors for a multi-embedding feature
   (table dim m·d, split into m vectors);
3. ceil(k·small_dim/d) vectors mapped by a linear layer from the concatenated small-dim tables of the
   k ``small_dim_features`` (Wukong's option for low-cardinality features);
4. one vector per sequence feature (``max_len`` set: an ordered id list such as a user history): its
   ids are embedded position by position and pooled by a ``SequenceEncoder`` (DIN target attention
   and/or causal transformer blocks, ``sequence``), so every model reads the history as extra
   embeddings. Sequences that take another feature's ``vocabulary`` (a history of items with
   ``item_id``'s ids) share one table, which also embeds that feature when it is the attention target:
   DIN's shared item embeddings, so the target and the history it attends over live in one space and
   the table learns from every row's target, not only through the history path.

A ``qr_buckets`` feature (quotient-remainder embeddings, Shi et al., KDD 2020) has two tables instead of
one: id -> (id // m, id % m) looks up a ceil(N/m)-row and an m-row table, and its vector is their
element-wise product (``qr_op: mult``) or sum (``add``): about N/m + m rows instead of N, and unlike hashing
no two ids share a vector. For a bag of several ids the two pooled vectors are combined (a product of sums
under ``mult``).

The pooled tables live in one TorchRec ``EmbeddingBagCollection``, the sequence tables in one
``EmbeddingCollection`` (no pooling: one vector per position); both are only ever called, so
``DistributedModelParallel`` can shard and replace them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from pydantic import Field, field_validator, model_validator
from torch import Tensor, nn
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_configs import EmbeddingConfig as SequenceTableConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from recscale.models.blocks.mlp import MLP
from recscale.models.blocks.sequence import SequenceConfig, SequenceEncoder
from recscale.models.flops import module_flops
from recscale.settings import Settings

_Table = TypeVar("_Table", EmbeddingBagConfig, SequenceTableConfig)
# fbgemm's GPU kernels need every table dim to be a multiple of 4.
_DIM_MULTIPLE = 4


@dataclass(frozen=True)
class SparseInput:
    """A sparse feature as the model sees it."""

    name: str
    num_embeddings: int  # vocabulary size incl. the OOV id 0
    pooling: Literal["sum", "mean"] = "sum"  # for multi-id features
    weighted: bool = False
    max_len: int | None = None  # a sequence feature: ids embedded per position, at most max_len
    vocabulary: str | None = None  # the feature whose ids (and, for a sequence, table) it shares


@dataclass(frozen=True)
class FeatureSet:
    """The model's inputs: sparse features in KJT key order and the number of dense features."""

    sparse: tuple[SparseInput, ...]
    num_dense: int


class EmbeddingConfig(Settings):
    """How features become the embedding matrix X0 (B, n, d)."""

    dim: int = Field(16, gt=0)  # the one global embedding dim d
    init_std: float = Field(1e-4, gt=0)
    # How many d-vectors the dense-feature MLP emits; None = 1 if there are dense features else 0.
    dense_embeddings: int | None = Field(None, ge=0)
    dense_hidden: list[int] = []  # hidden widths of that MLP
    # Feature -> number of embeddings m: its table has dim m·d and gives m vectors (Wukong's option).
    multi_embedding: dict[str, int] = {}
    # These features get small tables of dim small_dim; their concatenation is mapped by a linear
    # layer to ceil(k·small_dim/d) d-vectors (Wukong's option for low-cardinality features).
    small_dim_features: list[str] = []
    small_dim: int = Field(4, gt=0)
    # Storage precision of the tables (fbgemm's fused CPU and CUDA kernels read and update fp16 rows;
    # their optimizer state, e.g. row-wise Adagrad's accumulator, stays fp32). Pooled outputs are fp32.
    storage: Literal["fp32", "fp16"] = "fp32"
    # Feature -> m: quotient-remainder tables of ceil(N/m) and m rows for that feature (see above).
    qr_buckets: dict[str, int] = {}
    qr_op: Literal["mult", "add"] = "mult"
    # How each sequence feature's embedded positions become its one vector of X0.
    sequence: SequenceConfig = SequenceConfig()

    @field_validator("dim", "small_dim")
    @classmethod
    def _fbgemm_dim(cls, v: int) -> int:
        if v % _DIM_MULTIPLE:
            raise ValueError(f"embedding dims must be multiples of {_DIM_MULTIPLE} (fbgemm), got {v}")
        return v

    @field_validator("multi_embedding")
    @classmethod
    def _positive_multiplicity(cls, v: dict[str, int]) -> dict[str, int]:
        bad = {f: m for f, m in v.items() if m < 1}
        if bad:
            raise ValueError(f"multi_embedding counts must be >= 1, got {bad}")
        return v

    @field_validator("qr_buckets")
    @classmethod
    def _qr_buckets(cls, v: dict[str, int]) -> dict[str, int]:
        bad = {f: m for f, m in v.items() if m < 2}
        if bad:
            raise ValueError(f"qr_buckets must be >= 2 (the remainder table's rows), got {bad}")
        return v

    @field_validator("dense_hidden")
    @classmethod
    def _positive_widths(cls, v: list[int]) -> list[int]:
        if any(w < 1 for w in v):
            raise ValueError(f"dense_hidden widths must be >= 1, got {v}")
        return v

    @model_validator(mode="after")
    def _read_with(self) -> EmbeddingConfig:
        # Keys only another key puts to use: alone they were dropped without a word. (Compared with the
        # defaults: a run's config.yaml holds every key.)
        unused = {
            "small_dim": ("small_dim_features lists no feature", self.changed("small_dim")
                          and not self.small_dim_features),
            "qr_op": ("qr_buckets names no feature", self.changed("qr_op") and not self.qr_buckets),
            "dense_hidden": ("dense_embeddings=0 builds no dense MLP", bool(self.dense_hidden)
                             and self.dense_embeddings == 0),
        }  # fmt: skip
        for key, (why, bad) in unused.items():
            if bad:
                raise ValueError(f"{key} is set but {why}, so nothing reads it; drop it")
        return self


def _table_config(
    cls: type[_Table],
    f: SparseInput,
    dim: int,
    init: Callable[[Tensor], Any],
    data_type: DataType,
    **extra: Any,
) -> _Table:
    """The TorchRec config of feature ``f``'s table (named ``t_{feature}``)."""
    return cls(
        name=f"t_{f.name}", embedding_dim=dim, num_embeddings=f.num_embeddings, feature_names=[f.name],
        init_fn=init, data_type=data_type, **extra,
    )  # fmt: skip


_QUOTIENT, _REMAINDER = "#q", "#r"
_SHARED = "#seq"  # the sequence table shared by the sequences of a feature's vocabulary: t_<feature>#seq


def _qr_tables(f: SparseInput, m: int | None) -> list[SparseInput]:
    """A feature's tables: itself, or its quotient (ceil(N/m) rows) and remainder (m rows) tables."""
    if m is None:
        return [f]
    quotient = dataclasses.replace(f, name=f.name + _QUOTIENT, num_embeddings=-(-f.num_embeddings // m))
    return [quotient, dataclasses.replace(f, name=f.name + _REMAINDER, num_embeddings=m)]


def ids_as(kjt: KeyedJaggedTensor, dtype: torch.dtype) -> KeyedJaggedTensor:
    """``kjt`` with its ids (values) in ``dtype``; the same object when they already are."""
    if kjt.values().dtype == dtype:
        return kjt
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=kjt.values().to(dtype),
        lengths=kjt.lengths(),
        weights=kjt.weights_or_none(),
        stride=kjt.stride(),
    )


def check_feature_options(names: list[str], cfg: EmbeddingConfig) -> None:
    """The per-feature options name pooled (non-sequence) sparse features, each at most one kind of table.

    Raises ValueError naming the option (``multi_embedding``, ``small_dim_features``, ``qr_buckets``).
    """
    options = {
        "multi_embedding": set(cfg.multi_embedding),
        "small_dim_features": set(cfg.small_dim_features),
        "qr_buckets": set(cfg.qr_buckets),
    }
    for option, chosen in options.items():
        if unknown := sorted(chosen - set(names)):
            raise ValueError(f"{option} names unknown sparse features {unknown}; features: {names}")
    for a, b in (("multi_embedding", "small_dim_features"), ("qr_buckets", "multi_embedding"),
                 ("qr_buckets", "small_dim_features")):  # fmt: skip
        if both := sorted(options[a] & options[b]):
            raise ValueError(f"features {both} are in both {a} and {b}")


def check_table_names(sparse: Sequence[SparseInput], cfg: EmbeddingConfig) -> None:
    """No sparse feature is named as another feature's extra table: a QR feature's quotient and remainder
    (``<name>#q``, ``<name>#r``: keys and tables of their own), or the sequence table ``<name>#seq`` shared
    by the sequences of a pooled feature's vocabulary (beside a sequence's own table of that name).

    Raises ValueError naming both features (TorchRec said only 'Duplicate table name t_<name>#q').
    """
    names = {f.name for f in sparse}
    sequences = {f.name for f in sparse if f.max_len is not None}
    taken = {  # a name -> (its owner, what it names, the features it clashes with)
        f + suffix: (f, f"one of the QR tables model.embedding.qr_buckets gives {f!r}", names)
        for f in cfg.qr_buckets
        for suffix in (_QUOTIENT, _REMAINDER)
    }
    taken |= {
        f.vocabulary + _SHARED: (
            f.vocabulary,
            f"the table the sequences of {f.vocabulary!r} share",
            sequences,
        )
        for f in sparse
        if f.max_len is not None and f.vocabulary is not None and f.vocabulary not in sequences
    }
    for name, (owner, what, clashes) in taken.items():
        if name in clashes:
            raise ValueError(
                f"sparse features {owner!r} and {name!r} clash: {name!r} also names {what}; rename one of them"
            )


class EmbeddingLayer(nn.Module):
    """(dense (B, n_dense) float, sparse KJT) -> X0 (B, n, d) float32.

    Dense features of any float dtype are cast to the dense MLP's (float32); the KJT's ids and lengths
    may be int32 or int64 (the ids are cast to ``id_dtype``), and a bag may be empty (its vector is zero).

    Pooling: every table sum-pools, and "mean" features are divided by their bag size here
    (the number of ids, or the sum of the weights when the collection is weighted), because
    TorchRec's unsharded EBC cannot mean-pool with per-id weights. If any feature is weighted,
    the KJT must carry weights for all keys (1.0 for ids of unweighted features).
    """

    _qr_quotient: Tensor  # buffers: see __init__
    _qr_keep: Tensor

    def __init__(
        self, features: FeatureSet, cfg: EmbeddingConfig, device: torch.device | None = None
    ) -> None:
        super().__init__()
        names = [f.name for f in features.sparse if f.max_len is None]
        sequences = [f for f in features.sparse if f.max_len is not None]
        if not names:
            raise ValueError("the embedding layer needs at least one sparse feature that is not a sequence")
        check_feature_options(names, cfg)
        check_table_names(features.sparse, cfg)
        small_names = set(cfg.small_dim_features)
        num_dense_outputs = (
            cfg.dense_embeddings if cfg.dense_embeddings is not None else int(features.num_dense > 0)
        )
        if num_dense_outputs and not features.num_dense:
            raise ValueError(
                f"dense_embeddings={num_dense_outputs} but the feature set has no dense features"
            )
        if not num_dense_outputs and features.num_dense:  # they were read, preprocessed, and never used
            raise ValueError(
                f"dense_embeddings=0 but the feature set has {features.num_dense} dense feature"
                f"{'s' * (features.num_dense != 1)}, which no layer would read; drop the dense features from the data schema "
                "or give dense_embeddings 1 or more"
            )

        d = self.dim = cfg.dim
        # Full-dim tables first, then small ones, so the pooled KeyedTensor splits into two blocks.
        full = [f for f in features.sparse if f.name in names and f.name not in small_names]
        small = [f for f in features.sparse if f.name in small_names]
        counts = [cfg.multi_embedding.get(f.name, 1) for f in full]
        self._pooled_names = [f.name for f in full + small]  # the KJT keys the pooled tables read
        # A QR feature's two tables sit side by side: its quotient vector, then its remainder vector.
        self._qr = dict(cfg.qr_buckets)
        self._qr_op = cfg.qr_op
        full_tables = [t for f in full for t in _qr_tables(f, self._qr.get(f.name))]
        full_counts = [m for f, m in zip(full, counts, strict=True) for _ in range(1 + (f.name in self._qr))]
        self._tables = full_tables + small
        self._table_dims = [m * d for m in full_counts] + [cfg.small_dim] * len(small)
        self._full_width = sum(full_counts) * d
        # Positions of the quotient and remainder vectors among the full tables' vectors.
        starts = [0, *itertools.accumulate(full_counts)][:-1]
        # By the features qr_buckets names, not by a table name's suffix: a feature called 'x#q' or 'x#r' is
        # none of these (one called 'x#r' started its table near 1, a remainder's init, without qr_buckets).
        quotients = {f.name + _QUOTIENT for f in full if f.name in self._qr}
        remainders = {f.name + _REMAINDER for f in full if f.name in self._qr}
        quotient = [i for i, t in zip(starts, full_tables, strict=True) if t.name in quotients]
        self.register_buffer("_qr_quotient", torch.tensor(quotient, dtype=torch.long), persistent=False)
        self.register_buffer(
            "_qr_keep",
            torch.tensor([i for i in range(sum(full_counts)) if i - 1 not in quotient], dtype=torch.long),
            persistent=False,
        )
        self._weighted = any(f.weighted for f in features.sparse)
        # Ids travel (the sharded tables' all-to-all) and are read (fbgemm's lookups) as int32 whenever every
        # table fits: half the bytes of int64 ids.
        self.id_dtype = torch.int32 if max(f.num_embeddings for f in features.sparse) < 2**31 else torch.int64
        table = functools.partial(
            _table_config,
            init=functools.partial(torch.nn.init.normal_, mean=0.0, std=cfg.init_std),
            data_type=DataType.FP16 if cfg.storage == "fp16" else DataType.FP32,
        )
        remainder_init = functools.partial(torch.nn.init.normal_, mean=1.0, std=cfg.init_std)
        self.ebc = EmbeddingBagCollection(
            tables=[
                table(EmbeddingBagConfig, f, dim, pooling=PoolingType.SUM)
                if not (self._qr_op == "mult" and f.name in remainders)
                # A remainder table starts near 1, so a product starts as its quotient vector.
                else table(EmbeddingBagConfig, f, dim, pooling=PoolingType.SUM, init=remainder_init)
                for f, dim in zip(self._tables, self._table_dims, strict=True)
            ],
            is_weighted=self._weighted,
            device=device,
        )
        self.dense_mlp = (
            MLP(features.num_dense, cfg.dense_hidden, num_dense_outputs * d, device=device)
            if num_dense_outputs
            else None
        )
        num_small_outputs = math.ceil(len(small) * cfg.small_dim / d)
        self.small_mlp = (
            MLP(len(small) * cfg.small_dim, [], num_small_outputs * d, device=device) if small else None
        )
        self.num_dense_outputs = num_dense_outputs
        self.num_outputs = num_dense_outputs + sum(counts) + num_small_outputs + len(sequences)
        # Where each full-dim feature's vectors sit in X0 (for models that condition on a field).
        self.positions: dict[str, list[int]] = {}
        start = num_dense_outputs
        for f, m in zip(full, counts, strict=True):
            self.positions[f.name] = list(range(start, start + m))
            start += m
        self._sequences = [f.name for f in sequences]
        # The KJT keys the sequence tables read: the sequences, then the target when a table shares it.
        self._seq_keys = list(self._sequences)
        self.ec, self.encoders, self._target = None, None, None
        if sequences:
            target = cfg.sequence.target if cfg.sequence.encoder != "causal" else None
            if target is not None and target not in self.positions:
                raise ValueError(
                    f"sequence.target {target!r} must name a single-id feature with a full-dim table for "
                    f"the {cfg.sequence.encoder} encoder; features: {sorted(self.positions)}"
                )
            by_name = {f.name: f for f in features.sparse}
            groups: dict[str, list[SparseInput]] = {}  # table key -> its sequences
            for f in sequences:
                groups.setdefault(f.vocabulary or f.name, []).append(f)
            tables = []
            for key, members in groups.items():
                src, names = by_name[key], [f.name for f in members]
                if src.max_len is not None:  # a sequence's own table (t_<sequence>), maybe shared by others
                    tables.append(
                        dataclasses.replace(table(SequenceTableConfig, src, d), feature_names=names)
                    )
                    continue
                if key == target:
                    names.append(key)
                    self._seq_keys.append(key)
                base = dataclasses.replace(src, name=f"{key}{_SHARED}")
                tables.append(dataclasses.replace(table(SequenceTableConfig, base, d), feature_names=names))
            self.ec = EmbeddingCollection(tables=tables, device=device)
            self.encoders = nn.ModuleDict(
                {f.name: SequenceEncoder(cfg.sequence, d, int(f.max_len or 1), device) for f in sequences}
            )
            if target is not None and target not in self._seq_keys:
                self._target = self.positions[target][0]
            last = self.num_outputs - len(sequences)
            self.positions |= {f.name: [last + i] for i, f in enumerate(sequences)}

    def forward(self, dense: Tensor, sparse: KeyedJaggedTensor) -> Tensor:
        if self._weighted and sparse.weights_or_none() is None:
            raise ValueError("a sparse feature is weighted but the KeyedJaggedTensor has no weights")
        pooled_kjt, seq_kjt = self._split(ids_as(sparse, self.id_dtype))
        pooled_kjt = self._split_qr(pooled_kjt)
        pooled = self._mean_pool(self.ebc(pooled_kjt).values(), pooled_kjt)  # (B, Σ table dims)
        b = pooled.shape[0]
        parts = []
        if self.dense_mlp is not None:
            # Dense features in any float dtype (numpy's float64 included) compute in the MLP's own.
            dense = dense.to(next(self.dense_mlp.parameters()).dtype)
            parts.append(self.dense_mlp(dense).view(b, -1, self.dim))
        parts.append(self._combine_qr(pooled[:, : self._full_width].view(b, -1, self.dim)))
        if self.small_mlp is not None:
            parts.append(self.small_mlp(pooled[:, self._full_width :]).view(b, -1, self.dim))
        if seq_kjt is None:
            return torch.cat(parts, dim=1)
        assert self.ec is not None and self.encoders is not None  # built with the sequence features
        x0 = torch.cat(parts, dim=1)
        histories = self.ec(seq_kjt)
        target = None if self._target is None else x0[:, self._target]
        if len(self._seq_keys) > len(self._sequences):  # the target from the table it shares: (B, d)
            target = histories[self._seq_keys[-1]].values()
        pooled_histories = [
            self.encoders[name](histories[name].values(), histories[name].lengths(), target)
            for name in self._sequences
        ]
        return torch.cat([x0, torch.stack(pooled_histories, dim=1)], dim=1)

    def _split(self, sparse: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor | None]:
        """The pooled features' KJT (table order) and the sequence features' (None: there are none)."""
        if not self._sequences:
            return sparse, None
        keys = sparse.keys()
        # A shared target's ids go to both: permute repeats its key.
        order = [keys.index(n) for n in self._pooled_names] + [keys.index(n) for n in self._seq_keys]
        pooled, seqs = sparse.permute(order).split([len(self._pooled_names), len(self._seq_keys)])
        return pooled, seqs

    def _split_qr(self, sparse: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Each QR feature's ids -> two keys: ``<name>#q`` (id // m) and ``<name>#r`` (id % m)."""
        if not self._qr:
            return sparse
        jts: dict[str, JaggedTensor] = {}
        for key, jt in sparse.to_dict().items():
            m = self._qr.get(key)
            if m is None:
                jts[key] = jt
                continue
            ids, lengths, weights = jt.values(), jt.lengths(), jt.weights_or_none()
            jts[key + _QUOTIENT] = JaggedTensor(
                ids.div(m, rounding_mode="floor"), lengths=lengths, weights=weights
            )
            jts[key + _REMAINDER] = JaggedTensor(ids.remainder(m), lengths=lengths, weights=weights)
        return KeyedJaggedTensor.from_jt_dict(jts)

    def _combine_qr(self, vectors: Tensor) -> Tensor:
        """(B, full-table vectors incl. both QR halves, d) -> (B, one vector per QR feature, d)."""
        if not self._qr:
            return vectors
        q, r = vectors[:, self._qr_quotient], vectors[:, self._qr_quotient + 1]
        combined = q * r if self._qr_op == "mult" else q + r
        return vectors.index_copy(1, self._qr_quotient, combined)[:, self._qr_keep]

    def table_parameters(self) -> list[nn.Parameter]:
        """Every embedding table's weights (pooled and sequence): what the table optimizer trains."""
        return [*self.ebc.parameters(), *(self.ec.parameters() if self.ec is not None else [])]

    def _mean_pool(self, pooled: Tensor, sparse: KeyedJaggedTensor) -> Tensor:
        """Divide the sum-pooled columns of "mean" features by their bag sizes."""
        if all(f.pooling == "sum" for f in self._tables):
            return pooled
        keys, lengths = sparse.keys(), sparse.lengths()
        sizes = (
            torch.segment_reduce(sparse.weights(), "sum", lengths=lengths)
            if self._weighted
            else lengths.to(pooled.dtype)
        )
        sizes = sizes.view(len(keys), -1)[[keys.index(f.name) for f in self._tables]]  # (tables, B)
        is_mean = torch.tensor([f.pooling == "mean" for f in self._tables], device=pooled.device)
        scale = torch.where(is_mean[:, None] & (sizes > 0), 1 / sizes, 1.0)
        dims = torch.tensor(self._table_dims, device=pooled.device)
        return pooled * scale.T.repeat_interleave(dims, dim=1, output_size=pooled.shape[1])

    def flops_per_example(self) -> int:
        """The MLPs, and the sequence encoders at full histories (max_len ids)."""
        return sum(module_flops(child) for child in self.children())

    def sequence_flops(self) -> dict[str, tuple[int, int]]:
        """Each sequence feature's encoder FLOPs (per history position, per position²)."""
        if self.encoders is None:
            return {}
        return {n: e.length_flops() for n, e in self.encoders.items() if isinstance(e, SequenceEncoder)}
