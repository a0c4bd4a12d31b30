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
import os
import re

# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
KEEP_BYTES = 1 << 30  # a freed heap top up to this size stays with the process
# glibc's own values (malloc.c's DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD), and the environment that
# sets them at start-up: MALLOC_*_ variables, then GLIBC_TUNABLES, which overrides them.
_DEFAULTS = {M_MMAP_MAX: 65536, M_TRIM_THRESHOLD: 128 * 1024}
_ENV = {M_MMAP_MAX: ("MALLOC_MMAP_MAX_", "glibc.malloc.mmap_max"),
        M_TRIM_THRESHOLD: ("MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold")}  # fmt: skip

_kept = False  # keep_freed_memory() is in effect (not undone by release_freed_memory())


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if name is None or not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Tune glibc's malloc as above for the whole process, until ``release_freed_memory()``. False where
    the C library is not glibc (musl, macOS): nothing changes there."""
    global _kept
    libc = _glibc()
    if libc is None:
        return False
    _kept = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
    return _kept


def freed_memory_kept() -> bool:
    """Whether ``keep_freed_memory()`` is in effect in this process."""
    return _kept


def release_freed_memory() -> None:
    """Undo ``keep_freed_memory()``: large blocks are mmapped and a freed heap top is trimmed again, with
    the values the process started with (glibc's defaults, or the environment's), and the free memory
    the heap kept goes back to the kernel now. glibc has no call to read the values back, nor to turn its
    adaptive mmap threshold on again once mallopt set one: the threshold stays where it is (128 KiB
    unless it had adapted), so large blocks are mmapped as by default."""
    global _kept
    libc = _glibc()
    if libc is not None:
        for param, default in _DEFAULTS.items():
            libc.mallopt(param, _startup_value(param, default))
        libc.malloc_trim(0)
    _kept = False


def _startup_value(param: int, default: int) -> int:
    variable, tunable = _ENV[param]
    value = os.environ.get(variable, "")
    for item in os.environ.get("GLIBC_TUNABLES", "").replace(":", " ").split():
        key, _, v = item.partition("=")
        if key == tunable:
            value = v
    try:
        return int(value, 0)
    except ValueError:  # unset, or what glibc would not have parsed either
        return default


def failed_allocation(e: BaseException) -> int | None:
    """The bytes of the allocation ``e`` reports failing (0 where it does not say how many), or None when ``e``
    is no allocation failure. torch's CPU allocator raises a plain RuntimeError ("DefaultCPUAllocator: can't
    allocate memory: you tried to allocate N bytes"), Python a MemoryError."""
    if isinstance(e, MemoryError):
        return 0
    if not isinstance(e, RuntimeError) or "allocate" not in str(e):
        return None
    tried = re.search(r"allocate (\d+) bytes", str(e))
    return int(tried.group(1)) if tried else 0
