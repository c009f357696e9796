"""The soak's memory trend: median pairwise slope after warm-up, robust to one-off steps."""

from __future__ import annotations

import random

import pytest

from recap.bench.memory_trend import after_warmup, growth, slope_per_1k, slope_reference


def test_a_straight_line_gives_its_slope_both_ways() -> None:
    rng = random.Random(0)
    for _ in range(20):
        rate, base = rng.uniform(-5, 5), rng.uniform(0, 1e3)
        samples = [(i, base + rate * i / 1000) for i in range(0, 10_001, 250)]
        assert slope_per_1k(samples) == pytest.approx(rate, abs=1e-9)
        assert slope_reference(samples) == pytest.approx(rate, abs=1e-9)


def test_one_step_moves_least_squares_but_not_the_median_slope() -> None:
    """An allocator step (flat, then +30 MiB, then flat) is not a leak; a leak of the same size is."""
    counts = range(5000, 10_001, 250)
    step = [(i, 500.0 + (30.0 if i >= 7000 else 0.0)) for i in counts]
    assert slope_per_1k(step) == 0.0
    assert slope_reference(step) > 4.0  # least squares reads the step as growth
    leak = [(i, 500.0 + 30.0 * (i - 5000) / 5000) for i in counts]
    assert slope_per_1k(leak) == pytest.approx(6.0)
    assert growth(step) == growth(leak) == 30.0


def test_noise_around_a_flat_line_gives_a_small_slope() -> None:
    rng = random.Random(1)
    samples = [(i, 400.0 + rng.gauss(0, 2)) for i in range(5000, 10_001, 250)]
    assert abs(slope_per_1k(samples)) < 1.0


def test_warmup_is_the_leading_share_of_requests() -> None:
    samples = [(i, float(i)) for i in range(0, 1001, 100)]
    assert after_warmup(samples, 0.5) == samples[5:]
    assert after_warmup([], 0.5) == []
    assert slope_per_1k(samples[:1]) == 0.0 and growth([]) == 0.0
    with pytest.raises(ValueError):
        after_warmup(samples, 1.0)
