"""Per-table features the learned cost model reads (NeuroShard / AutoShard): rows, dim, pooling factor
and the 17-bin access histogram.

The histogram (``data.access``) tells the cost model how cache-friendly the lookups are. It depends
on the sample's size: the cost models are trained on histograms of one batch of ``BATCH`` rows, so
planners compute it over a batch of that many rows too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recscale.data.access import access_histogram

# Rows per batch of the measured cost data (bench/sharding_costs.py) and of the planner's histograms.
BATCH = 4096
# Bytes per table row and column (fp32 weights) and per row (row-wise Adagrad's state), for memory caps.
WEIGHT_BYTES, STATE_BYTES = 4, 4


@dataclass(frozen=True)
class TableFeatures:
    """One table (or column shard of one) as the cost model sees it."""

    name: str
    rows: int
    dim: int
    pooling: float  # mean ids per example
    hist: tuple[float, ...]  # HIST_BINS shares summing to 1

    def vector(self) -> np.ndarray:
        """(4 + HIST_BINS,) float32: the scaled inputs of the per-table MLP."""
        head = [
            np.log2(self.rows) / 20,
            self.dim / 128,
            np.log2(self.pooling) / 5,
            self.dim * self.pooling / 1024,
        ]
        return np.asarray([*head, *self.hist], dtype=np.float32)

    def memory(self) -> int:
        """Bytes of this table's weights and optimizer state."""
        return self.rows * (self.dim * WEIGHT_BYTES + STATE_BYTES)

    def columns(self, width: int) -> TableFeatures:
        """A column shard of ``width`` columns: the same rows and lookups, fewer columns."""
        return replace(self, dim=width)

    def row_block(self, parts: int) -> TableFeatures:
        """One of ``parts`` row shards (TorchRec's row-wise blocks of ceil(rows / parts) rows), taking
        its share of the lookups; the access histogram is the table's (each block draws from it alike)."""
        return replace(self, rows=-(-self.rows // parts), pooling=self.pooling / parts)


def zipf_ids(rng: np.random.Generator, rows: int, n: int, alpha: float) -> np.ndarray:
    """``n`` ids of a table of ``rows`` rows, rank r drawn with probability ∝ r^-alpha, ranks scattered
    over the rows by a random permutation (hot rows are not adjacent)."""
    cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -alpha)
    ranks = np.minimum(np.searchsorted(cdf, rng.random(n) * cdf[-1]), rows - 1)
    return rng.permutation(rows)[ranks]


def pooled_lengths(rng: np.random.Generator, batch: int, pooling: float) -> np.ndarray:
    """Ids per example: 1 + Poisson(pooling - 1), the synthetic data's multi-id lengths."""
    return 1 + rng.poisson(pooling - 1, batch) if pooling > 1 else np.ones(batch, dtype=np.int64)


def synthetic_table(
    name: str, rows: int, dim: int, pooling: float, alpha: float, rng: np.random.Generator
) -> tuple[TableFeatures, np.ndarray, np.ndarray]:
    """A table of the synthetic spec, with one batch of ``BATCH`` examples drawn from it:
    (features, lengths (BATCH,), ids (lengths.sum(),))."""
    lengths = pooled_lengths(rng, BATCH, pooling)
    ids = zipf_ids(rng, rows, int(lengths.sum()), alpha)
    return TableFeatures(name, rows, dim, float(lengths.mean()), access_histogram(ids)), lengths, ids


def from_batch(
    kjt: KeyedJaggedTensor, rows: dict[str, int], dims: dict[str, int]
) -> dict[str, TableFeatures]:
    """Features of each key of ``kjt`` (one batch of the data) that names a table in ``rows``."""
    out = {}
    for key, jt in kjt.to_dict().items():
        if key in rows:
            lengths = jt.lengths()
            pooling = max(1.0, float(lengths.float().mean())) if len(lengths) else 1.0
            out[key] = TableFeatures(
                key, rows[key], dims[key], pooling, access_histogram(jt.values().numpy())
            )
    return out
