"""Freed host memory stays with the process for the next step (glibc's malloc on Linux).

A CPU step allocates and frees its activations: tens of MB a layer for a long prompt.
glibc serves blocks above its mmap threshold from fresh mappings and hands the free top
of its heap back to the kernel once it exceeds the trim threshold; both thresholds move
at run time, and where they land decides whether the next step writes into memory the
process already has or takes a page fault for every 4 KB it touches (the kernel zeroing
each page, inside the parallel kernels, while the other threads wait): a prefill
step can take a page fault for every page of its working memory that way, every step
alike (services/RESULTS.md).

``keep_freed_memory`` pins both thresholds: blocks up to glibc's 32 MiB cap come from the
heap, and up to a step's working memory stays there once freed. Larger blocks (a big
model's activations over thousands of rows) are still mapped afresh each time.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters, <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc refuses more on 64-bit hosts (HEAP_MAX_SIZE / 2)
_MALLOPT_MAX = 2**31 - 1  # mallopt takes an int

_lock = threading.Lock()
_kept = 0  # the largest trim threshold set in this process


def _glibc_mallopt():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None  # another C library (musl): its allocator has no such thresholds
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def keep_freed_memory(working_bytes: int) -> bool:
    """Keep up to ``working_bytes`` of freed heap for reuse (never less than an earlier
    call in this process asked for) and serve blocks up to 32 MiB from the heap.

    Returns False where the C library is not glibc (nothing changes) or refuses.
    """
    global _kept
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    with _lock:
        keep = min(max(int(working_bytes), _kept, MMAP_THRESHOLD_MAX), _MALLOPT_MAX)
        ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, keep) == 1
        if ok:
            _kept = keep
    if not ok:
        log.warning("mallopt refused the heap thresholds: activations may page-fault every step")
    return ok
