"""Weights on transparent huge pages: a decode step streams every weight once, and from 4 KiB pages it did so
well below the memory's rate.

The hardware prefetchers stop at page boundaries and every 4 KiB page costs a TLB entry; a batch-1 linear
reads hundreds of megabytes per step. Measured on the 2-core AVX-512 EPYC (the native one-row fp32 kernel,
weights cycled through 400 MB, medians; docs/performance.md): 1 thread 17-18 -> 25.6-27.5 GB/s, 2 threads
25.4-27.5 -> 31.9-47.2 GB/s. This machine's THP mode is `madvise`, so memory is huge-paged only where asked.

`move_to_huge_pages` copies tensors into one private anonymous mapping advised MADV_HUGEPAGE before it is
touched (a MAP_SHARED mapping, Python's mmap default, is shmem and was never huge-paged here) and returns the
views; the mapping lives as long as any of them. Where the platform has no MADV_HUGEPAGE it returns None and
the tensors stay where they are.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 << 20
HUGE_PAGE_MIN_BYTES = 1 << 20  # smaller tensors (norm weights, biases) stay where they are
ALIGN = 64  # each tensor's start: a cache line (the kernels' aligned loads)


def huge_pages_supported() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")


def _arena(nbytes: int, fault_in: bool = True) -> torch.Tensor:
    """uint8 [nbytes] at a huge-page boundary of a fresh mapping advised MADV_HUGEPAGE; every page faulted in
    (zero-filled by the kernel) when `fault_in`, else left to the first write."""
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    buf = torch.frombuffer(mm, dtype=torch.uint8)  # holds a reference to the mapping
    start = -buf.data_ptr() % HUGE_PAGE
    arena = buf[start : start + nbytes]
    # Fault every page in now (the kernel zero-fills it): left lazy, a pool's slots paid their page faults on
    # first use, inside a request (a short prefill writing fresh checkpoint slots ran ~25% slower).
    if fault_in:
        arena[:: 4096].zero_()
    return arena


def huge_page_zeros(
    specs: Sequence[tuple[tuple[int, ...], torch.dtype]], fault_in: bool = True
) -> list[torch.Tensor] | None:
    """Zero-filled tensors of these (shape, dtype)s in one huge-page mapping, or None where the platform cannot
    advise it. `fault_in`: every page faulted in now (a pool's); False: on its first write (a copy's target, so
    that the copy's source can be freed as it goes)."""
    if not huge_pages_supported() or not specs:
        return None
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-max(n, 1) // ALIGN) * ALIGN
    try:
        arena = _arena(total, fault_in)
    except (OSError, ValueError):
        return None
    return [arena[o : o + n].view(dtype).view(shape) for (shape, dtype), o, n in zip(specs, offsets, sizes)]


def move_to_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """Copies of `tensors` (contiguous, same shapes and dtypes) in one huge-page mapping, or None where the
    platform cannot advise it. The caller points its modules at the copies (`param.data = copy`)."""
    out = huge_page_zeros([(tuple(t.shape), t.dtype) for t in tensors], fault_in=False)
    if out is not None:
        for t, dst in zip(tensors, out):
            dst.copy_(t)
    return out
