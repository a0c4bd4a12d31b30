"""MovieLens-100k as retrieval data: per-user and per-item feature tables and the rated pairs of each split.

Read through recscale's MovieLens reader (its time split; a rating >= 4 is a positive). Each side is a
list of (rows, L_f) id tensors, one per feature, 1-based with 0 as padding (a multi-id feature such as
the genres pads to its longest row): the input of a ``two_tower.Tower``. ``user_keys[r]`` and
``item_keys[r]`` are the raw ids (text) of table row r.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from recscale.data.readers import read_batches
from recscale.data.schema import Schema, SparseFeature

USER = ["user_id", "age", "gender", "occupation"]
ITEM = ["item_id", "release_year", "class"]


@dataclass
class Interactions:
    users: list[Tensor]  # one (n_users, L_f) id tensor per USER feature
    items: list[Tensor]  # one (n_items, L_f) id tensor per ITEM feature
    rated: dict[str, Tensor]  # split -> (N, 3): user row, item row, label (1: rating >= 4)
    user_keys: list[str]
    item_keys: list[str]

    def positives(self, split: str) -> Tensor:
        """(P, 2) user row, item row of the split's positive ratings."""
        r = self.rated[split]
        return r[r[:, 2] == 1, :2]


def _table(every: pa.Table, cols: list[str]) -> tuple[list[Tensor], list[str]]:
    """The feature table of one side (rows: the distinct values of ``cols[0]``, sorted as text)."""
    keys, first = np.unique(
        every.column(cols[0]).to_numpy(zero_copy_only=False).astype(str), return_index=True
    )
    out = []
    for c in cols:
        values = every.column(c).to_pylist()
        lists = [v if isinstance(v, list) else [v] for v in (values[i] for i in first)]
        vocab = {
            x: j + 1 for j, x in enumerate(sorted({str(x) for lst in lists for x in lst if x is not None}))
        }
        ids = torch.zeros(len(keys), max(len(lst) for lst in lists), dtype=torch.long)
        for r, lst in enumerate(lists):
            row = [vocab[str(x)] for x in lst if x is not None]
            ids[r, : len(row)] = torch.tensor(row, dtype=torch.long)
        out.append(ids)
    return out, [str(k) for k in keys]


def read_movielens(path: Path) -> Interactions:
    """MovieLens-100k RecBole atomic files at ``path`` -> its retrieval tables and the train/valid pairs."""
    schema = Schema(label="rating", sparse=[SparseFeature(name=n, multi=n == "class") for n in USER + ITEM])
    splits = {
        s: pa.Table.from_batches(list(read_batches(path, "movielens", schema, {"split": s})))
        for s in ("all", "train", "valid")
    }
    users, user_keys = _table(splits["all"], USER)
    items, item_keys = _table(splits["all"], ITEM)
    user_row = {k: r for r, k in enumerate(user_keys)}
    item_row = {k: r for r, k in enumerate(item_keys)}
    rated = {}
    for s in ("train", "valid"):
        t = splits[s]
        u = [user_row[str(x)] for x in t.column("user_id").to_pylist()]
        i = [item_row[str(x)] for x in t.column("item_id").to_pylist()]
        rated[s] = torch.tensor([u, i, [int(x) for x in t.column("label").to_pylist()]]).T
    return Interactions(users, items, rated, user_keys, item_keys)
