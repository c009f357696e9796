"""The OpenAI surface through the official client: completions, chat, streaming, usage, caching, metrics."""

from __future__ import annotations

import logging
import random

import httpx
import openai
import pytest

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, metric, wait_idle

GREEDY = {"temperature": 0.0}
SYSTEM = ("You are a careful assistant. Answer briefly, cite the manual, and never invent numbers. "
          "The manual covers pumps, valves, filters and the maintenance schedule of the plant.")


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


def test_models_and_health(client: openai.OpenAI, http: httpx.Client) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert http.get("/health").json() == {"status": "ok"}


def test_completion_plain_and_streamed_agree(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL_NAME, prompt="The pump", max_tokens=12, **GREEDY)
    (choice,) = plain.choices
    assert plain.object == "text_completion" and choice.index == 0
    assert choice.finish_reason in ("length", "stop") and choice.text
    u = plain.usage
    assert u.completion_tokens <= 12 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="The pump", max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason


def test_token_id_prompt_and_batch_ordering(client: openai.OpenAI) -> None:
    a, b = ids(1, 20), ids(2, 30)
    single = client.completions.create(model=MODEL_NAME, prompt=a, max_tokens=6, **GREEDY)
    batch = client.completions.create(model=MODEL_NAME, prompt=[a, b], max_tokens=6, n=2, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    # greedy: both samples of a prompt are the same text, and prompt 0 equals the single request
    assert batch.choices[0].text == batch.choices[1].text == single.choices[0].text
    assert batch.usage.prompt_tokens == len(a) + len(b)
    assert batch.usage.total_tokens == batch.usage.prompt_tokens + batch.usage.completion_tokens
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=[a, b], max_tokens=6, n=2, stream=True,
                                              **GREEDY))
    texts = {i: "".join(ch.text for c in streamed for ch in c.choices if ch.index == i) for i in range(4)}
    assert texts == {c.index: c.text for c in batch.choices}


