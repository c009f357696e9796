"""Keep freed memory in the process heap (glibc), so a prefill's large temporaries do not page-fault.

glibc serves allocations above M_MMAP_THRESHOLD (at most 32 MiB by its dynamic rule) with fresh mmaps and
returns them on free, so every 2048-token prefill touches new pages: ~345k minor page faults for a
1,800-token prompt of a 115M Mamba2 (~1.4 GB of zeroed pages), and ~430k through the engine. With the
threshold at 1 GiB and trimming above 2 GiB free, a step reuses its predecessor's memory: faults go to ~0
and the engine's prefill took 4.8-5.0 s of thread CPU time instead of 5.7-5.9 (the model step alone 5.0
instead of 5.5; 1 thread, load 17-19). The cost: the heap keeps its peak size (freed memory is reused,
not returned to the OS).

The same holds on other threads only with one arena for all (M_ARENA_MAX 1): a thread's own arena grows in
mmap'd heaps of at most 64 MiB whatever the thresholds, and `recap serve` runs the model on its engine
thread (~50k faults per 2048-token prefill, ~10% slower at 2 threads; with one arena 3-18 faults).

A process-wide setting, so the entry points (`recap serve`) call it, not library code.

`return_free_heap` is the other direction, for the moments that free a lot at once: loading and laying out the
weights (a quantized layer's fp32 weight, a parameter a packed layout replaced) would otherwise stay resident
in glibc's arenas until reused; malloc_trim(0) hands every free page back (whole pages in the middle of the heap
too, since glibc 2.8). Off glibc both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 1 << 30  # glibc's maximum on 64-bit is 32 MiB only for the *dynamic* threshold
TRIM_THRESHOLD_BYTES = 2 << 30


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds and keep one arena for every thread; False where libc has no
    mallopt (or refuses a setting)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    # One arena for every thread: a thread's own arena grows in mmap'd heaps of at most 64 MiB that it maps
    # and unmaps as it goes, whatever the thresholds, so the engine thread of `recap serve` paged-faulted
    # ~50k times per 2048-token prefill (the main thread: ~0) and prefilled ~10% slower at 2 threads.
    ok = ok and mallopt(M_ARENA_MAX, 1) == 1
    return ok and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1


@functools.cache
def _malloc_trim() -> Any | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def return_free_heap() -> bool:
    """malloc_trim(0): free heap pages back to the OS; False where unavailable (or nothing was returned)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
