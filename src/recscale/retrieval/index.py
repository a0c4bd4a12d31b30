"""Item indexes as modules: (queries (Q, d), k) -> (scores (Q, k), ids (Q, k)), by inner product.

- ``ExactIndex``: fp32 rows, one matmul and a top-k over every item.
- ``Int8Index``: each row stored as int8 codes with one fp32 scale (per-row symmetric quantization,
  ``scale = max|row| / 127``); scores are ``(q @ codes^T) * scale``, dequantized chunk by chunk.
- ``IVFIndex``: a coarse quantizer of ``nlist`` k-means centroids (Lloyd iterations in torch); items are
  stored grouped by their nearest centroid; a query scores the centroids, visits the ``nprobe`` best
  lists and ranks their items exactly (fp32 or int8 rows). A batch scores the union of its queries'
  lists with one matmul and masks each query's unprobed lists. ``nprobe = nlist`` visits every item.

Every index takes an optional ``BloomFilter`` and the queries' user ids: items the filter may have seen
for that user are scored -inf before the top-k (an id of -1 with score -inf fills a row that has fewer
than k candidates left). ``index_bytes()`` is the memory of the index's buffers.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from recscale.models.quant import quantize_rows
from recscale.retrieval.bloom import BloomFilter

_CHUNK_ROWS = 1 << 15  # item rows dequantized at a time by Int8Index


# Seen-item filtering tests a window of each row's best items, ``k + max(k, _SEEN_EXTRA)`` wide at first,
# then 8x wider for the rows it left short, and hashes a whole row only past that (see ``_top_k``).
_SEEN_EXTRA = 64
_SEEN_WIDEN = 8
_MASK_PAIRS = 1 << 20  # (user, item) pairs hashed at a time by the whole-row fallback (~120 bytes a pair)


def _top_k(
    scores: Tensor, ids: Tensor, k: int, users: Tensor | None, seen: BloomFilter | None
) -> tuple[Tensor, Tensor]:
    """scores (Q, C), ids (Q, C) or (C,), users (Q,) -> the k best (scores, ids) (Q, min(k, C)) per row,
    the items ``seen`` may hold for the row's user scored -inf; a slot scored -inf has id -1.

    Hashing every pair cost 50-90x the search itself at 10^6 items, so the filter tests the best ``width``
    items of each row only: when ``k`` of them are unseen, or the window reaches the row's -inf scores
    (all it holds), nothing outside it could enter the top k. Other rows retry a wider window, and past
    that the whole row is masked, as before. Ties: the window's unseen items keep topk's order (a stable
    sort puts the seen ones last), so where a row's scores are distinct the result equals masking every
    pair; among exactly equal scores the order, and which of them takes the last place, is topk's, which
    the whole-row mask did not fix either.
    """
    if seen is not None and users is None:
        raise ValueError("a seen-item filter needs the queries' user ids")
    k = min(k, scores.shape[1])
    if seen is None or users is None or k == 0:
        top, pos = scores.topk(k, dim=1)
        return top, torch.where(top.isneginf(), -1, ids.expand_as(scores).gather(1, pos))
    n, c = scores.shape
    top = scores.new_full((n, k), float("-inf"))
    out = torch.full((n, k), -1, dtype=torch.long)
    rows = torch.arange(n)
    width = k + max(k, _SEEN_EXTRA)
    while len(rows) and width < c:
        # All rows the first time: no copy of the whole matrix.
        sub = scores if len(rows) == n else scores[rows]
        cand, pos = sub.topk(width, dim=1)  # (R, width), best first
        cand_ids = (ids if ids.dim() == 1 else ids[rows]).expand(len(rows), c).gather(1, pos)
        hit = seen.might_contain(users[rows, None].expand_as(cand_ids), cand_ids)
        order = hit.to(torch.uint8).argsort(dim=1, stable=True)[:, :k]  # the unseen first, in score order
        kept, kept_hit = cand.gather(1, order), hit.gather(1, order)
        done = ~kept_hit[:, -1] | cand[:, -1].isneginf()
        kept = kept.masked_fill(kept_hit, float("-inf"))
        top[rows[done]] = kept[done]
        out[rows[done]] = torch.where(kept[done].isneginf(), -1, cand_ids.gather(1, order)[done])
        rows, width = rows[~done], width * _SEEN_WIDEN
    if len(rows):
        sub = scores[rows]  # (R, C), a copy: masked in place a block of columns at a time
        full_ids = (ids if ids.dim() == 1 else ids[rows]).expand(len(rows), c)
        step = max(1, _MASK_PAIRS // len(rows))
        for j in range(0, c, step):
            block = full_ids[:, j : j + step]
            sub[:, j : j + step].masked_fill_(
                seen.might_contain(users[rows, None].expand_as(block), block), float("-inf")
            )
        best, pos = sub.topk(k, dim=1)
        top[rows] = best
        out[rows] = torch.where(best.isneginf(), -1, full_ids.gather(1, pos))
    return top, out


def recall(approx: Tensor, exact: Tensor) -> float:
    """Ids (Q, K) of an approximate search and of the exact one -> the share of the exact ids found."""
    found = sum(len(set(a.tolist()) & set(e.tolist())) for a, e in zip(approx, exact, strict=True))
    return found / exact.numel()


class ItemIndex(nn.Module):
    """Base: subclasses store the item rows as buffers and implement ``forward``."""

    def index_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


class ExactIndex(ItemIndex):
    """Brute force over fp32 rows (N, d)."""

    items: Tensor

    def __init__(self, items: Tensor) -> None:
        super().__init__()
        self.register_buffer("items", items.detach().float().contiguous())

    def forward(
        self, queries: Tensor, k: int, users: Tensor | None = None, seen: BloomFilter | None = None
    ) -> tuple[Tensor, Tensor]:
        scores = queries @ self.items.T
        return _top_k(scores, torch.arange(scores.shape[1]), k, users, seen)


class Int8Index(ItemIndex):
    """Brute force over int8 rows: codes (N, d) int8 and scales (N,) fp32, 4d / (d + 4) x smaller."""

    codes: Tensor
    scales: Tensor

    def __init__(self, items: Tensor) -> None:
        super().__init__()
        codes, scales = quantize_rows(items.detach().float())
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    def forward(
        self, queries: Tensor, k: int, users: Tensor | None = None, seen: BloomFilter | None = None
    ) -> tuple[Tensor, Tensor]:
        scores = torch.cat(
            [
                (queries @ self.codes[i : i + _CHUNK_ROWS].T.float()) * self.scales[i : i + _CHUNK_ROWS]
                for i in range(0, self.codes.shape[0], _CHUNK_ROWS)
            ],
            dim=1,
        )
        return _top_k(scores, torch.arange(scores.shape[1]), k, users, seen)


_ASSIGN_ROWS = 1 << 14  # points assigned at a time: a (rows, n_clusters) fp32 distance block


def nearest(points: Tensor, centroids: Tensor, chunk: int | None = None) -> Tensor:
    """points (N, d), centroids (K, d) -> (N,) int64, each point's nearest centroid (Euclidean).

    ``chunk`` (default ``_ASSIGN_ROWS``) rows at a time: the whole (N, K) distance matrix was 4 GB at 10^6 items and 1,024 lists. A
    row's argmin does not depend on the others; cdist's method (matmul or direct, chosen by its sizes)
    is fixed from the whole input's sizes, so every chunk computes its distances as one call did."""
    chunk = chunk or _ASSIGN_ROWS
    mode = (
        "use_mm_for_euclid_dist" if max(len(points), len(centroids)) > 25 else "donot_use_mm_for_euclid_dist"
    )
    return torch.cat(
        [
            torch.cdist(points[i : i + chunk], centroids, compute_mode=mode).argmin(dim=1)
            for i in range(0, len(points), chunk)
        ]
        or [torch.zeros(0, dtype=torch.long)]
    )


