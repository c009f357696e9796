"""Repeated timing of one call, the loop every micro-benchmark needs."""

from __future__ import annotations

import time
from collections.abc import Callable


def timings(fn: Callable[[], object], n: int, clock: Callable[[], float] = time.thread_time,
            warm: bool = True) -> list[float]:
    """Seconds of each of `n` calls of `fn` on `clock`, after one untimed call when `warm`.

    The default clock is the calling thread's CPU time: on a shared machine other processes' time slices do
    not count (their memory traffic still does). Pass time.perf_counter for wall time."""
    if warm:
        fn()
    out = []
    for _ in range(n):
        t = clock()
        fn()
        out.append(clock() - t)
    return out


def cuda_median_ms(fn: Callable[[], object], reps: int, warm: int = 1) -> float:
    """Median milliseconds of `reps` calls of `fn` on the current CUDA stream (CUDA events), after `warm`
    untimed calls (Triton compiles at the first)."""
    import torch  # lazy: the replay studies run without torch

    for _ in range(warm):
        fn()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return sorted(out)[len(out) // 2]
