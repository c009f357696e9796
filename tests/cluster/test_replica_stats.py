"""A replica's routing stats, taken on a real engine's thread (AsyncEngine.call), against its own hits."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from recap import SamplingParams
from recap.cluster.router import CheckpointRouter, RouterConfig, RouteRequest
from recap.cluster.stats import StatsLimits, collect_stats
from recap.core.request import Request
from recap.engine.async_engine import AsyncEngine
from recap.engine.llm_engine import LLMEngine
from tests.engine.test_equivalence import make_llm
from tests.engine.workloads import rnd


def _stats(engine: LLMEngine) -> object:
    sched = engine.scheduler
    return collect_stats(sched.cache, sched.num_running, sched.num_waiting, time.time(), StatsLimits())


@pytest.mark.parametrize("arch", ["bamba", "mamba2"])
def test_stats_from_the_engine_thread_match_its_hits(tiny_models: dict[str, Path], arch: str) -> None:
    llm = make_llm(tiny_models[arch], caching=True)
    engine = AsyncEngine(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    turns = [rnd(3, 70), rnd(4, 41)]

    async def run() -> tuple[object, list[list[int]]]:
        follow_ups = []
        for i, prompt in enumerate(turns):
            prepared = engine.prepare(prompt, params, cache_salt="tenant" if i else None)
            async for out in engine.generate(prepared):
                if out.finished:
                    follow_ups.append(prompt + list(out.outputs[0].token_ids) + rnd(9 + i, 20))
        stats = await engine.call(_stats)
        with pytest.raises(ZeroDivisionError):
            await engine.call(lambda e: 1 // 0)  # an error on the engine thread reaches the caller
        return stats, follow_ups

    try:
        stats, follow_ups = asyncio.run(run())
    finally:
        engine.shutdown()
    router = CheckpointRouter(RouterConfig(block_size=16))
    router.update_stats("r", stats)  # type: ignore[arg-type]
    cache = llm.engine.scheduler.cache
    for i, prompt in enumerate(follow_ups):
        salt = "tenant" if i else None
        probe = Request(f"probe-{i}", prompt, 1, cache_salt=salt)
        cache.update_hashes(probe)
        want = cache.find_hit(probe).num_tokens
        assert want > 0  # the previous turn left a resumable prefix
        assert router.score(["r"], RouteRequest(prompt, cache_salt=salt))[0].resumable_tokens == want
        assert router.score(["r"], RouteRequest(prompt, cache_salt="other"))[0].resumable_tokens == 0
