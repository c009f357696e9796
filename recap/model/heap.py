"""Give the heap's free memory back to the OS once loading or laying out the weights has freed its garbage.

glibc keeps freed memory in its arenas (and `recap serve` raises the thresholds so that it keeps even more:
recap/process/heap.py), so the full-precision tensors a load replaced (a quantized layer's fp32 weight, a
parameter a packed layout took the place of) would stay resident until reused. `malloc_trim(0)` hands every
free page back (whole pages in the middle of the heap too, since glibc 2.8). Off glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


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
