"""Keep the memory a training step frees for the next step, instead of handing it back to the kernel.

Every step allocates and frees the same large activations and gradients (tens of MiB each at the suite's
batch of 4096). glibc's malloc serves blocks above its mmap threshold (128 KiB, adapting up to 32 MiB) with
fresh ``mmap`` calls and unmaps them on free, and returns a freed heap top above its trim threshold to the
kernel: every step then zero-fills its pages again, one page fault per 4 KiB (the Frappe Wukong in fp32,
whose (4096, 32, 64) activations are 32 MiB each, trains 1.22x faster without them; docs/BENCHMARKS.md).
With ``mmap`` off and a high trim threshold, freed blocks stay in the heap and the next step reuses them;
peak memory is unchanged, memory is just not returned between steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
KEEP_BYTES = 1 << 30  # a freed heap top up to this size stays with the process


def keep_freed_memory() -> bool:
    """Tune glibc's malloc as above for the whole process. False where the C library is not glibc
    (musl, macOS): nothing changes there."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return False
    if name is None or not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
