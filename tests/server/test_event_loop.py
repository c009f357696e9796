"""The event loop keeps answering while a heavy request is prepared (issue 20): chat rendering and
tokenization of large inputs run on a thread pool, and boundaries come from one render."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.server.conftest import MODEL_NAME, ServerThread

WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "


def heavy_chat() -> dict:
    """2,000 messages, each with a cache_control marker, about 1 MB of text."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: " + WORDS * 6,
                 "cache_control": {"type": "ephemeral"}} for i in range(2000)]
    return {"model": MODEL_NAME, "messages": messages, "max_tokens": 1}


def test_health_and_a_small_completion_answer_while_a_heavy_chat_is_prepared(server: ServerThread) -> None:
    async def run() -> list[str]:
        order: list[str] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            async def heavy() -> None:
                r = await c.post("/v1/chat/completions", json=heavy_chat())
                assert r.status_code == 400 and "maximum context length" in r.text, r.text  # prepared, then refused
                order.append("heavy")

            async def light() -> None:
                await asyncio.sleep(0.3)  # the heavy request is being prepared by now
                r = await c.get("/health")
                assert r.status_code == 200
                order.append("health")
                r = await c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
                assert r.status_code == 200, r.text
                order.append("completion")

            start = time.monotonic()
            await asyncio.gather(heavy(), light())
            print(f"order {order}, {time.monotonic() - start:.2f}s")
        return order

    assert asyncio.run(run()) == ["health", "completion", "heavy"]
