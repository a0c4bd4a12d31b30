"""The retrieve -> rank pipeline trained end to end on ``Interactions`` (``recscale retrieval build``).

1. A two-tower model on the train split's positives (in-batch softmax with the logQ correction).
2. The item tower's outputs for every item become the index (``exact`` | ``int8`` | ``ivf`` | ``ivf-int8``).
3. A Bloom filter of the train positives drops the items a user has already rated well.
4. A ranker learns every train rating's label from the user vector and the item.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recscale.errors import DataError
from recscale.retrieval.bloom import BloomFilter
from recscale.retrieval.movielens import Interactions
from recscale.retrieval.pipeline import IndexKind, Ranker, RetrievalSpec, RetrieveRank, fit_ranker, make_index
from recscale.retrieval.two_tower import Tower, TwoTower, embed, fit

EMB_DIM, HIDDEN, DIM = 16, [64], 32  # the towers: feature embedding dim, MLP widths, output dim
RANKER_DIM, RANKER_HIDDEN = 16, [64]
TOWER_BATCH = 256


@dataclass
class Towers:
    user: Tower
    item: Tower
    losses: list[float]  # each epoch's mean loss


def fit_towers(data: Interactions, epochs: int, seed: int = 0) -> Towers:
    """Both towers, trained on the train positives (batch TOWER_BATCH, Adam 3e-3, temperature 0.05)."""
    pairs = data.positives("train")
    # fit takes whole batches only: with fewer the towers stayed untrained (with none, a crash later).
    if len(pairs) < TOWER_BATCH:
        raise DataError(
            f"retrieval build: the train split has {len(pairs)} positive ratings (rating >= 4), fewer than "
            f"one batch of the two towers' training ({TOWER_BATCH}); give data with more positive ratings"
        )
    torch.manual_seed(seed)
    user = Tower([int(t.max()) + 1 for t in data.users], EMB_DIM, HIDDEN, DIM)
    item = Tower([int(t.max()) + 1 for t in data.items], EMB_DIM, HIDDEN, DIM)
    losses = fit(TwoTower(user, item, 0.05), data.users, data.items, pairs, epochs, TOWER_BATCH, 0.003, seed)
    return Towers(user, item, losses)


def seen_filter(data: Interactions) -> BloomFilter:
    """The train positives as (user row, item row) pairs, at a 1% false-positive rate."""
    pairs = data.positives("train")
    seen = BloomFilter.sized(capacity=len(pairs), fp_rate=0.01)
    seen.add(pairs[:, 0], pairs[:, 1])
    return seen


def fit_ranker_on(
    data: Interactions, user: Tower, epochs: int = 5, seed: int = 0
) -> tuple[Ranker, list[float]]:
    """The ranker on every train rating (batch 1024, Adam 3e-3), from the user tower's vectors."""
    torch.manual_seed(seed + 1)
    train = data.rated["train"]
    ranker = Ranker(data.items[0].shape[0], DIM, RANKER_DIM, RANKER_HIDDEN)
    user_vecs = embed(user, data.users)
    losses = fit_ranker(
        ranker, user_vecs[train[:, 0]], train[:, 1], train[:, 2].float(), epochs, 1024, 0.003, seed
    )
    return ranker, losses


def build_pipeline(
    data: Interactions,
    index: IndexKind = "int8",
    epochs: int = 5,
    seed: int = 0,
    candidates: int = 100,
    k: int = 10,
    nlist: int = 32,
    nprobe: int = 4,
) -> tuple[RetrieveRank, RetrievalSpec]:
    """Train and assemble the pipeline; ``spec`` rebuilds it (``serve.retrieval_artifact``)."""
    towers = fit_towers(data, epochs, seed)
    items = embed(towers.item, data.items)
    seen = seen_filter(data)
    ranker, _ = fit_ranker_on(data, towers.user, epochs, seed)
    nlist = min(nlist, items.shape[0])
    nprobe = min(nprobe, nlist)  # a catalog of fewer items than nprobe has fewer lists to probe
    pipe = RetrieveRank(
        towers.user, make_index(index, items, nlist, nprobe), ranker, candidates, k, seen
    ).eval()
    spec = RetrievalSpec(
        user_vocab=[int(t.max()) + 1 for t in data.users], emb_dim=EMB_DIM, hidden=HIDDEN, dim=DIM,
        n_items=items.shape[0], index=index, nlist=nlist, nprobe=nprobe, bloom_bits=seen.n_bits,
        bloom_hashes=seen.n_hashes, ranker_dim=RANKER_DIM, ranker_hidden=RANKER_HIDDEN, candidates=candidates, k=k,
    )  # fmt: skip
    return pipe, spec