def kmeans(
    points: Tensor, n_clusters: int, iters: int, generator: torch.Generator, chunk: int | None = None
) -> Tensor:
    """Lloyd's k-means (Euclidean): points (N, d) -> centroids (n_clusters, d). Starts from distinct
    random points; a centroid that loses all its points keeps its place. Points are assigned ``chunk``
    rows at a time (``nearest``)."""
    centroids = points[torch.randperm(points.shape[0], generator=generator)[:n_clusters]].clone()
    for _ in range(iters):
        assign = nearest(points, centroids, chunk)
        sums = torch.zeros_like(centroids).index_add_(0, assign, points)
        counts = torch.bincount(assign, minlength=n_clusters).float()
        centroids = torch.where(counts[:, None] > 0, sums / counts.clamp_min(1)[:, None], centroids)
    return centroids


class IVFIndex(ItemIndex):
    """Inverted lists: centroids (nlist, d); the items sorted by list, ``offsets`` (nlist + 1,) their
    boundaries, ``ids`` (N,) int32 their item ids; rows fp32 (N, d) or, with ``int8``, codes + scales."""

    centroids: Tensor
    offsets: Tensor
    ids: Tensor
    rows: Tensor | None
    codes: Tensor | None
    scales: Tensor | None

    def __init__(
        self, items: Tensor, nlist: int, nprobe: int, int8: bool = False, iters: int = 10, seed: int = 0
    ) -> None:
        super().__init__()
        if not 1 <= nprobe <= nlist <= items.shape[0]:
            raise ValueError(
                f"IVF needs 1 <= nprobe <= nlist <= items, got {nprobe}, {nlist}, {items.shape[0]}"
            )
        items = items.detach().float()
        centroids = kmeans(items, nlist, iters, torch.Generator().manual_seed(seed))
        assign = nearest(items, centroids)
        order = assign.argsort(stable=True)
        self.nprobe = nprobe
        self.register_buffer("centroids", centroids)
        self.register_buffer(
            "offsets", torch.cat([torch.zeros(1), torch.bincount(assign, minlength=nlist).cumsum(0)]).long()
        )
        self.register_buffer("ids", order.int())
        codes, scales = quantize_rows(items[order]) if int8 else (None, None)
        self.register_buffer("rows", None if int8 else items[order].contiguous())
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    def _rows(self, pos: Tensor) -> Tensor:
        """Stored positions (...,) -> fp32 rows (..., d)."""
        if self.rows is not None:
            return self.rows[pos]
        assert self.codes is not None and self.scales is not None
        return self.codes[pos].float() * self.scales[pos, None]

    def forward(
        self, queries: Tensor, k: int, users: Tensor | None = None, seen: BloomFilter | None = None
    ) -> tuple[Tensor, Tensor]:
        lists = (queries @ self.centroids.T).topk(self.nprobe, dim=1).indices  # (Q, nprobe)
        probed = torch.zeros(queries.shape[0], self.centroids.shape[0], dtype=torch.bool)
        probed[torch.arange(queries.shape[0])[:, None], lists] = True
        # The rows of every list some query of the batch probes (U of them), scored by one matmul; a
        # (query, row) pair whose list that query did not probe is masked.
        union = probed.any(dim=0).nonzero()[:, 0]
        lengths = self.offsets[union + 1] - self.offsets[union]
        pos = torch.repeat_interleave(self.offsets[union] - (lengths.cumsum(0) - lengths), lengths)
        pos += torch.arange(pos.shape[0])
        # A chunk of rows gathered (int8: dequantized) at a time, as Int8Index scores: the union's rows whole
        # were a (U, d) fp32 copy, more than the (Q, U) scores themselves for a few queries.
        scores = torch.cat(
            [queries @ self._rows(pos[i : i + _CHUNK_ROWS]).T for i in range(0, pos.shape[0], _CHUNK_ROWS)]
            or [queries.new_zeros(queries.shape[0], 0)],
            dim=1,
        ).masked_fill(~probed[:, torch.repeat_interleave(union, lengths)], float("-inf"))
        ids = self.ids[pos].long()
        return _top_k(scores, ids, k, users, seen)
