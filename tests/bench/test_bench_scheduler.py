"""benchmarks/bench_scheduler.py: it times real decode steps (every request decoding) of the real core."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_measure_times_decode_steps_of_every_request() -> None:
    spec = importlib.util.spec_from_file_location("bench_scheduler", ROOT / "benchmarks" / "bench_scheduler.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    row = mod.measure(running=8, steps=20, policy="recap", prompt_len=70, block_size=16, seed=3)
    assert row["running"] == 8 and row["steps"] == 20  # measure() asserts all 8 decode in every timed step
    assert row["schedule_ms_median"] > 0 and row["update_ms_median"] > 0
    assert row["schedule_plus_update_ms_p90"] >= row["schedule_plus_update_ms_median"] > 0
