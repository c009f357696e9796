"""Exact edge semantics over HTTP (issue 36, scope 6): tiny temperatures act as greedy (N8), n x prompts counts
against --max-queued in sequences (N9), logit_bias keys are canonical token ids (N11)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from recap.engine.async_engine import AsyncEngine
from recap.engine.llm_engine import LLMEngine
from recap.http.limits import ServerLimits
from recap.sampling_params import SAMPLING_EPS, SamplingParams
from recap.server.app import build_app
from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, ServerThread, engine_config, wait_idle

C = "/v1/completions"


def _completion(http: httpx.Client, **kw: object) -> httpx.Response:
    return http.post(C, json={"model": MODEL_NAME, "prompt": "The pump and the valve", "max_tokens": 8, **kw})


def test_sampling_eps_is_vllms() -> None:
    assert SAMPLING_EPS == 1e-5
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=9.9e-6).greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy and not SamplingParams(temperature=0.5).greedy


@pytest.mark.parametrize("temperature", [5e-324, 1e-39, 1e-20, 9e-6])
def test_a_temperature_below_eps_is_greedy(http: httpx.Client, temperature: float) -> None:
    greedy = _completion(http, temperature=0.0)
    tiny = _completion(http, temperature=temperature, seed=3)
    assert greedy.status_code == tiny.status_code == 200, tiny.text
    g, t = greedy.json()["choices"][0], tiny.json()["choices"][0]
    assert (t["text"], t["finish_reason"]) == (g["text"], g["finish_reason"])
    assert tiny.json()["usage"]["completion_tokens"] == greedy.json()["usage"]["completion_tokens"]


@pytest.mark.parametrize("key", [" 7 ", "7 ", "\u0665", "1_0", "07", "00", "+7", "-1", "", "0x7", "7.0",
                                 "1" * 19])
def test_logit_bias_keys_must_be_canonical_token_ids(http: httpx.Client, key: str) -> None:
    r = _completion(http, logit_bias={key: 1.0})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and f"key {key!r} is not a token id" in err["message"], err


def test_logit_bias_duplicate_keys_are_refused(http: httpx.Client) -> None:
    body = json.dumps({"model": MODEL_NAME, "prompt": "a", "max_tokens": 2}).encode()[:-1]
    r = http.post(C, content=body + b', "logit_bias": {"7": 100, "7": -100}}',
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and err["code"] == "duplicate_key" and "'7'" in err["message"], err
    ok = _completion(http, logit_bias={"7": 100.0, "0": -1.0}, temperature=0.0, max_tokens=2)
    assert ok.status_code == 200, ok.text


# ---- N9: sequences, not requests, against --max-queued ----------------------------------------------


def test_the_reported_request_is_refused_by_default(http: httpx.Client) -> None:
    """256 prompts x n 16 in one small body: 4,096 sequences, over the default --max-queued (1024)."""
    r = _completion(http, prompt=["a"] * 256, n=16, max_tokens=2)
    assert r.status_code == 400, r.text[:300]
    assert "4096 sequences" in r.json()["error"]["message"] and r.json()["error"]["param"] == "n"
    assert wait_idle(http)["ok"]

SEQ_LIMIT = 8


@pytest.fixture(scope="module")
def seq_limited(tiny_model: Path) -> Iterator[ServerThread]:
    engine = AsyncEngine(LLMEngine(dataclasses.replace(engine_config(tiny_model), max_n=16)))
    srv = ServerThread(build_app(engine, limits=ServerLimits(max_queued=SEQ_LIMIT, enable_debug=True)))
    srv.start()
    yield srv
    srv.stop()


def test_a_request_over_the_sequence_limit_alone_is_a_400(seq_limited: ServerThread) -> None:
    with httpx.Client(base_url=seq_limited.url, timeout=60) as http:
        r = _completion(http, prompt=["a", "b", "c"], n=3)  # 9 sequences
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "n" and err["code"] == "limit_exceeded", err
        assert "9 sequences" in err["message"] and "--max-queued" in err["message"], err
        chat = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "n": 9, "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and "9 sequences" in chat.json()["error"]["message"], chat.text
        ok = _completion(http, prompt=["a", "b"], n=4, max_tokens=2)  # 8: exactly the limit
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 8, ok.text
        assert wait_idle(http)["ok"]


def test_sequences_in_flight_count_against_the_limit(seq_limited: ServerThread) -> None:
    long = {"model": MODEL_NAME, "prompt": "count", "max_tokens": 500, "ignore_eos": True, "n": 6, "stream": True}
    with httpx.Client(base_url=seq_limited.url, timeout=60) as http:
        with http.stream("POST", C, json=long) as held:
            assert held.status_code == 200
            lines = held.iter_lines()  # kept: a dropped iterator closes the stream (and aborts the request)
            next(lines)  # the 6 sequences are in
            busy = _completion(http, n=3, max_tokens=2)  # 6 + 3 > 8
            assert busy.status_code == 429 and busy.headers["retry-after"] == "1", busy.text
            assert busy.json()["error"]["code"] == "server_busy" and "sequences" in busy.json()["error"]["message"]
            room = _completion(http, n=2, max_tokens=2)  # 6 + 2 fits
            assert room.status_code == 200, room.text
            assert next(ln for ln in lines if ln).startswith("data: {")  # still streaming
        # the stream closed: its sequences are released
        assert wait_idle(http)["ok"]
        again = _completion(http, prompt=["a", "b"], n=4, max_tokens=2)
        assert again.status_code == 200, again.text


# ---- N10: a forced tool call cut at max_tokens has one shape -------------------------------------------

CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]}}, "required": ["city"],
    "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _streamed(http: httpx.Client, body: dict) -> tuple[str, list, str | None]:
    content, calls, finish = "", [], None
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                content += choice["delta"].get("content") or ""
                calls += choice["delta"].get("tool_calls") or []
                finish = choice["finish_reason"] or finish
    return content, calls, finish


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_a_forced_call_cut_at_max_tokens_is_content_with_length(http: httpx.Client, choice: object) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [CITY],
            "tool_choice": choice, "max_tokens": 3, "temperature": 0.0}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (out,) = r.json()["choices"]
    text = out["message"]["content"]
    assert out["finish_reason"] == "length" and out["message"]["tool_calls"] == [], out
    assert text and text.lstrip().startswith("[" if choice == "required" else "{"), out  # the raw, cut JSON
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    assert _streamed(http, body) == (text, [], "length")
    whole = http.post("/v1/chat/completions", json={**body, "max_tokens": 200}).json()["choices"][0]
    (call,) = whole["message"]["tool_calls"][:1]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None, whole
    assert isinstance(json.loads(call["function"]["arguments"]), dict)


@pytest.fixture(scope="module")
def default_length(tiny_model: Path) -> Iterator[ServerThread]:
    """A server whose model's generation_config sets max_new_tokens 64 (the default model's sets 256)."""
    llm_engine = LLMEngine(engine_config(tiny_model))
    llm_engine.default_sampling = {**llm_engine.default_sampling, "max_tokens": 64}
    srv = ServerThread(build_app(AsyncEngine(llm_engine), limits=ServerLimits(enable_debug=True)))
    srv.start()
    yield srv
    srv.stop()


def test_a_default_length_is_capped_by_the_room_a_long_prompt_leaves(default_length: ServerThread) -> None:
    """vLLM's get_max_tokens: a client that sends no max_tokens gets min(default, room left), never a 400 about a
    length it did not ask for; a max_tokens the client sends is still checked against the room."""
    room = 10
    prompt = [7] * (MAX_MODEL_LEN - room)
    with httpx.Client(base_url=default_length.url, timeout=120) as http:
        r = http.post(C, json={"model": MODEL_NAME, "prompt": prompt, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == room and r.json()["choices"][0]["finish_reason"] == "length"
        short = http.post(C, json={"model": MODEL_NAME, "prompt": [7, 8], "ignore_eos": True})
        assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 64, short.text
        sent = http.post(C, json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 64})
        assert sent.status_code == 400 and sent.json()["error"]["param"] == "max_tokens", sent.text
        messages = [{"role": "user", "content": "a " * (MAX_MODEL_LEN - 40)}]
        count = http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages}).json()["count"]
        assert MAX_MODEL_LEN - 64 < count < MAX_MODEL_LEN, count
        chat = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, "ignore_eos": True})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - count
        assert wait_idle(http)["ok"]
