"""A Bloom filter of (user, item) pairs as a module: the items a user has already seen.

``might_contain`` never misses an added pair (no false negatives) and says yes to a pair never added
with probability about ``(1 - exp(-k n / m)) ** k`` (m bits, k hashes, n pairs added); ``sized``
picks m and k for a ``capacity`` and a target ``fp_rate``. The bits are packed 8 to a byte in a uint8
buffer. Hashes: two 31-bit mixes of (user, item) (multiply-mod-prime and xor-shift rounds, every product
below 2**62 so int64 never overflows), combined as ``h1 + j * h2 mod m`` for j < k (double hashing).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

_P = (1 << 31) - 1  # a Mersenne prime
_SEEDS = ((1_000_003, 2_147_483_629, 0x5BD1E995 % _P), (7_368_787, 1_234_567_891, 0x27D4EB2F % _P))


def _mix(users: Tensor, items: Tensor, seed: tuple[int, int, int]) -> Tensor:
    """int64 (...,) pairs -> int64 (...,) in [0, 2**31)."""
    a, b, c = seed
    x = ((users % _P) * a + items % _P) % _P
    x = ((x ^ (x >> 13)) * b) % _P
    x = ((x ^ (x >> 16)) * c) % _P
    return x ^ (x >> 15)


class BloomFilter(nn.Module):
    """bits (ceil(m / 8),) uint8; ``add(users, items)`` and ``might_contain(users, items) -> bool``,
    both on int64 tensors of one shape (ids >= 0)."""

    bits: Tensor

    def __init__(self, n_bits: int, n_hashes: int) -> None:
        super().__init__()
        if n_bits < 8 or n_hashes < 1 or n_bits >= 1 << 31:
            raise ValueError(
                f"a Bloom filter needs 8 <= n_bits < 2**31 and n_hashes >= 1, got {n_bits}, {n_hashes}"
            )
        self.n_bits, self.n_hashes = n_bits, n_hashes
        self.register_buffer("bits", torch.zeros((n_bits + 7) // 8, dtype=torch.uint8))

    @classmethod
    def sized(cls, capacity: int, fp_rate: float) -> BloomFilter:
        """The filter of fewest bits for ``capacity`` pairs at a false-positive rate ``fp_rate``."""
        if capacity < 1 or not 0 < fp_rate < 1:
            raise ValueError(
                f"a Bloom filter needs capacity >= 1 and 0 < fp_rate < 1, got {capacity}, {fp_rate}"
            )
        n_bits = max(8, math.ceil(-capacity * math.log(fp_rate) / math.log(2) ** 2))
        return cls(n_bits, max(1, round(n_bits / capacity * math.log(2))))

    def _positions(self, users: Tensor, items: Tensor) -> Tensor:
        """(...,) pairs -> (..., n_hashes) bit positions in [0, n_bits)."""
        h1, h2 = (_mix(users, items, s) for s in _SEEDS)
        j = torch.arange(self.n_hashes)
        return (h1[..., None] + j * (h2[..., None] | 1)) % self.n_bits

    def add(self, users: Tensor, items: Tensor) -> None:
        pos = self._positions(users.long(), items.long()).flatten()
        byte, bit = pos >> 3, pos & 7
        # Positions can share a byte: set one bit value at a time, so duplicate bytes write one value.
        for b in range(8):
            sel = bit == b
            self.bits[byte[sel]] |= 1 << b

    def might_contain(self, users: Tensor, items: Tensor) -> Tensor:
        pos = self._positions(users.long(), items.long())
        return (((self.bits[pos >> 3] >> (pos & 7).to(torch.uint8)) & 1).bool()).all(dim=-1)

    def index_bytes(self) -> int:
        return self.bits.numel()
