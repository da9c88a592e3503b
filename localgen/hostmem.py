"""Host memory reuse for processes that allocate large CPU tensors every step (a leaf module:
the runtime and the profiler's probes both run under it)."""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)
_heap_kept = False


def keep_freed_host_memory(limit: int = 1 << 30) -> bool:
    """Let glibc's malloc keep freed blocks below ``limit`` bytes for reuse instead of returning
    them to the kernel (``mallopt`` M_MMAP_THRESHOLD and M_TRIM_THRESHOLD). By default every
    allocation above 128 KiB is a fresh ``mmap``, zero-filled page by page on first touch and
    unmapped when freed; a CPU forward allocates such tensors in every layer (a decode step's
    gathered K/V and logits, a prefill's activations), and writes that fault fresh pages in run
    several times slower than writes into reused memory. This is what the jemalloc /
    tcmalloc advice for PyTorch on CPUs achieves, without preloading another allocator. The
    process keeps its peak heap (the memory stays mapped, not in use). Once per process; glibc
    only; ``LOCALGEN_MALLOPT=0`` turns it off. Returns whether it was applied."""
    global _heap_kept
    off = os.environ.get("LOCALGEN_MALLOPT", "1") == "0"
    if _heap_kept or off or not sys.platform.startswith("linux"):
        return _heap_kept
    try:
        libc = ctypes.CDLL("libc.so.6")
        _heap_kept = bool(libc.mallopt(_M_MMAP_THRESHOLD, limit)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, limit))
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        _heap_kept = False
    return _heap_kept
