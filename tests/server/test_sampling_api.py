"""Sampling fields and outputs over HTTP: penalties, logit_bias, seeds, echo with prompt logprobs (what
lm-eval's loglikelihood reads), prompt_logprobs, continuous usage, and the payloads of vLLM's and
guidellm's load generators replayed as they send them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.server.conftest import MODEL_NAME, wait_idle

GREEDY = {"temperature": 0.0}

# `vllm bench serve` (default openai completions backend, vllm/benchmarks/lib/endpoint_request_func.py):
# json.dumps of its payload, with ignore_eos added by --ignore-eos and the x-request-id header it sets.
VLLM_BENCH_BODY = (b'{"model": "tiny-bamba", "prompt": "The pump and the valve", "repetition_penalty": 1.0, '
                   b'"max_tokens": 8, "logprobs": null, "stream": true, "stream_options": {"include_usage": true}, '
                   b'"ignore_eos": true}')
# guidellm's streaming text-completions request (src/guidellm/backends/openai/request_handlers.py,
# TextCompletionsRequestHandler.format with a fixed output length), keys in the order it builds them.
GUIDELLM_BODY = (b'{"model": "tiny-bamba", "stream": true, '
                 b'"stream_options": {"include_usage": true, "continuous_usage_stats": true}, '
                 b'"max_tokens": 8, "stop": null, "ignore_eos": true, "prompt": "The pump and the valve"}')


def _events(r: httpx.Response) -> list[dict[str, Any]]:
    lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_vllm_bench_serve_payload(http: httpx.Client) -> None:
    r = http.post("/v1/completions", content=VLLM_BENCH_BODY,
                  headers={"Content-Type": "application/json", "x-request-id": "bench-0"})
    assert r.status_code == 200, r.text
    events = _events(r)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8


def test_guidellm_payload_gets_usage_on_every_chunk(http: httpx.Client) -> None:
    r = http.post("/v1/completions", content=GUIDELLM_BODY, headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    events = _events(r)
    token_chunks = [e for e in events if e["choices"]]
    assert token_chunks and all(e["usage"] is not None for e in token_chunks)
    counts = [e["usage"]["completion_tokens"] for e in token_chunks]
    assert counts == sorted(counts) and counts[-1] == 8
    assert events[-1]["usage"]["completion_tokens"] == 8


def test_echo_with_logprobs_is_what_lm_eval_reads(http: httpx.Client) -> None:
    ctx, cont = [11, 52, 93, 140, 7], [201, 33]
    body = {"model": MODEL_NAME, "prompt": [ctx + cont], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(ctx) + len(cont) + 1  # prompt + the one generated token
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert all(len(t) >= 1 for t in lp["top_logprobs"][1:])
    # lm-eval: sum(token_logprobs[ctxlen:-1]) is the continuation's loglikelihood; greedy iff each is the top
    cont_lp = lp["token_logprobs"][len(ctx):-1]
    assert len(cont_lp) == len(cont)
    # the same numbers as prompt_logprobs in vLLM's own shape
    r2 = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ctx + cont, "max_tokens": 1,
                                             "prompt_logprobs": 0, **GREEDY})
    plp = r2.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None
    for j, t in enumerate(cont):
        assert abs(plp[len(ctx) + j][str(t)]["logprob"] - cont_lp[j]) < 1e-4


def test_completion_top_logprobs_hold_the_chosen_token(http: httpx.Client) -> None:
    """OpenAI's legacy completions (and vLLM): each position's top_logprobs holds the chosen token as well as the
    `logprobs` best ("up to logprobs+1 elements"), so `logprobs: 0` still names the chosen token and a sampled
    token outside the top k is there too; echoed prompt tokens likewise."""
    for k in (0, 1, 2):
        body = {"model": MODEL_NAME, "prompt": [11, 52, 93], "max_tokens": 12, "temperature": 5.0, "seed": 7,
                "logprobs": k, "echo": True, "ignore_eos": True}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        for tok, v, top in list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))[1:]:
            assert tok in top and abs(top[tok] - v) < 1e-6 and 1 <= len(top) <= k + 1, (k, tok, top)
        if k == 0:
            assert all(len(top) == 1 for top in lp["top_logprobs"][1:])


def test_echo_max_tokens_zero_returns_the_prompt(http: httpx.Client) -> None:
    body = {"model": MODEL_NAME, "prompt": "Pumps and valves", "max_tokens": 0, "echo": True, "logprobs": 0}
    (choice,) = http.post("/v1/completions", json=body).json()["choices"]
    assert choice["text"] == "Pumps and valves"
    assert choice["logprobs"]["token_logprobs"][0] is None
    streamed = _events(http.post("/v1/completions", json={**body, "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in streamed if e["choices"]) == "Pumps and valves"
    plain = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Pumps", "max_tokens": 3, "echo": True,
                                                **GREEDY}).json()
    assert plain["choices"][0]["text"].startswith("Pumps") and plain["usage"]["completion_tokens"] == 3
    wait_idle(http)


def test_penalties_bias_and_seed(client: openai.OpenAI, tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    token_42 = AutoTokenizer.from_pretrained(str(tiny_model)).decode([42])
    base = client.completions.create(model=MODEL_NAME, prompt="The valve", max_tokens=8, **GREEDY)
    first = base.choices[0].text
    biased = client.completions.create(model=MODEL_NAME, prompt="The valve", max_tokens=4, logprobs=1,
                                       logit_bias={"42": 100}, **GREEDY)
    assert biased.choices[0].logprobs.tokens == [token_42] * 4
    pen = client.completions.create(model=MODEL_NAME, prompt="The valve", max_tokens=8, frequency_penalty=2.0,
                                    presence_penalty=2.0, extra_body={"repetition_penalty": 1.5}, **GREEDY)
    assert pen.choices[0].finish_reason in ("length", "stop") and first
    a = client.completions.create(model=MODEL_NAME, prompt="The valve", max_tokens=8, temperature=1.0, seed=7)
    b = client.completions.create(model=MODEL_NAME, prompt="The valve", max_tokens=8, temperature=1.0, seed=7)
    assert a.choices[0].text == b.choices[0].text
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=6, logit_bias={"42": 100}, temperature=0.0,
                                          extra_body={"min_tokens": 3, "stop_token_ids": [42]})
    # 42 is forced by the bias but banned until min_tokens are out; then it stops the choice
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == 4


def test_include_stop_str_in_output(client: openai.OpenAI) -> None:
    free = client.completions.create(model=MODEL_NAME, prompt="The valve", max_tokens=12, **GREEDY)
    text = free.choices[0].text
    stop = text[3:5]
    assert len(stop) == 2
    cut = client.completions.create(model=MODEL_NAME, prompt="The valve", max_tokens=12, stop=[stop], **GREEDY)
    kept = client.completions.create(model=MODEL_NAME, prompt="The valve", max_tokens=12, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True}, **GREEDY)
    at = text.index(stop)
    assert cut.choices[0].text == text[:at] and kept.choices[0].text == text[:at + len(stop)]
