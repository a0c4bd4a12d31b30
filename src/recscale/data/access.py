"""How often a sample accesses each id of a table: the 17-bin access histogram of NeuroShard and
AutoShard (the share of the distinct ids accessed (0,1], (1,2], (2,4], ..., (2^15, inf) times)."""

from __future__ import annotations

import numpy as np

HIST_BINS = 17


def histogram_of_counts(counts: np.ndarray) -> tuple[float, ...]:
    """The access histogram from each distinct id's access count (all zeros if no id was accessed)."""
    if len(counts) == 0:
        return (0.0,) * HIST_BINS
    bins = np.clip(np.ceil(np.log2(counts)).astype(np.int64), 0, HIST_BINS - 1)
    return tuple(float(x) for x in np.bincount(bins, minlength=HIST_BINS) / len(counts))


def access_histogram(ids: np.ndarray) -> tuple[float, ...]:
    """The access histogram of a sample of ids, for the planner's cost models: their features are
    shares summing to 1, so an empty sample counts as all in the first bin (ids accessed once)."""
    if len(ids) == 0:
        return (1.0,) + (0.0,) * (HIST_BINS - 1)
    return histogram_of_counts(np.unique(ids, return_counts=True)[1])
