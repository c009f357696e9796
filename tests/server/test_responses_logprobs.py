"""Output logprobs on /v1/responses (`include: ["message.output_text.logprobs"]`, `top_logprobs`), read by the
official openai client: the same list as chat's for the same greedy request, streamed deltas that join to it
(every event typed), the content's tokens only after a think block, and the bounds as 400s naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.test_reasoning_http import TEMPLATE, _serve

INCLUDE = ["message.output_text.logprobs"]
BODY: dict[str, Any] = {"model": MODEL_NAME, "temperature": 0.0, "input": "Tell me a story.", "max_output_tokens": 12}


def _plain(entries: list[Any]) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """Token, logprob and alternatives: what the Responses shapes and chat's share (deltas carry no bytes)."""
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs or []]) for e in entries]


def test_logprobs_are_the_chat_logprobs_of_the_same_request(client: openai.OpenAI) -> None:
    r = client.responses.create(**BODY, include=INCLUDE, top_logprobs=3)  # type: ignore[arg-type]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me a story."}],
                                          max_tokens=12, temperature=0.0, logprobs=True, top_logprobs=3)
    part = r.output[0].content[0]
    expected = chat.choices[0].logprobs.content
    assert part.logprobs is not None and len(part.logprobs) == r.usage.output_tokens == 12
    assert [(e.token, e.logprob, e.bytes) for e in part.logprobs] == [(e.token, e.logprob, e.bytes) for e in expected]
    assert _plain(part.logprobs) == _plain(expected)
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].bytes == list(e.top_logprobs[0].token.encode())
               for e in part.logprobs)
    assert "".join(e.token for e in part.logprobs) == part.text
    assert r.top_logprobs == 3
    bare = client.responses.create(**BODY, include=INCLUDE)  # type: ignore[arg-type]
    assert [e.top_logprobs for e in bare.output[0].content[0].logprobs] == [[]] * 12  # no alternatives asked
    assert _plain(bare.output[0].content[0].logprobs) == [(t, lp, []) for t, lp, _ in _plain(part.logprobs)]


def test_streamed_deltas_join_to_the_plain_list(client: openai.OpenAI) -> None:
    plain = client.responses.create(**BODY, include=INCLUDE, top_logprobs=2)  # type: ignore[arg-type]
    events = list(client.responses.create(**BODY, include=INCLUDE, top_logprobs=2, stream=True))  # type: ignore[arg-type]
    assert all(type(e).__module__.startswith("openai.types.responses") for e in events)  # every event typed
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    joined = [lp for e in deltas for lp in e.logprobs]
    expected = _plain(plain.output[0].content[0].logprobs)
    assert len(joined) == 12 and _plain(joined) == expected
    assert all(len(e.logprobs) >= 1 for e in deltas if e.delta)  # each piece carries its own tokens
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert _plain(done.logprobs) == expected
    (part,) = [e.part for e in events if e.type == "response.content_part.done"]
    assert _plain(part.logprobs) == expected
    final = events[-1].response
    assert final.output[0].content[0].logprobs == plain.output[0].content[0].logprobs


def test_without_include_there_are_no_logprobs(client: openai.OpenAI) -> None:
    r = client.responses.create(**BODY)
    assert r.output[0].content[0].logprobs == [] and r.top_logprobs == 0
    events = list(client.responses.create(**BODY, stream=True))
    assert all(e.logprobs == [] for e in events if e.type in ("response.output_text.delta",
                                                               "response.output_text.done"))


@pytest.mark.parametrize(("extra", "fragment", "param"), [
    ({"include": INCLUDE, "top_logprobs": 21}, "less than or equal to 20", "top_logprobs"),
    ({"include": INCLUDE, "top_logprobs": -1}, "greater than or equal to 0", "top_logprobs"),
    ({"top_logprobs": 5}, "top_logprobs needs include", "top_logprobs"),
    ({"include": [*INCLUDE, "web_search_call.results"]}, "'web_search_call.results'", "include"),
], ids=["top-21", "top-negative", "top-without-include", "include-unknown"])
def test_bounds_are_a_400_naming_the_field(http: httpx.Client, extra: dict[str, Any], fragment: str,
                                           param: str) -> None:
    r = http.post("/v1/responses", json={**BODY, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["param"] == param, error


@pytest.fixture(scope="module")
def qwen(tiny_model: Path) -> Iterator[openai.OpenAI]:
    from recap.server.options import ServerOptions

    yield from _serve(tiny_model, ServerOptions(reasoning_parser="qwen3", grammar_in_reasoning=True),
                      chat_template=TEMPLATE)


def test_after_a_think_block_only_the_content_tokens(qwen: openai.OpenAI) -> None:
    """A regex forces `Think.</think>Sunny.`: the output_text's logprobs are the tail of chat's list after the
    end tag's token, streamed and not."""
    forced = {"structured_outputs": {"regex": r"Think\.</think>Sunny\."}}
    body = {"model": MODEL_NAME, "input": "Weather in Paris?", "max_output_tokens": 40, "temperature": 0.0,
            "include": INCLUDE, "top_logprobs": 1, "extra_body": forced}
    r = qwen.responses.create(**body)
    assert [i.type for i in r.output] == ["reasoning", "message"] and r.output_text == "Sunny."
    chat = qwen.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                        max_tokens=40, temperature=0.0, logprobs=True, top_logprobs=1,
                                        extra_body=forced).choices[0].logprobs.content
    tokens = [e.token for e in chat]
    cut = next(i for i in range(len(tokens)) if "".join(tokens[:i]).endswith("</think>"))
    ours = r.output[1].content[0].logprobs
    assert 0 < cut < len(chat) and _plain(ours) == _plain(chat[cut:])
    assert "".join(e.token for e in ours).startswith("Sunny.")  # the think block's tokens are not there
    assert r.usage.output_tokens_details.reasoning_tokens + len(ours) <= r.usage.output_tokens
    events = list(qwen.responses.create(**body, stream=True))
    joined = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert _plain(joined) == _plain(ours)
