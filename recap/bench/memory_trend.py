"""Is a memory series flat after warm-up? The slope per 1,000 requests, robust to allocator steps.

Samples are (requests sent, value) pairs. After dropping the warm-up share, the slope is the Theil-Sen
estimate: the median of the slopes between every pair of samples. A one-off step (glibc growing an
arena, a cache reaching its capacity) moves few pairs' slopes and not the median; steady growth (a
leak) moves them all. `slope_reference` is the plain least-squares slope, beside it for comparison.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

Sample = tuple[int, float]


def after_warmup(samples: Sequence[Sample], warmup_fraction: float) -> list[Sample]:
    """The samples taken at or after `warmup_fraction` of the last sample's request count."""
    if not 0.0 <= warmup_fraction < 1.0:
        raise ValueError(f"warmup_fraction must be in [0, 1), got {warmup_fraction}")
    if not samples:
        return []
    cut = warmup_fraction * max(i for i, _ in samples)
    return [(i, v) for i, v in samples if i >= cut]


def slope_per_1k(samples: Sequence[Sample]) -> float:
    """Median pairwise slope, in value units per 1,000 requests; 0.0 with fewer than two distinct counts."""
    slopes = [(vb - va) / (ib - ia) for a, (ia, va) in enumerate(samples) for ib, vb in samples[a + 1:] if ib != ia]
    return 1000.0 * statistics.median(slopes) if slopes else 0.0


def slope_reference(samples: Sequence[Sample]) -> float:
    """Least-squares slope per 1,000 requests (not robust to steps; for comparison)."""
    if len({i for i, _ in samples}) < 2:
        return 0.0
    mi = statistics.fmean(i for i, _ in samples)
    mv = statistics.fmean(v for _, v in samples)
    num = sum((i - mi) * (v - mv) for i, v in samples)
    den = sum((i - mi) ** 2 for i, _ in samples)
    return 1000.0 * num / den


def growth(samples: Sequence[Sample]) -> float:
    """The last value minus the lowest (0.0 without samples): the total rise a slope may hide."""
    return samples[-1][1] - min(v for _, v in samples) if samples else 0.0
