"""Hosts and ranks: which rank runs on which host.

torchrun numbers ranks host by host: host ``h`` runs ranks ``h·L .. h·L + L - 1`` where ``L`` is
``LOCAL_WORLD_SIZE``, the ranks per host. TorchRec's hierarchical shardings (table_row_wise,
table_column_wise) and its intra/cross-host process groups assume the same layout, so recscale
derives hosts from it rather than from host names. That is also what lets one machine stand in
for several: one torchrun agent per simulated host gives each its own ``LOCAL_WORLD_SIZE``
(``recscale train --nproc 4 --local-world-size 2`` is 2 hosts x 2 ranks), and the run takes the
same code path as on real hosts.
"""

from __future__ import annotations

from dataclasses import dataclass

from recscale.errors import RecscaleError


@dataclass(frozen=True)
class Topology:
    world_size: int
    local_world_size: int  # ranks per host

    def __post_init__(self) -> None:
        if self.local_world_size < 1 or self.world_size % self.local_world_size:
            raise RecscaleError(
                f"{self.world_size} rank{'s' * (self.world_size != 1)} cannot form hosts of "
                f"LOCAL_WORLD_SIZE={self.local_world_size} "
                "ranks each: every host must run the same number of ranks"
            )

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.local_world_size

    def host_of(self, rank: int) -> int:
        return rank // self.local_world_size

    def ranks_of_host(self, host: int) -> list[int]:
        return list(range(host * self.local_world_size, (host + 1) * self.local_world_size))

    def same_host(self, a: int, b: int) -> bool:
        return self.host_of(a) == self.host_of(b)
