from __future__ import annotations

import itertools

from recap.bench.timing import timings


def test_timings_count_calls_and_read_the_clock_around_each() -> None:
    calls = []
    ticks = itertools.count(0.0, 0.5)  # a fake clock: each read advances by 0.5 s
    out = timings(lambda: calls.append(1), 3, clock=lambda: next(ticks))
    assert out == [0.5, 0.5, 0.5] and len(calls) == 4  # one warm-up call, untimed
    calls.clear()
    assert len(timings(lambda: calls.append(1), 2, warm=False)) == 2 and len(calls) == 2
