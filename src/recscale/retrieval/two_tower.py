"""A two-tower retrieval model and its small trainer (in-batch sampled softmax).

A tower embeds each of its features (one ``EmbeddingBag`` per feature, mean over the ids of a row, id 0
is padding), concatenates them and maps them through the shared ``MLP`` to a unit vector of ``dim``.
The score of (user, item) is the inner product of the towers' outputs, so the item tower's outputs are
the rows of an item index (``recscale.retrieval.index``) and the user tower's the queries.

``fit`` trains on positive (user, item) pairs: in a batch of B pairs every other batch item is a
negative, loss = cross-entropy of (u @ i^T) / temperature - log_q (B, B) against the diagonal. It is a
self-contained loop (Adam, shuffled pairs), not recscale's CTR trainer, whose batches are labelled rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recscale.models.blocks.mlp import MLP


class Tower(nn.Module):
    """features: one (B, L_f) int64 id tensor per feature (0 = padding) -> (B, dim) unit vectors."""

    def __init__(self, vocab_sizes: Sequence[int], emb_dim: int, hidden: Sequence[int], dim: int) -> None:
        super().__init__()
        self.bags = nn.ModuleList(
            nn.EmbeddingBag(v, emb_dim, mode="mean", padding_idx=0) for v in vocab_sizes
        )
        self.mlp = MLP(len(vocab_sizes) * emb_dim, hidden, dim)

    def forward(self, features: Sequence[Tensor]) -> Tensor:
        x = torch.cat([bag(f) for bag, f in zip(self.bags, features, strict=True)], dim=1)
        return F.normalize(self.mlp(x), dim=1)


class TwoTower(nn.Module):
    """(user features, item features, log_q (B,)) of B positive pairs -> in-batch softmax loss (scalar).

    ``log_q``: the log of each batch item's chance of being in a batch (its share of the positives);
    subtracted from the logits (the sampled-softmax "logQ correction"), so popular items are not
    pushed down for being everyone's negative."""

    def __init__(self, user: Tower, item: Tower, temperature: float = 0.05) -> None:
        super().__init__()
        self.user, self.item, self.temperature = user, item, temperature

    def forward(
        self, user_features: Sequence[Tensor], item_features: Sequence[Tensor], log_q: Tensor
    ) -> Tensor:
        logits = self.user(user_features) @ self.item(item_features).T / self.temperature - log_q
        return F.cross_entropy(logits, torch.arange(logits.shape[0]))


def rows(table: Sequence[Tensor], index: Tensor) -> list[Tensor]:
    """Per-entity feature tables (N, L_f) -> the rows of ``index`` (B,) of each."""
    return [t[index] for t in table]


def train_epochs(
    model: nn.Module,
    n: int,
    loss_of: Callable[[Tensor], Tensor],
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    whole_batches: bool,
) -> list[float]:
    """Adam on ``loss_of(batch indices)`` over ``n`` shuffled examples; ``whole_batches`` drops a short
    last batch. Leaves ``model`` in eval mode; returns each epoch's mean loss."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen)
        last = n - batch_size + 1 if whole_batches else n
        total = []
        for start in range(0, last, batch_size):
            loss = loss_of(order[start : start + batch_size])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total.append(loss.item())
        losses.append(sum(total) / max(len(total), 1))
    model.eval()
    return losses


def fit(
    model: TwoTower,
    users: Sequence[Tensor],
    items: Sequence[Tensor],
    pairs: Tensor,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
) -> list[float]:
    """Train on ``pairs`` (P, 2) = (user row, item row) of the tables ``users`` and ``items`` (one
    (N, L_f) id tensor per feature), whole batches only (the in-batch softmax wants B negatives),
    with the logQ correction of each item's share of ``pairs``.
    Returns each epoch's mean loss."""
    log_q = torch.bincount(pairs[:, 1]).float().div(pairs.shape[0]).log()
    loss_of = lambda b: model(rows(users, pairs[b, 0]), rows(items, pairs[b, 1]), log_q[pairs[b, 1]])
    return train_epochs(model, pairs.shape[0], loss_of, epochs, batch_size, lr, seed, whole_batches=True)


@torch.no_grad()
def embed(tower: Tower, table: Sequence[Tensor], batch_size: int = 8192) -> Tensor:
    """Every row of a feature table through ``tower`` in eval mode -> (N, dim)."""
    tower.eval()
    n = table[0].shape[0]
    return torch.cat(
        [tower(rows(table, torch.arange(i, min(i + batch_size, n)))) for i in range(0, n, batch_size)]
    )
