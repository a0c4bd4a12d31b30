"""``retrieve -> rank`` as one module: user features -> the top-k items ranked by a ranking model.

``RetrieveRank``: the user tower embeds the users, the item index returns ``candidates`` items per user
(the seen-item Bloom filter, when present, masks the user's seen items before that top-k), the
``Ranker`` scores each (user, candidate) pair and the ``k`` best by ranker score are returned. The whole
pipeline is described by a ``RetrievalSpec`` (sizes, index kind), so a saved state dict and the spec
rebuild it (``build``) with no pickled code.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, PositiveInt
from torch import Tensor, nn

from recscale.models.blocks.mlp import MLP
from recscale.retrieval.bloom import BloomFilter
from recscale.retrieval.index import ExactIndex, Int8Index, ItemIndex, IVFIndex
from recscale.retrieval.two_tower import Tower, train_epochs

IndexKind = Literal["exact", "int8", "ivf", "ivf-int8"]
# (user, item) pairs ``RetrieveRank`` hands its index at a time: the users of a call are split to stay within it.
PAIRS_PER_CALL = 1 << 22


class Ranker(nn.Module):
    """(user vectors (B, d), candidate item ids (B, C)) -> logits (B, C): its own item embedding
    (n_items, item_dim) and an MLP over [user vector, item embedding]."""

    def __init__(self, n_items: int, user_dim: int, item_dim: int, hidden: Sequence[int]) -> None:
        super().__init__()
        self.items = nn.Embedding(n_items, item_dim)
        self.mlp = MLP(user_dim + item_dim, hidden, 1)

    def forward(self, users: Tensor, items: Tensor) -> Tensor:
        x = torch.cat([users[:, None, :].expand(-1, items.shape[1], -1), self.items(items)], dim=2)
        return self.mlp(x.flatten(0, 1)).view(items.shape)


def fit_ranker(
    ranker: Ranker,
    users: Tensor,
    items: Tensor,
    labels: Tensor,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
) -> list[float]:
    """BCE on labelled pairs: user vectors (P, d), item ids (P,), labels (P,) in {0, 1}. Returns each
    epoch's mean loss."""
    loss_of = lambda b: F.binary_cross_entropy_with_logits(ranker(users[b], items[b, None])[:, 0], labels[b])
    return train_epochs(ranker, labels.shape[0], loss_of, epochs, batch_size, lr, seed, whole_batches=False)


class RetrievalSpec(BaseModel):
    """Everything but the tensors: the towers', index's, filter's and ranker's sizes."""

    model_config = ConfigDict(extra="forbid")

    # One vocabulary size per user feature (id 0 = padding, so at least 1).
    user_vocab: list[PositiveInt] = Field(min_length=1)
    emb_dim: int = Field(ge=1)
    hidden: list[int]
    dim: int = Field(ge=1)
    n_items: int = Field(ge=1)
    index: IndexKind
    nlist: int = Field(1, ge=1)
    nprobe: int = Field(1, ge=1)
    bloom_bits: int | None = None  # no seen-item filter when None
    bloom_hashes: int = Field(1, ge=1)
    ranker_dim: int = Field(ge=1)
    ranker_hidden: list[int]
    candidates: int = Field(ge=1)
    k: int = Field(ge=1)

    def elements(self) -> int:
        """Elements of the tensors ``build`` makes (a saved model stores each in at least a byte; the
        Bloom filter's bits packed 8 to one): what its weights file must back before they are allocated."""

        def mlp(widths: Sequence[int]) -> int:
            return sum((a + 1) * b for a, b in itertools.pairwise(widths))

        user_mlp = mlp([len(self.user_vocab) * self.emb_dim, *self.hidden, self.dim])
        ranker_mlp = mlp([self.dim + self.ranker_dim, *self.ranker_hidden, 1])
        return (
            self.emb_dim * sum(self.user_vocab) + user_mlp + self.n_items * (self.dim + self.ranker_dim)
            + ranker_mlp + (self.nlist * self.dim if self.index.startswith("ivf") else 0) + (self.bloom_bits or 0) // 8
        )  # fmt: skip


def make_index(kind: IndexKind, items: Tensor, nlist: int, nprobe: int, iters: int = 10) -> ItemIndex:
    """An index of ``kind`` over item vectors (N, d)."""
    if kind == "exact":
        return ExactIndex(items)
    if kind == "int8":
        return Int8Index(items)
    return IVFIndex(items, nlist, nprobe, int8=kind == "ivf-int8", iters=iters)


class RetrieveRank(nn.Module):
    """(user features: one (B, L_f) id tensor per feature, user ids (B,)) -> (ranker logits (B, k),
    item ids (B, k)); an id of -1 (logit -inf) pads a row with fewer than k unseen candidates."""

    def __init__(
        self, user: Tower, index: ItemIndex, ranker: Ranker, candidates: int, k: int, seen: BloomFilter | None
    ) -> None:
        super().__init__()
        self.user, self.index, self.ranker, self.seen = user, index, ranker, seen
        self.candidates, self.k = candidates, k

    @torch.no_grad()
    def forward(self, user_features: Sequence[Tensor], users: Tensor) -> tuple[Tensor, Tensor]:
        q = self.user(user_features)
        # The index scores every (user, item) pair at once, and the seen filter hashed each pair ~7 times
        # (~120 bytes a pair; it now tests each row's best items, and a whole row only where seen items
        # crowd them): the users go through it a slice at a time, as each user's items are ranked alone.
        # At once, 256 users of a 100,000-item catalogue took 3.2 GB; a 4,096-user request ~50 GB.
        step = max(1, PAIRS_PER_CALL // self.ranker.items.num_embeddings)
        if len(users) <= step:
            return self._retrieve_rank(q, users)
        parts = [
            self._retrieve_rank(q[i : i + step], users[i : i + step]) for i in range(0, len(users), step)
        ]
        return torch.cat([top for top, _ in parts]), torch.cat([ids for _, ids in parts])

    def _retrieve_rank(self, q: Tensor, users: Tensor) -> tuple[Tensor, Tensor]:
        _, cand = self.index(q, self.candidates, users=users, seen=self.seen)
        logits = self.ranker(q, cand.clamp_min(0)).masked_fill(cand < 0, float("-inf"))
        top, pos = logits.topk(min(self.k, cand.shape[1]), dim=1)
        return top, cand.gather(1, pos)


def build(spec: RetrievalSpec) -> RetrieveRank:
    """The pipeline of ``spec`` with placeholder tensors of the right shapes: load a state dict into it."""
    index = make_index(spec.index, torch.zeros(spec.n_items, spec.dim), spec.nlist, spec.nprobe, iters=0)
    seen = None if spec.bloom_bits is None else BloomFilter(spec.bloom_bits, spec.bloom_hashes)
    return RetrieveRank(
        Tower(spec.user_vocab, spec.emb_dim, spec.hidden, spec.dim),
        index,
        Ranker(spec.n_items, spec.dim, spec.ranker_dim, spec.ranker_hidden),
        spec.candidates,
        spec.k,
        seen,
    )
