"""Synthetic retrieval data from random latent factors, where the true relevant items are known.

Items are clustered (``n_clusters`` Gaussian centres, each item a centre plus noise), as learned item
embeddings are; users are Gaussian. A user's positives are drawn from softmax(user @ item^T / tau), so
the exact top items of the true factors are the ones a perfect model would retrieve.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class LatentData:
    users: Tensor  # (n_users, dim) fp32
    items: Tensor  # (n_items, dim) fp32
    pairs: Tensor  # (n_users * per_user, 2) int64: (user, item) positives


def latent_data(
    n_users: int,
    n_items: int,
    dim: int,
    per_user: int,
    n_clusters: int = 256,
    tau: float = 0.1,
    seed: int = 0,
) -> LatentData:
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(n_clusters, dim, generator=gen)
    assign = torch.randint(0, n_clusters, (n_items,), generator=gen)
    items = centres[assign] + 0.5 * torch.randn(n_items, dim, generator=gen)
    items = items / items.norm(dim=1, keepdim=True)
    users = torch.randn(n_users, dim, generator=gen)
    users = users / users.norm(dim=1, keepdim=True)
    picked = torch.multinomial(torch.softmax(users @ items.T / tau, dim=1), per_user, generator=gen)
    pairs = torch.stack([torch.arange(n_users).repeat_interleave(per_user), picked.flatten()], dim=1)
    return LatentData(users, items, pairs)
