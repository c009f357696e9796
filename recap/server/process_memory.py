"""The server process's memory, split so a soak can tell live-object growth from allocator noise.

  rss_bytes:            resident set (/proc/self/statm); includes memory malloc keeps free;
  malloc_in_use_bytes:  bytes glibc malloc has handed out and not got back (mallinfo2 uordblks + hblkhd);
                        None off glibc;
  malloc_free_bytes:    bytes malloc holds free in its arenas (fordblks): RSS that is not live data;
  python_blocks:        sys.getallocatedblocks(), the objects Python's allocator holds;
  gc_objects:           objects the cyclic collector tracks (len(gc.get_objects()), a full walk: debug only).
No tracemalloc (it slows every allocation). `trim()` asks glibc to give free arena memory back
(malloc_trim), so a caller can see how much of RSS was free heap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys
from typing import Any


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc() -> Any | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc, or a glibc before 2.33
        return None


_LIBC = _libc()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def snapshot(count_gc_objects: bool = True) -> dict[str, int | None]:
    """The numbers above, now."""
    out: dict[str, int | None] = {"rss_bytes": rss_bytes(), "malloc_in_use_bytes": None, "malloc_free_bytes": None,
                                  "python_blocks": sys.getallocatedblocks(), "gc_objects": None}
    if _LIBC is not None:
        info = _LIBC.mallinfo2()
        out["malloc_in_use_bytes"] = info.uordblks + info.hblkhd
        out["malloc_free_bytes"] = info.fordblks
    if count_gc_objects:
        out["gc_objects"] = len(gc.get_objects())
    return out


def trim() -> bool:
    """Return free malloc memory to the OS (glibc malloc_trim); False where unavailable."""
    return bool(_LIBC.malloc_trim(0)) if _LIBC is not None else False
