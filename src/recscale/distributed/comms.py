"""Communication accounting: the bytes every collective moves, split into intra- and inter-host traffic.

The collective functions of ``torch.distributed`` are wrapped once per process; while a ``CommMeter``
is recording, each call adds the bytes this rank *sends* to each peer, by collective kind and by
whether the peer is on the same host (``Topology``). Bytes a rank keeps for itself are not counted.
TorchRec's sharded embeddings, FSDP2 and DDP (through ``dense.HookedDDPWrapper``) all communicate
through these functions.

Volumes:

- all_to_all (TorchRec's id, pooled-embedding and gradient exchanges): exact, from the split sizes.
- all_reduce, reduce_scatter, all_gather, broadcast: the bytes of the ring algorithm NCCL and gloo
  use, over the group's ranks in rank order (a chain from the source for broadcast). For a payload
  of ``n`` bytes in a group of ``k`` ranks each rank sends its ring successor
  ``2(k-1)/k·n`` (all_reduce), ``(k-1)/k·n`` (reduce_scatter: n = its input; all_gather: n = its
  output) and ``n`` (broadcast, all but the chain's last rank). The link to the successor is
  intra- or inter-host by the two ranks' hosts.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from recscale.distributed.topology import Topology

KINDS = ("all_to_all", "all_reduce", "reduce_scatter", "all_gather", "broadcast")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _all_to_all_single(a: dict[str, Any], k: int) -> list[float]:
    x = a["input"]
    rows = x.shape[0] if x.dim() else 0
    splits = a.get("input_split_sizes") or [rows // k] * k
    row_bytes = _nbytes(x) // rows if rows else 0
    return [s * row_bytes for s in splits]


def _all_to_all(a: dict[str, Any], k: int) -> list[float]:
    return [_nbytes(t) for t in a["input_tensor_list"]]


def _ring(fraction: Callable[[int], float], payload: Callable[[dict[str, Any]], int]):
    def sends(a: dict[str, Any], k: int, me: int) -> list[float]:
        out = [0.0] * k
        out[(me + 1) % k] = fraction(k) * payload(a)
        return out

    return sends


# name in torch.distributed -> (kind, per-peer bytes sent by the calling rank)
_DIRECT = {"all_to_all_single": _all_to_all_single, "all_to_all": _all_to_all}
_RING = {
    "all_reduce": ("all_reduce", _ring(lambda k: 2 * (k - 1) / k, lambda a: _nbytes(a["tensor"]))),
    "reduce_scatter_single": (
        "reduce_scatter", _ring(lambda k: (k - 1) / k, lambda a: _nbytes(a["input"]))
    ),
    "reduce_scatter": (
        "reduce_scatter", _ring(lambda k: (k - 1) / k, lambda a: sum(map(_nbytes, a["input_list"])))
    ),
    "all_gather_single": (
        "all_gather", _ring(lambda k: (k - 1) / k, lambda a: _nbytes(a["output_tensor"]))
    ),
    "all_gather": ("all_gather", _ring(lambda k: k - 1, lambda a: _nbytes(a["tensor"]))),
}  # fmt: skip


class CommMeter:
    """Per-rank byte counters for the collectives issued while ``recording()``.

    ``sync=True`` waits for every asynchronous collective inside the call, so ``seconds`` is the
    time spent communicating (for the benchmark's step breakdown; it removes compute overlap).
    """

    def __init__(self, topology: Topology, rank: int, sync: bool = False) -> None:
        self.topology, self.rank, self.sync = topology, rank, sync
        self.bytes: dict[tuple[str, str], float] = defaultdict(float)
        self.seconds = 0.0
        self.active = False
        self._groups: dict[int, list[int]] = {}

    @contextmanager
    def recording(self) -> Iterator[None]:
        global _METER
        previous, _METER = _METER, self
        self.active = True
        try:
            yield
        finally:
            self.active, _METER = False, previous

    def reset(self) -> None:
        self.bytes.clear()
        self.seconds = 0.0

    def _ranks(self, group: Any) -> list[int]:
        group = group or dist.GroupMember.WORLD
        key = id(group)
        if key not in self._groups:
            self._groups[key] = dist.get_process_group_ranks(group)
        return self._groups[key]

    def add(self, name: str, args: dict[str, Any]) -> None:
        ranks = self._ranks(args.get("group"))
        k, me = len(ranks), ranks.index(self.rank)
        if name in _DIRECT:
            kind, sends = "all_to_all", _DIRECT[name](args, k)
        elif name == "broadcast":
            kind, src = "broadcast", ranks.index(args["src"])
            sends = [0.0] * k
            if (me - src) % k != k - 1:
                sends[(me + 1) % k] = _nbytes(args["tensor"])
        else:
            kind, ring = _RING[name]
            sends = ring(args, k, me)
        for peer, n in zip(ranks, sends, strict=True):
            if peer != self.rank and n:
                where = "intra" if self.topology.same_host(self.rank, peer) else "inter"
                self.bytes[(kind, where)] += n

    def totals(self) -> torch.Tensor:
        """(len(KINDS), 2) bytes sent by this rank: columns intra, inter."""
        return torch.tensor(
            [[self.bytes[(k, w)] for w in ("intra", "inter")] for k in KINDS], dtype=torch.float64
        )


def summarize(total: torch.Tensor, steps: int) -> dict[str, Any]:
    """Log fields from ``totals()`` summed over ranks: bytes per step by kind and locality."""
    per_step = (total / max(steps, 1)).tolist()
    comm = {
        k: {"intra": round(a), "inter": round(b)} for k, (a, b) in zip(KINDS, per_step, strict=True) if a or b
    }
    return {
        "comm_intra_bytes": round(sum(a for a, _ in per_step)),
        "comm_inter_bytes": round(sum(b for _, b in per_step)),
        "comm": comm,
    }


_METER: CommMeter | None = None
_NAMES = ("all_to_all_single", "all_to_all", "all_reduce", "reduce_scatter_single", "reduce_scatter",
          "all_gather_single", "all_gather", "broadcast")  # fmt: skip


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        meter = _METER
        if meter is None or not meter.active:
            return fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        meter.add(name, bound.arguments)
        if not meter.sync:
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        work = fn(*args, **kwargs)
        if work is not None:
            work.wait()
        meter.seconds += time.perf_counter() - t0
        return work

    counted.__recscale_counted__ = True  # type: ignore[attr-defined]
    return counted


def install() -> None:
    """Wrap the collectives (idempotent). Callers that reach them as ``torch.distributed.X`` or as
    module globals of ``distributed_c10d`` (its own aliases, e.g. ``all_gather_into_tensor``) are seen."""
    for name in _NAMES:
        fn = getattr(c10d, name)
        if getattr(fn, "__recscale_counted__", False):
            continue
        counted = _wrap(name, fn)
        setattr(c10d, name, counted)
        setattr(dist, name, counted)
