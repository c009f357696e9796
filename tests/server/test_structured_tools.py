"""Structured output and tools over HTTP, through the official openai client: response_format json_schema
and json_object, guided_* and structured_outputs extras, tool_choice named / required / none, tool
messages; the tool-call parsers of the model families recap serves (Hermes/Qwen, Granite, Nemotron); streamed
tool calls, one delta per call as each completes, accumulated by openai's own stream helpers."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import BaseModel

from recap.server.tools import ToolSpec, detect_parser, parse_tool_calls
from tests.server.conftest import MODEL_NAME

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC"]}},
                                       "required": ["tz"], "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    confidence: Literal["low", "high"]


def test_openai_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    for seed in (1, 2):
        done = client.chat.completions.parse(model=MODEL_NAME, messages=MSGS, response_format=Verdict,
                                             max_tokens=40, temperature=1.0, seed=seed)
        parsed = done.choices[0].message.parsed
        assert isinstance(parsed, Verdict), done.choices[0].message.content


def test_json_object_and_extras(client: openai.OpenAI, http: httpx.Client) -> None:
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=40, temperature=0.0,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    body = {"model": MODEL_NAME, "prompt": "Code:", "max_tokens": 20, "temperature": 1.0, "seed": 4}
    regex = http.post("/v1/completions", json={**body, "guided_regex": r"[A-Z]{2}-[0-9]{3}"}).json()
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", regex["choices"][0]["text"])
    choice = http.post("/v1/completions", json={**body, "structured_outputs": {"choice": ["alpha", "beta"]}}).json()
    assert choice["choices"][0]["text"] in ("alpha", "beta")
    guided = client.completions.create(model=MODEL_NAME, prompt="Pick:", max_tokens=10,
                                       extra_body={"guided_choice": ["left", "right"]})
    assert guided.choices[0].text in ("left", "right")
    schema = {**Verdict.model_json_schema(), "additionalProperties": False}  # else any extra key may follow
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL_NAME, messages=MSGS, max_tokens=40, stream=True, temperature=1.0, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": schema}})
        if c.choices)
    assert Verdict.model_validate_json(streamed)


def test_named_and_required_tool_calls(client: openai.OpenAI) -> None:
    named = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, tools=[WEATHER, TIME], max_tokens=40,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and named.choices[0].finish_reason == "tool_calls"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    required = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, tools=[WEATHER, TIME],
                                              tool_choice="required", max_tokens=80, temperature=1.0, seed=5,
                                              parallel_tool_calls=False)
    calls = required.choices[0].message.tool_calls
    assert len(calls) == 1 and all(c.function.name in ("get_weather", "get_time") for c in calls)
    assert all(isinstance(json.loads(c.function.arguments), dict) for c in calls)
    none = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, tools=[WEATHER], tool_choice="none",
                                          max_tokens=5)
    assert not none.choices[0].message.tool_calls and none.choices[0].message.content is not None
    # the call and its result go back into the conversation
    follow = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
              {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    again = client.chat.completions.create(model=MODEL_NAME, messages=follow, tools=[WEATHER], tool_choice="none",
                                           max_tokens=5)
    assert again.usage.prompt_tokens > none.usage.prompt_tokens
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MSGS, tools=[WEATHER], max_tokens=40,
                                                 tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                 stream=True))
    streamed_calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in streamed_calls] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def _calls(message: object) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]  # type: ignore[attr-defined]


def test_streamed_forced_calls_accumulate_to_the_whole_answer(client: openai.OpenAI) -> None:
    """tool_choice required with parallel calls: streamed, each call is its own delta (index, id, type, name,
    arguments) and openai's own accumulator rebuilds the calls of the answer that is not streamed."""
    body = {"model": MODEL_NAME, "messages": MSGS, "tools": [WEATHER, TIME], "tool_choice": "required",
            "max_tokens": 120, "temperature": 1.0, "seed": 3}
    whole = client.chat.completions.create(**body)
    assert len(whole.choices[0].message.tool_calls) >= 2  # the seed writes several calls before max_tokens
    state = ChatCompletionStreamState(input_tools=[WEATHER, TIME])
    call_chunks = []
    for chunk in client.chat.completions.create(**body, stream=True):
        state.handle_chunk(chunk)
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            assert tc.id and tc.type == "function" and tc.function.name
            assert isinstance(json.loads(tc.function.arguments), dict)
            call_chunks.append((tc.index, chunk.choices[0].finish_reason))
    streamed = state.current_completion_snapshot.choices[0]
    assert _calls(streamed.message) == _calls(whole.choices[0].message)
    assert streamed.finish_reason == whole.choices[0].finish_reason
    assert [i for i, _ in call_chunks] == list(range(len(call_chunks)))
    assert call_chunks[0][1] is None  # the first call went out before the answer ended


