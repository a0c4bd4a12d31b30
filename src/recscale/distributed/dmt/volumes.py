"""Closed-form inter-host bytes per training step, summed over ranks: flat sharding against DMT.

Checked against ``comms.CommMeter``'s measured bytes (tests/test_dmt.py, bench/dmt.py). Ids are
int32 (the embedding layer narrows them whenever every table has under 2^31 rows), lengths int32,
embeddings float32; ``ids`` is the mean ids per sample of each feature.
Forward and backward are both counted (the backward all-to-all moves the forward's volume back).
"""

from __future__ import annotations

from recscale.distributed.topology import Topology

_ID, _LENGTH, _FLOAT = 4, 4, 4


def dmt_embedding_inter(
    topology: Topology,
    batch: int,
    tower_features: list[int],
    tower_outputs: list[int],
    dim: int,
    ids: float = 1.0,
) -> float:
    """DMT's peer all-to-alls. Rank (h, l) sends each other tower t's lengths and ids for its
    ``batch`` samples to (t, l); rank (t, l) returns c_t vectors per sample to each other peer,
    and the gradients come back: L·(H-1)·B·[Σ_t F_t·(4 + 4·ids) + 2·4·d·Σ_t c_t]."""
    hosts, local = topology.num_hosts, topology.local_world_size
    per_sample = sum(tower_features) * (_LENGTH + _ID * ids) + 2 * _FLOAT * dim * sum(tower_outputs)
    return local * (hosts - 1) * batch * per_sample


def table_wise_embedding_inter(
    topology: Topology, batch: int, owners: dict[int, int], dim: int, ids: float = 1.0, row_shards: int = 1
) -> float:
    """Flat table-wise sharding: every rank sends each table's lengths and ids for its ``batch``
    samples to the table's owner and gets d floats per sample back (and sends their gradients):
    ``owners`` maps each table (by index) to its rank. Also TorchRec's 3 int64 split sizes per pair
    of ranks per step.

    table_row_wise is the same with ``row_shards`` = the ranks per host and ``owners`` any rank of the
    table's host: the rows are split over every rank of that host, so each of them gets every sample's
    lengths (TorchRec buckets the ids by row block), each id still goes to one of them, and the pooled
    sums cross once (a reduce-scatter inside the host, then an all-to-all between peers)."""
    world = topology.world_size
    per_table = batch * (_LENGTH * row_shards + _ID * ids + 2 * _FLOAT * dim)
    total = sum(per_table for o in owners.values() for r in range(world) if not topology.same_host(r, o))
    return total + sum(3 * 8 for r in range(world) for s in range(world) if not topology.same_host(r, s))


def row_wise_pooled_inter(topology: Topology, batch: int, features: int, dim: int) -> float:
    """Flat row_wise sharding's pooled embeddings: every rank sums its rows' share of every sample's
    pooling, (W·B, F·d) floats, and a ring reduce-scatter hands each rank its samples (backward: an
    all-gather of the same size): 2 · inter-host links · (W-1)/W · W·B·F·d·4 bytes."""
    world = topology.world_size
    return 2 * _ring_links(topology) * (world - 1) / world * world * batch * features * dim * _FLOAT


def _ring_links(topology: Topology) -> int:
    """Links of the ring over all ranks in rank order that join two hosts."""
    world = topology.world_size
    return sum(1 for r in range(world) if not topology.same_host(r, (r + 1) % world))


def ring_all_reduce_inter(topology: Topology, nbytes: float) -> float:
    """A ring all-reduce of ``nbytes`` over all ranks: each rank sends 2(W-1)/W·n to its successor;
    the links between hosts are the inter-host ones."""
    world = topology.world_size
    return _ring_links(topology) * 2 * (world - 1) / world * nbytes
