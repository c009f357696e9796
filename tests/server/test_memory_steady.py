"""Memory is steady after warm-up (issue 20): the same mix of requests (completions, chats, streams cut
off by their client, bad requests) served round after round leaves no per-request record behind,
keeps the bounded indexes within capacity and grows neither live objects nor the Python heap.
Counts, not wall clock: /debug/memory's census (recap.process.census) and allocator counters.
The server's caches are small (256 KV blocks, 33 state slots), so warm-up fills them and evicts from
them: after it, any growth is a leak, not a cache filling up. Every round sends the same prompts.
Native memory (malloc's bytes in use) is left to the soak (benchmarks/soak_server.py): torch's and
oneDNN's per-shape caches take ~1,000 requests to warm up, more than a default test sends."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from recap.bench.memory_trend import slope_per_1k
from recap.engine.async_engine import AsyncEngine
from recap.engine.llm_engine import LLMEngine
from recap.server.app import build_app
from tests.server.conftest import MODEL_NAME, TEST_LIMITS, ServerThread, engine_config, wait_idle

ROUNDS = 6
WARMUP_ROUNDS = 2
WORDS = ("pump", "valve", "filter", "gauge", "schedule", "inspect", "log", "pressure", "seal", "bearing", "motor",
         "flow", "tank", "pipe", "sensor", "alarm")


def _requests() -> list[tuple[str, dict[str, Any], int | None]]:
    """One round: (path, body, events to read before hanging up or None), 48 requests."""
    out: list[tuple[str, dict[str, Any], int | None]] = []
    for i in range(48):
        text = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(5 + i % 23))
        common = {"model": MODEL_NAME, "max_tokens": 1 + i % 9, "temperature": 0.0 if i % 3 else 0.8, "seed": i}
        if i % 12 == 5:
            out.append(("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": -1}, None))
        elif i % 2:
            messages = [{"role": "system", "content": f"System {i % 4}: " + " ".join(WORDS)},
                        {"role": "user", "content": text}]
            out.append(("/v1/chat/completions", {**common, "messages": messages}, 2 if i % 8 == 3 else None))
        else:
            out.append(("/v1/completions", {**common, "prompt": text, "n": 1 + i % 4 // 3}, 1 if i % 8 == 4 else None))
    return out


async def _send(c: httpx.AsyncClient, path: str, body: dict[str, Any], cut: int | None) -> None:
    if cut is None:
        r = await c.post(path, json=body)
        assert r.status_code in (200, 400), r.text
        return
    async with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = 0
        async for line in r.aiter_lines():
            events += line.startswith("data: ")
            if events >= cut:
                return  # hang up mid-stream: the server aborts the request


async def _round(url: str, requests: list[tuple[str, dict[str, Any], int | None]]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        queue = list(requests)

        async def worker() -> None:
            while queue:
                await _send(c, *queue.pop())

        await asyncio.gather(*(worker() for _ in range(8)))


@pytest.fixture(scope="module")
def small_server(tiny_model: Path) -> Iterator[ServerThread]:
    config = engine_config(tiny_model, kv_cache_bytes=1 << 20, state_cache_bytes=1 << 20)
    config = replace(config, check_integrity=False)  # the census checks the records; integrity is the soak's
    srv = ServerThread(build_app(AsyncEngine(LLMEngine(config)), limits=TEST_LIMITS))
    srv.start()
    yield srv
    srv.stop()


def test_nothing_grows_after_warm_up(small_server: ServerThread) -> None:
    server = small_server
    http = httpx.Client(base_url=server.url, timeout=60)
    requests = _requests()
    samples: list[tuple[int, dict[str, Any]]] = []
    for r in range(ROUNDS):
        asyncio.run(_round(server.url, requests))
        wait_idle(http)
        memory = http.get("/debug/memory", params={"collect": "true"}).json()  # live objects, not pending cycles
        assert memory["per_request"] == dict.fromkeys(memory["per_request"], 0), memory["per_request"]
        pending = memory["next_step"]
        assert pending["finished_ids"] >= pending["grammar_matchers"], pending
        for name, b in memory["bounded"].items():
            assert b["count"] <= b["capacity"], (name, b)
        samples.append(((r + 1) * len(requests), memory))

    http.close()
    steady = samples[WARMUP_ROUNDS - 1:]
    kv_objects = [m["bounded"]["kv_block_objects"] for _, m in steady]
    assert all(b["count"] == b["capacity"] for b in kv_objects), kv_objects  # the pool was filled in warm-up
    for name, per_request in (("python_blocks", 15.0), ("gc_objects", 3.0)):
        series = [(n, float(m["process"][name])) for n, m in steady]
        slope = slope_per_1k(series)
        assert slope <= per_request * 1000, (name, slope, series)  # a leaked request costs hundreds of each


def test_debug_memory_reports_the_process_and_the_census(small_server: ServerThread) -> None:
    memory = httpx.get(f"{small_server.url}/debug/memory", params={"trim": "true"}, timeout=60).json()
    assert memory["process"]["rss_bytes"] > 0 and memory["process"]["python_blocks"] > 0
    assert memory["process"]["gc_objects"] > 0 and memory["process"]["malloc_trims"] is None  # no trimmer: off
    assert {"scheduler_requests", "kv_tables", "state_running", "output_parents", "async_streams"} <= set(
        memory["per_request"])
    assert {"policy_extents", "kv_cached_blocks", "state_checkpoints"} <= set(memory["bounded"])
