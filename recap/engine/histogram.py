"""A fixed-bucket histogram (Prometheus' layout): the engine's metrics and per-request histograms share it."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class Histogram:
    """Observations counted per bucket (`bounds` are upper bounds, inclusive), with their sum and count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket (not cumulative), last is +Inf
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.total += v
        self.n += 1