def test_chat_plain_and_streamed_agree(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which valve first?"}]
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, **GREEDY)
    msg = plain.choices[0].message
    assert msg.role == "assistant" and plain.object == "chat.completion"
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=10,
                                            stream=True, stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_second_chat_turn_hits_the_cache_and_metrics_move(client: openai.OpenAI, http: httpx.Client) -> None:
    wait_idle(http)
    hits0, queries0 = metric(http, "recap:prefix_cache_hits_total"), metric(http, "recap:prefix_cache_queries_total")
    ttft0 = metric(http, "recap:time_to_first_token_seconds_count")
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the filters, please."}]
    first = client.chat.completions.create(model=MODEL_NAME, messages=turn1, max_tokens=8,
                                           extra_body={"cache_salt": "second-turn"}, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = [*turn1, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And the pumps?"}]
    second = client.chat.completions.create(model=MODEL_NAME, messages=turn2, max_tokens=8,
                                            extra_body={"cache_salt": "second-turn"}, **GREEDY)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached % 16 == 0
    # another tenant sees none of it
    other = client.chat.completions.create(model=MODEL_NAME, messages=turn2, max_tokens=8,
                                           extra_body={"cache_salt": "someone-else"}, **GREEDY)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.choices[0].message.content == second.choices[0].message.content
    wait_idle(http)
    assert metric(http, "recap:prefix_cache_hits_total") - hits0 == cached
    assert metric(http, "recap:prefix_cache_queries_total") - queries0 >= 3 * first.usage.prompt_tokens
    assert metric(http, "recap:time_to_first_token_seconds_count") - ttft0 == 3
    assert metric(http, "recap:checkpoints") > 0 and metric(http, "recap:checkpoint_bytes") > 0
    assert metric(http, "recap:num_requests_running") == 0


def test_explicit_boundaries_give_hits_where_messages_do_not(client: openai.OpenAI) -> None:
    """A `checkpoints` offset / a cache_control part inside one message makes the shared part hit."""
    shared, tail1, tail2 = ids(10, 70), ids(11, 30), ids(12, 30)
    for salt, marks in (("ckpt-on", [len(shared)]), ("ckpt-off", None)):
        extra = {"cache_salt": salt, **({"checkpoints": marks} if marks else {})}
        client.completions.create(model=MODEL_NAME, prompt=shared + tail1, max_tokens=2, extra_body=extra, **GREEDY)
        again = client.completions.create(model=MODEL_NAME, prompt=shared + tail2, max_tokens=2,
                                          extra_body={"cache_salt": salt}, **GREEDY)
        want = len(shared) // 16 * 16 if marks else 0
        assert again.usage.prompt_tokens_details.cached_tokens == want, salt
    part = "Pumps, valves and filters are inspected weekly; the log lists each inspection by date. " * 2
    for salt, marker in (("cc-on", {"type": "ephemeral"}), ("cc-off", None)):
        cc = {"cache_control": marker} if marker else {}

        def msgs(question: str, cc: dict = cc) -> list[dict]:
            parts = [{"type": "text", "text": part, **cc}, {"type": "text", "text": question}]
            return [{"role": "user", "content": parts}]

        client.chat.completions.create(model=MODEL_NAME, messages=msgs("When is the next one?"), max_tokens=2,
                                       extra_body={"cache_salt": salt}, **GREEDY)
        again = client.chat.completions.create(model=MODEL_NAME, messages=msgs("Who signs the log?"), max_tokens=2,
                                               extra_body={"cache_salt": salt}, **GREEDY)
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert (cached >= 32) if marker else (cached == 0), (salt, cached)


def test_logprobs(client: openai.OpenAI) -> None:
    c = client.completions.create(model=MODEL_NAME, prompt="Valves", max_tokens=5, logprobs=3, **GREEDY)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens
    assert all(len(t) <= 3 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset[0] == 0
    # greedy: the sampled token is the best one
    assert all(abs(max(t.values()) - v) < 1e-4 for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    ch = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                        max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY)
    content = ch.choices[0].logprobs.content
    assert len(content) == ch.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in content)


def test_same_seed_same_text(client: openai.OpenAI) -> None:
    kw = {"model": MODEL_NAME, "prompt": "Filters", "max_tokens": 8, "temperature": 0.8, "seed": 7, "top_p": 0.9}
    a = client.completions.create(**kw, extra_body={"top_k": 20, "min_p": 0.01}, user="tester")
    b = client.completions.create(**kw, extra_body={"top_k": 20, "min_p": 0.01}, user="tester")
    assert a.choices[0].text == b.choices[0].text


def test_sampling_fields_are_honoured(client: openai.OpenAI) -> None:
    sampled = client.completions.create(model=MODEL_NAME, prompt="Filters", max_tokens=8, temperature=0.8, seed=7,
                                        top_p=0.9, extra_body={"top_k": 20, "min_p": 0.01}, user="tester")
    assert sampled.usage.completion_tokens >= 1
    full = client.completions.create(model=MODEL_NAME, prompt="Filters", max_tokens=8, **GREEDY,
                                     extra_body={"ignore_eos": True, "min_tokens": 8})
    assert full.usage.completion_tokens == 8 and full.choices[0].finish_reason == "length"
    text = full.choices[0].text
    assert len(text) >= 5
    stop = text[3:5]
    stopped = client.completions.create(model=MODEL_NAME, prompt="Filters", max_tokens=8, stop=[stop, "\x00"],
                                        extra_body={"ignore_eos": True}, **GREEDY)
    assert stopped.choices[0].text == text[: text.index(stop)] and stopped.choices[0].finish_reason == "stop"


def test_metrics_names(http: httpx.Client) -> None:
    names = ["recap:prefix_cache_queries_total", "recap:prefix_cache_hits_total", "recap:checkpoints",
             "recap:checkpoint_bytes", "recap:checkpoint_evictions_total", "recap:checkpoint_miss_tokens_total",
             "recap:time_to_first_token_seconds_sum", "recap:num_requests_running", "recap:num_requests_waiting",
             "recap:prompt_tokens_total", "recap:generation_tokens_total", "recap:request_success_total"]
    for name in names:
        assert metric(http, name) >= 0
    assert 'recap:cache_config_info{block_size="16",checkpoint_policy="recap"' in http.get("/metrics").text


def test_chat_n_and_one_log_line_per_request(client: openai.OpenAI, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="recap.server"):
        r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Two?"}],
                                           max_tokens=4, n=2, user="alice", **GREEDY)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content
    assert r.usage.completion_tokens <= 8
    lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith(f"request {r.id}")]
    assert len(lines) == 1
    for field in (f"prompt_tokens={r.usage.prompt_tokens} ", "cached_tokens=", f"completion_tokens="
                  f"{r.usage.completion_tokens} ", "finish=", "ttft=", "latency=", "user='alice'"):
        assert field in lines[0], lines[0]
