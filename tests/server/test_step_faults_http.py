"""A request that makes the engine's step raise, over HTTP: it gets a 500 naming the cause (streamed or not), the
requests running beside it get their 200s with their tokens, /health stays 200 and the pools end idle."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from recap.engine.async_engine import AsyncEngine
from recap.engine.llm_engine import LLMEngine
from recap.server.app import build_app
from tests.engine.test_step_faults import POISON, poison_backend
from tests.engine.workloads import rnd
from tests.server.conftest import MODEL_NAME, TEST_LIMITS, ServerThread, engine_config, metric, wait_idle


@pytest.fixture(scope="module")
def faulty(tiny_model: Path) -> Iterator[ServerThread]:
    engine = LLMEngine(engine_config(tiny_model))
    poison_backend(engine)
    srv = ServerThread(build_app(AsyncEngine(engine), limits=TEST_LIMITS))
    srv.start()
    yield srv
    srv.stop()


def complete(http: httpx.Client, prompt: list[int], stream: bool = False) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 5, "temperature": 0, "stream": stream}
    return http.post("/v1/completions", json=body)


def test_the_poisoned_request_gets_a_500_and_its_neighbours_their_answers(faulty: ServerThread) -> None:
    prompts = [rnd(20 + i, 30) for i in range(4)]
    prompts[1] = prompts[1][:10] + [POISON] + prompts[1][10:]
    with httpx.Client(base_url=faulty.url, timeout=60) as http:
        alone = [complete(http, p).json()["choices"][0]["text"] for i, p in enumerate(prompts) if i != 1]
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda p: complete(http, p), prompts))
        bad = replies.pop(1)
        assert bad.status_code == 500, bad.text
        err = bad.json()["error"]
        assert err["code"] == "step_failed" and "poisoned batch" in err["message"]
        assert [r.status_code for r in replies] == [200, 200, 200]
        assert [r.json()["choices"][0]["text"] for r in replies] == alone
        streamed = complete(http, prompts[1], stream=True)
        assert streamed.status_code == 500 and streamed.json()["error"]["code"] == "step_failed"
        assert http.get("/health").status_code == 200
        report = wait_idle(http)
        assert report["ok"], report
        assert metric(http, "recap:failed_steps_total") >= 3
