"""--reasoning-parser over HTTP, read by the official openai client: chat answers with `reasoning_content` /
`reasoning` (model_extra) beside `content`, streamed and not; tool calls after the think block (and one written
inside it that stays reasoning); reasoning_effort as a template variable; the Responses API's reasoning item,
its events and reasoning_tokens; output constraints that start once the think block ends; and a multi-turn
conversation whose template drops the earlier think block (what the prefix cache then reads).

The random model is made to write a think block by a regex (structured_outputs) with vLLM's
`--structured-outputs-config.enable_in_reasoning true`, under a Qwen3.5-style template that opens the block in
the generation prompt (and pre-fills an empty one when enable_thinking is false)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from recap.engine.async_engine import AsyncEngine
from recap.engine.llm_engine import LLMEngine
from recap.server.app import build_app
from recap.server.options import ServerOptions
from recap.server.reasoning_blob import decode
from tests.server.conftest import MODEL_NAME, ServerThread, engine_config

# Qwen3.5's shape: earlier turns' think blocks dropped, the answer's block opened (or pre-filled empty when
# enable_thinking is false) in the generation prompt; reasoning_effort shown when given.
TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% if reasoning_effort %}<|im_start|>system\neffort: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content and loop.index0 > ns.last_user %}"
    "<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
CALL = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'


def _serve(model: Path, options: ServerOptions, **cfg: Any) -> Iterator[openai.OpenAI]:
    config = engine_config(model)
    config = type(config)(**{**config.__dict__, **cfg})
    srv = ServerThread(build_app(AsyncEngine(LLMEngine(config)), options=options))
    srv.start()
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    srv.stop()


@pytest.fixture(scope="module")
def qwen(tiny_model: Path) -> Iterator[openai.OpenAI]:
    options = ServerOptions(reasoning_parser="qwen3", grammar_in_reasoning=True, tool_call_parser="hermes")
    yield from _serve(tiny_model, options, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def r1(tiny_model: Path) -> Iterator[openai.OpenAI]:
    """deepseek_r1 over the tokenizer's own template (no think tag in the prompt); constraints wait for the end."""
    yield from _serve(tiny_model, ServerOptions(reasoning_parser="deepseek_r1"))


def _forced(regex: str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": MSGS, "max_tokens": 200, "temperature": 0.0,
            "extra_body": {"structured_outputs": {"regex": regex}, **kw.pop("extra_body", {})}, **kw}


def _reasoning(obj: Any) -> str | None:
    extra = obj.model_extra or {}
    assert extra.get("reasoning") == extra.get("reasoning_content")  # vLLM's name and its earlier one
    return extra.get("reasoning_content")