def test_streamed_auto_tool_calls_go_out_as_each_completes(hermes_client: openai.OpenAI) -> None:
    """tool_choice auto: content, then two Hermes calls; a regex makes the random model write them. Streamed,
    the content comes first, then each call in its own delta as its text completes; openai's
    chat.completions.stream() accumulates the same message as the answer that is not streamed."""
    regex = (r'Sure\.\n<tool_call>\{"name": "get_time", "arguments": \{"tz": "UTC"\}\}</tool_call>\n'
             r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", "unit": "C"\}\}</tool_call>')
    body = {"model": MODEL_NAME, "messages": MSGS, "tools": [WEATHER, TIME], "max_tokens": 400, "temperature": 0.0,
            "extra_body": {"structured_outputs": {"regex": regex}}}
    whole = hermes_client.chat.completions.create(**body)
    assert whole.choices[0].message.content == "Sure." and whole.choices[0].finish_reason == "tool_calls"
    assert [name for name, _ in _calls(whole.choices[0].message)] == ["get_time", "get_weather"]
    chunks = list(hermes_client.chat.completions.create(**body, stream=True))
    kinds = []  # what each chunk carries, in order
    for chunk in chunks:
        delta = chunk.choices[0].delta
        if delta.content:
            kinds.append("content")
        kinds += [f"call{tc.index}" for tc in delta.tool_calls or []]
        if delta.tool_calls:
            assert len(delta.tool_calls) == 1  # one call per chunk: released as each completes
    assert kinds[-2:] == ["call0", "call1"] and set(kinds[:-2]) == {"content"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    (call0,) = [c for c in chunks if c.choices[0].delta.tool_calls and c.choices[0].delta.tool_calls[0].index == 0]
    assert call0.choices[0].finish_reason is None  # out before the answer ended
    with hermes_client.chat.completions.stream(**body) as stream:
        events = [(e.type, getattr(e, "index", None)) for e in stream if e.type.startswith("tool_calls")]
        final = stream.get_final_completion().choices[0]
    assert events[:2] == [("tool_calls.function.arguments.delta", 0), ("tool_calls.function.arguments.delta", 1)]
    assert final.message.content == "Sure." and final.finish_reason == "tool_calls"
    assert _calls(final.message) == _calls(whole.choices[0].message)


SPECS = [ToolSpec.model_validate(WEATHER), ToolSpec.model_validate(TIME)]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), [
    ("hermes", 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>',
     "Sure.", [("get_weather", {"city": "Oslo", "unit": "C"})]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>\n<tool_call>'
     '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "F"}}</tool_call>', None,
     [("get_time", {"tz": "UTC"}), ("get_weather", {"city": "Paris", "unit": "F"})]),
    ("granite", '<|tool_call|>[{"name": "get_time", "arguments": {"tz": "UTC"}}]', None,
     [("get_time", {"tz": "UTC"})]),
    ("nemotron", '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}]</TOOLCALL>', None,
     [("get_weather", {"city": "Oslo", "unit": "C"})]),
    ("qwen3_xml", 'Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n'
     '<parameter=unit>\nC\n</parameter>\n</function>\n</tool_call>', "Checking.",
     [("get_weather", {"city": "Oslo", "unit": "C"})]),
    ("qwen3_xml", '<tool_call>\n<function=get_time>\n<parameter=tz>\n"UTC"\n</parameter>\n</function>\n</tool_call>',
     None, [("get_time", {"tz": "UTC"})]),
    ("hermes", "No tools needed.", "No tools needed.", []),
    ("hermes", '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>', []),
    ("granite", "<|tool_call|>[{broken", "<|tool_call|>[{broken", []),
])
def test_tool_call_parsers(parser: str, text: str, content: str | None, calls: list) -> None:
    got_content, got = parse_tool_calls(text, parser, SPECS)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == calls
    assert [c.index for c in got] == list(range(len(got)))


def test_parser_detection() -> None:
    assert detect_parser("{% if tools %}<tool_call>{{ x }}</tool_call>{% endif %}") == "hermes"
    assert detect_parser("<|start_of_role|>...<|tool_call|>") == "granite"
    assert detect_parser("<TOOLCALL>[...]</TOOLCALL>") == "nemotron"
    assert detect_parser("<tool_call>\n<function={{ tool_call.name }}>") == "qwen3_xml"
    assert detect_parser("{{ messages }}") is None and detect_parser(None) is None
