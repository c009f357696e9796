"""The event loop keeps answering while a heavy request is prepared (issue 20): chat rendering and
tokenization of large inputs run on a thread pool, and boundaries come from one render."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from recap import structured_output
from recap.engine.async_engine import AsyncEngine
from recap.engine.llm_engine import LLMEngine
from recap.server.app import build_app
from tests.server.conftest import MODEL_NAME, TEST_LIMITS, ServerThread, engine_config

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


@pytest.fixture(scope="module")
def watched_server(tiny_model: Path) -> Iterator[tuple[ServerThread, list[str]]]:
    """A server that prepares and renders everything off the loop (inline size 0), whose tokenizer records
    each call made on a thread running an event loop."""
    engine = AsyncEngine(LLMEngine(engine_config(tiny_model)))
    on_loop: list[str] = []
    tok = engine.engine.tokenizer
    for name in ("encode", "decode", "batch_decode", "apply_chat_template", "convert_ids_to_tokens", "__call__"):
        if hasattr(tok, name):
            setattr(tok, name, _watched(getattr(tok, name), name, on_loop))
    app = build_app(engine, limits=TEST_LIMITS)
    app.state.recap.offload.inline_size = 0
    srv = ServerThread(app)
    with pytest.MonkeyPatch.context() as mp:  # grammar bounds and compiles (StructuredOutput.compiled) too
        mp.setattr(structured_output, "check_bounds", _watched(structured_output.check_bounds, "grammar", on_loop))
        srv.start()
        yield srv, on_loop
        srv.stop()


def _watched(fn: Callable[..., Any], name: str, on_loop: list[str]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            asyncio.get_running_loop()
            on_loop.append(name)
        except RuntimeError:  # no loop in this thread: the engine thread or the prepare pool
            pass
        return fn(*args, **kwargs)

    return call


def _stream(c: httpx.Client, path: str, body: dict[str, Any]) -> None:
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert list(r.iter_lines())[-2:] == ["data: [DONE]", ""] or "data: [DONE]" in r.read().decode()


def test_no_handler_path_tokenizes_or_detokenizes_on_the_event_loop(watched_server: tuple[ServerThread, list[str]]
                                                                    ) -> None:
    """Every route that renders, tokenizes or detokenizes (prompts, chats, echo, logprobs, streams,
    /tokenize, /detokenize) or bounds and compiles a grammar does it on a worker thread once inputs are large
    (here: always)."""
    srv, on_loop = watched_server
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there",
                                                         "cache_control": {"type": "ephemeral"}}]
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        calls: list[tuple[str, dict[str, Any]]] = [
            ("/v1/completions", {"prompt": "count with me one two", "max_tokens": 4}),
            ("/v1/completions", {"prompt": [5, 6, 7, 8, 9], "max_tokens": 3, "echo": True, "logprobs": 2, "n": 2,
                                 "temperature": 0.5, "seed": 1}),
            ("/v1/completions", {"prompt": "x y z", "max_tokens": 1, "prompt_logprobs": 1}),
            ("/v1/chat/completions", {"messages": chat, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}),
            ("/tokenize", {"prompt": "some text", "return_token_strs": True}),
            ("/tokenize", {"messages": chat}),
            ("/detokenize", {"tokens": [5, 6, 7]}),
            ("/v1/completions", {"prompt": "Pick:", "max_tokens": 4, "guided_choice": ["yes", "no"]}),
            ("/v1/chat/completions", {"messages": chat, "max_tokens": 4, "response_format": {
                "type": "json_schema", "json_schema": {"name": "v", "schema": {"type": "object"}}}}),
            ("/v1/chat/completions", {"messages": chat, "max_tokens": 8, "tool_choice": "required", "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}),
        ]
        for path, body in calls:
            r = c.post(path, json={"model": MODEL_NAME, **body})
            assert r.status_code == 200, (path, r.text)
        _stream(c, "/v1/completions", {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 3, "echo": True,
                                       "logprobs": 1})
        _stream(c, "/v1/chat/completions", {"model": MODEL_NAME, "messages": chat, "max_tokens": 3,
                                            "logprobs": True, "top_logprobs": 1})
    assert on_loop == [], on_loop


def test_health_answers_while_a_large_tokenize_is_prepared(server: ServerThread) -> None:
    """/tokenize of a 2,000-message chat renders on the pool: /health answers before it returns."""
    body = {"model": MODEL_NAME, "messages": heavy_chat()["messages"]}

    async def run() -> list[str]:
        order: list[str] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            async def heavy() -> None:
                r = await c.post("/tokenize", json=body)
                assert r.status_code == 200 and r.json()["count"] > 10_000, r.text[:200]
                order.append("tokenize")

            async def light() -> None:
                await asyncio.sleep(0.3)
                assert (await c.get("/health")).status_code == 200
                order.append("health")

            await asyncio.gather(heavy(), light())
        return order

    assert asyncio.run(run()) == ["health", "tokenize"]