def _stream(client: openai.OpenAI, body: dict[str, Any]) -> tuple[list[Any], str, str, list[Any]]:
    chunks = list(client.chat.completions.create(**body, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = "".join(_reasoning(d) or "" for d in deltas)
    said = "".join(d.content or "" for d in deltas)
    return chunks, thought, said, [tc for d in deltas for tc in d.tool_calls or []]


def test_chat_answers_carry_reasoning_beside_content(qwen: openai.OpenAI) -> None:
    body = _forced(r"Let me think\.\n</think>\n\nParis is sunny\.")
    whole = qwen.chat.completions.create(**body)
    message = whole.choices[0].message
    assert _reasoning(message) == "Let me think.\n" and message.content == "\n\nParis is sunny."
    chunks, thought, said, _ = _stream(qwen, body)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert (thought, said) == ("Let me think.\n", "\n\nParis is sunny.")
    kinds = [("r" if _reasoning(c.choices[0].delta) else "c") for c in chunks[1:]
             if c.choices and (c.choices[0].delta.content or _reasoning(c.choices[0].delta))]
    assert kinds == sorted(kinds, reverse=True) and kinds[0] == "r"  # reasoning first, then content
    assert chunks[-1].choices[0].finish_reason == "stop"
    # usage counts the think block's tokens (OpenAI's and vLLM's completion_tokens_details), streamed too
    thought = whole.usage.completion_tokens_details.reasoning_tokens
    assert 0 < thought < whole.usage.completion_tokens
    streamed = list(qwen.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.completion_tokens_details.reasoning_tokens == thought
    as_response = qwen.responses.create(model=MODEL_NAME, input=MSGS, max_output_tokens=200, temperature=0.0,
                                        extra_body=body["extra_body"])
    assert as_response.usage.output_tokens_details.reasoning_tokens == thought


def test_thinking_off_cut_short_and_empty_blocks(qwen: openai.OpenAI) -> None:
    off = qwen.chat.completions.create(**_forced(r"Hi</think>x", extra_body={
        "chat_template_kwargs": {"enable_thinking": False}}))
    assert off.choices[0].message.content == "Hi</think>x" and _reasoning(off.choices[0].message) is None
    cut = qwen.chat.completions.create(**{**_forced(r"(abc ){40}</think>Done"), "max_tokens": 6})
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content is None
    assert _reasoning(cut.choices[0].message).startswith("abc")
    empty = qwen.chat.completions.create(**_forced(r"</think>Done"))
    assert empty.choices[0].message.content == "Done" and _reasoning(empty.choices[0].message) is None
    hidden = qwen.chat.completions.create(**_forced(r"Secret\.</think>Done", extra_body={"include_reasoning": False}))
    assert hidden.choices[0].message.content == "Done" and "reasoning" not in (hidden.choices[0].message.model_extra
                                                                                 or {})


def test_tool_calls_parse_after_the_think_block_only(qwen: openai.OpenAI) -> None:
    regex = r"Maybe " + _escape(CALL) + r" later\.</think>\nChecking\.\n" + _escape(CALL)
    body = _forced(regex, tools=[TIME])
    whole = qwen.chat.completions.create(**body)
    message = whole.choices[0].message
    assert _reasoning(message) == f"Maybe {CALL} later."
    assert message.content == "\nChecking." and whole.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_time", {"tz": "UTC"})]
    chunks, thought, said, calls = _stream(qwen, body)
    assert (thought, said) == (f"Maybe {CALL} later.", "\nChecking.")
    assert [c.function.name for c in calls] == ["get_time"] and chunks[-1].choices[0].finish_reason == "tool_calls"


def _escape(text: str) -> str:
    return "".join("\\" + ch if ch in r"{}[]().*+?|\^$" else ch for ch in text)


def test_reasoning_effort_is_a_template_variable(qwen: openai.OpenAI) -> None:
    body = _forced(r"Hm\.</think>Ok")
    plain = qwen.chat.completions.create(**body)
    high = qwen.chat.completions.create(**body, reasoning_effort="high")
    assert high.usage.prompt_tokens > plain.usage.prompt_tokens  # the template showed it
    assert _reasoning(high.choices[0].message) == "Hm."
    off = qwen.chat.completions.create(**body, reasoning_effort="none")  # vLLM: enable_thinking false
    assert _reasoning(off.choices[0].message) is None and off.choices[0].message.content == "Hm.</think>Ok"
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        qwen.chat.completions.create(**_forced("x", extra_body={"reasoning_effort": "extreme"}))


def test_responses_api_reasoning_item_and_events(qwen: openai.OpenAI) -> None:
    body = {"model": MODEL_NAME, "input": "Weather in Paris?", "max_output_tokens": 200, "temperature": 0.0,
            "extra_body": {"structured_outputs": {"regex": r"Think\.</think>Sunny\."}}}
    r = qwen.responses.create(**body)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Think." and r.output[0].summary == [] and r.output_text == "Sunny."
    details = r.usage.output_tokens_details
    assert 0 < details.reasoning_tokens < r.usage.output_tokens
    events = list(qwen.responses.create(**body, stream=True))  # every event typed by the SDK
    types = [e.type for e in events]
    assert "response.reasoning_text.delta" in types and types.index("response.reasoning_text.done") < types.index(
        "response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Think."
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == "Sunny."
    assert final.usage.output_tokens_details.reasoning_tokens == details.reasoning_tokens
    with qwen.responses.stream(**body) as stream:
        assert stream.get_final_response().output[0].content[0].text == "Think."
    again = qwen.responses.create(model=MODEL_NAME, input=[*r.output, {"role": "user", "content": "And Oslo?"}],
                                  max_output_tokens=2)  # the SDK's own output items sent back
    assert again.status in ("completed", "incomplete")
    follow = qwen.responses.create(model=MODEL_NAME, previous_response_id=r.id, input="And Oslo?",
                                   max_output_tokens=2, reasoning={"effort": "low"})
    assert follow.reasoning.effort == "low"


def test_stateless_clients_carry_the_think_block_in_encrypted_content(qwen: openai.OpenAI) -> None:
    """Codex's way: `store: false`, `include: ["reasoning.encrypted_content"]`, and the next turn's input carries
    the reasoning item back as the API returned it, with no content (only the blob). The blob brings the think
    block back into the prompt (the template renders the turn's reasoning before its tool call), exactly as
    sending its content does; another server's blob gives the summary's text; a damaged one of recap's is a 400."""
    body = {"model": MODEL_NAME, "input": "Weather in Paris?", "max_output_tokens": 200, "temperature": 0.0,
            "store": False, "include": ["reasoning.encrypted_content"],
            "extra_body": {"structured_outputs": {"regex": r"Think\.</think>Sunny\."}}}
    r = qwen.responses.create(**body)
    thought = r.output[0]
    assert thought.type == "reasoning" and thought.content[0].text == "Think."
    assert thought.encrypted_content is not None and decode(thought.encrypted_content) == "Think."
    streamed = [e for e in qwen.responses.create(**body, stream=True) if e.type == "response.output_item.done"]
    assert decode(streamed[0].item.encrypted_content) == "Think."  # the stream's item carries it too
    assert qwen.responses.create(**{**body, "include": []}).output[0].encrypted_content is None  # only when asked

    def turn(reasoning: dict[str, Any]) -> int:
        call = {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": '{"tz": "UTC"}'}
        answer = {"type": "function_call_output", "call_id": "c1", "output": "12:00"}
        item = {"type": "reasoning", "id": thought.id, "summary": [], **reasoning}
        again = qwen.responses.create(model=MODEL_NAME, store=False, max_output_tokens=1,
                                      input=[{"role": "user", "content": "Weather in Paris?"}, item, call, answer])
        return again.usage.input_tokens

    blob_only = turn({"encrypted_content": thought.encrypted_content})
    assert blob_only == turn({"content": [{"type": "reasoning_text", "text": "Think."}]})
    summary = turn({"encrypted_content": "gAAAAABotherserver", "summary": [{"type": "summary_text", "text": "Think."}]})
    assert summary == blob_only
    assert turn({"encrypted_content": "gAAAAABotherserver"}) < blob_only  # no text: no think block rendered
    with pytest.raises(openai.BadRequestError, match="encrypted_content") as e:
        turn({"encrypted_content": thought.encrypted_content[:-8]})
    assert e.value.body["param"] == "input[1]"  # type: ignore[index]


def test_constraints_start_when_the_think_block_ends(r1: openai.OpenAI) -> None:
    """deepseek_r1, no tag in the prompt: the answer is reasoning until </think>, which the random model never
    writes, so json_object never starts; thinking off, it constrains the first token."""
    body = {"model": MODEL_NAME, "messages": MSGS, "max_tokens": 12, "temperature": 1.0, "seed": 7,
            "response_format": {"type": "json_object"}}
    thinking = r1.chat.completions.create(**body).choices[0].message
    assert thinking.content is None and not _reasoning(thinking).startswith("{")
    off = r1.chat.completions.create(**body, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content.startswith("{") and _reasoning(off.choices[0].message) is None


def test_multi_turn_cache_after_the_template_drops_the_think_block(qwen: openai.OpenAI) -> None:
    """The template renders an earlier turn without its think block, so the next prompt leaves the first turn's
    tokens where its answer began: the cache serves the prefix up to there (measured, reported in the PR)."""
    first = qwen.chat.completions.create(**_forced(r"Let me think about Paris and its weather at length\.</think>"
                                                   r"\n\nParis is sunny today\."))
    answer = first.choices[0].message
    turn2 = [*MSGS, {"role": "assistant", "content": answer.content, "reasoning_content": _reasoning(answer)},
             {"role": "user", "content": "And tomorrow?"}]
    second = qwen.chat.completions.create(model=MODEL_NAME, messages=turn2, max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    print(f"turn 1 prompt {first.usage.prompt_tokens} + output {first.usage.completion_tokens} tokens; turn 2 "
          f"prompt {second.usage.prompt_tokens}, cached {cached}")
    assert 0 < cached <= first.usage.prompt_tokens  # nothing past the point where the history changed
    same = qwen.chat.completions.create(model=MODEL_NAME, messages=turn2, max_tokens=2)
    assert same.usage.prompt_tokens_details.cached_tokens > cached  # the unchanged history is served whole


def test_without_a_parser_usage_is_as_before(http: Any) -> None:
    """No --reasoning-parser: no reasoning fields and no completion_tokens_details (what the server always sent)."""
    body = {"model": MODEL_NAME, "messages": MSGS, "max_tokens": 3, "temperature": 0.0}
    data = http.post("/v1/chat/completions", json=body).json()
    assert "completion_tokens_details" not in data["usage"] and "reasoning" not in data["choices"][0]["message"]
