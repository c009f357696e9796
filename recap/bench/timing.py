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
