"""The C heap of a CPU engine process: keep freed memory instead of handing it back to the OS.

A forward pass allocates its activations anew each step (a 2,048-token step of a 12-layer model
allocates and frees hundreds of MB in blocks of 1-16 MB). glibc serves blocks above its mmap
threshold with fresh mappings and returns the top of the heap to the OS past its trim threshold,
so each step can touch its activations' pages for the first time again: page faults, each a
zeroed 4 KiB page. On a 2-core Zen 5, a cold 2,048-token prefill of the reference model took
12,000-35,000 minor faults and 0.61-0.77 s; with the thresholds raised, about 40 faults and
0.55-0.58 s. vLLM's CPU guide gets the same effect by preloading tcmalloc.

`retain_freed_memory` raises both thresholds with mallopt (glibc only; elsewhere it does
nothing). The cost is that memory freed after a peak stays with the process for reuse, which a
serving engine, whose steps repeat their peak, wants anyway. `KVTIER_RETAIN_HEAP=0` leaves
glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from kvtier.threads.env import env_switch

logger = logging.getLogger(__name__)

RETAIN_ENV = "KVTIER_RETAIN_HEAP"
MMAP_THRESHOLD = 256 << 20
"""Blocks below this come from the heap (glibc's ceiling for its own adaptive threshold is 32 MiB)."""
TRIM_THRESHOLD = 1 << 30
"""Free memory at the top of the heap kept up to this much."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_done = False


def retain_freed_memory(environ: dict[str, str] | None = None) -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); True when they are set."""
    global _done
    if _done:
        return True
    if not env_switch(RETAIN_ENV, environ):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl and others lack mallopt's knobs
        ok = (
            libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        )
    except (OSError, AttributeError):
        return False
    if ok:
        _done = True
        logger.info("heap: freed memory kept for reuse (mmap threshold %d MiB)", MMAP_THRESHOLD >> 20)
    return ok
