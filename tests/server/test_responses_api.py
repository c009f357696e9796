"""POST /v1/responses through the official openai client: plain and streamed answers (typed events, the same
text as the plain answer under greedy), instructions and multi-item input rendered as the equivalent chat,
max_output_tokens -> incomplete, text.format constraints, a function tool round trip, previous_response_id
served from the prefix cache, stored responses (GET, DELETE, store false, the LRU), client disconnects, and
bad input as a 400 naming the field."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from recap.engine.async_engine import AsyncEngine
from recap.engine.llm_engine import LLMEngine
from recap.http.response_ids import tag_of
from recap.sampling_params import SamplingParams
from recap.server.app import build_app
from recap.server.options import ServerOptions, add_http_args, server_options
from recap.server.protocol import ChatMessage
from recap.server.response_store import ResponseStore, StoredResponse
from recap.server.responses_api_objects import response_head
from recap.server.responses_api_request import ResponsesRequest
from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, ServerThread, engine_config
from tests.server.test_disconnect import _aborted, _assert_all_returned

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC"]}},
                       "required": ["tz"], "additionalProperties": False}}
GREEDY: dict[str, Any] = {"model": MODEL_NAME, "temperature": 0.0}


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    confidence: Literal["low", "high"]


def _chat_twin(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int, **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens,  # type: ignore[arg-type]
                                          temperature=0.0, **kw)


def test_plain_answer_is_the_chat_answer_of_the_same_conversation(client: openai.OpenAI) -> None:
    """instructions (a system message first) and message items of every role, with string and part content:
    the same prompt and, under greedy, the same text as chat completions of the equivalent messages."""
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a"},
                                                             {"type": "input_text", "text": "river."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "La Seine.", "annotations": []}]},
             {"role": "user", "content": "Another one?"}]
    r = client.responses.create(**GREEDY, instructions="Be brief.", input=items, max_output_tokens=12)  # type: ignore[arg-type]
    twin = _chat_twin(client, [{"role": "system", "content": "Be brief."}, {"role": "developer", "content":
                      "Answer in French."}, {"role": "user", "content": "Name a\nriver."},
                      {"role": "assistant", "content": "La Seine."}, {"role": "user", "content": "Another one?"}], 12)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL_NAME
    assert tag_of(r.id) is None  # a single server's ids name no replica
    assert r.usage is not None and r.usage.input_tokens == twin.usage.prompt_tokens
    (message,) = r.output
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert r.output_text == message.content[0].text == twin.choices[0].message.content  # the SDK's convenience
    assert r.usage.output_tokens == twin.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.instructions == "Be brief." and r.max_output_tokens == 12 and r.temperature == 0.0
    assert r.truncation == "disabled" and r.tool_choice == "auto" and r.tools == [] and r.store is True
    plain = client.responses.create(**GREEDY, input="Another one?", max_output_tokens=4)
    assert plain.usage is not None and plain.usage.input_tokens == _chat_twin(
        client, [{"role": "user", "content": "Another one?"}], 4).usage.prompt_tokens


def _events(client: openai.OpenAI, **body: Any) -> list[Any]:
    return list(client.responses.create(**body, stream=True))


def test_streamed_events_add_up_to_the_plain_answer(client: openai.OpenAI) -> None:
    """Every event parses into the SDK's typed event, numbered in order, in the Responses API's order; the
    deltas join to the plain answer's text (greedy), and the last event carries the same response."""
    body = {**GREEDY, "input": "Tell me a story.", "max_output_tokens": 24, "metadata": {"run": "a"}}
    plain = client.responses.create(**body)
    events = _events(client, **body)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # max_output_tokens cut it
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(kinds[4:-4]) > 1
    assert type(events[0]).__name__ == "ResponseCreatedEvent" and events[0].response.status == "in_progress"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-4].text
    final = events[-1].response
    assert final.id == events[0].response.id != plain.id and final.status == "incomplete" == plain.status
    assert final.output_text == text and final.output[0].id == events[2].item.id
    assert final.usage.output_tokens == 24 and final.metadata == {"run": "a"}


def test_max_output_tokens_gives_an_incomplete_response(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL_NAME, input="Count to a thousand.", max_output_tokens=5,
                                extra_body={"ignore_eos": True, "seed": 1})
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage is not None and r.usage.output_tokens == 5
    done = client.responses.create(model=MODEL_NAME, input="Say yes.", max_output_tokens=30,
                                   text={"format": {"type": "json_schema", "name": "v", "strict": True,
                                                    "schema": {**Verdict.model_json_schema(),
                                                               "additionalProperties": False}}})
    assert done.status == "completed" and done.incomplete_details is None and done.output[0].status == "completed"


def test_text_format_constrains_the_output(client: openai.OpenAI) -> None:
    """json_schema through the SDK's parse() (a pydantic model), streamed through its stream() helper, and
    json_object."""
    for seed in (1, 2):
        parsed = client.responses.parse(model=MODEL_NAME, input="Is the pump running?", text_format=Verdict,
                                        max_output_tokens=40, extra_body={"seed": seed})
        assert isinstance(parsed.output_parsed, Verdict), parsed.output_text
        assert parsed.text is not None and parsed.text.format.type == "json_schema"
    with client.responses.stream(model=MODEL_NAME, input="Is the pump running?", text_format=Verdict,
                                 max_output_tokens=40, extra_body={"seed": 3}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and isinstance(final.output_parsed, Verdict)
    obj = client.responses.create(**GREEDY, input="Describe a pump.", max_output_tokens=40,
                                  text={"format": {"type": "json_object"}})
    assert obj.output_text.startswith("{")
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


def test_function_tool_round_trip(client: openai.OpenAI) -> None:
    """A forced call comes back as a function_call item; sent back (the SDK's own output objects) with its
    function_call_output, the next turn renders as chat renders the assistant's tool call and the tool's
    answer."""
    question = {"role": "user", "content": "Weather in Oslo?"}
    r = client.responses.create(model=MODEL_NAME, input=[question], tools=[WEATHER, TIME], max_output_tokens=40,  # type: ignore[list-item]
                                tool_choice={"type": "function", "name": "get_weather"})
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.id.startswith("fc_")
    assert call.status == "completed" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    assert r.status == "completed" and r.output_text == ""
    assert r.tool_choice.type == "function" and [t.name for t in r.tools] == ["get_weather", "get_time"]  # type: ignore[union-attr]
    follow = [question, *r.output, {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}]
    again = client.responses.create(**GREEDY, input=follow, tools=[WEATHER, TIME], tool_choice="none",  # type: ignore[arg-type]
                                    max_output_tokens=6)
    assert again.output[0].type == "message"
    twin = _chat_twin(client, [question, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"}], 6,
        tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in (WEATHER, TIME)],
        tool_choice="none")
    assert again.usage is not None and again.usage.input_tokens == twin.usage.prompt_tokens
    assert again.output_text == twin.choices[0].message.content


def test_streamed_required_calls_are_function_call_items(client: openai.OpenAI) -> None:
    """tool_choice required, streamed: each call is an output item with its arguments delta and done events
    (the SDK's stream helper checks every event against the items it has seen), and the last event's response
    holds the plain answer's calls."""
    body = {"model": MODEL_NAME, "input": "Weather and time?", "tools": [WEATHER, TIME], "tool_choice": "required",
            "max_output_tokens": 120, "temperature": 1.0, "extra_body": {"seed": 13}}
    plain = client.responses.create(**body)
    calls = [(o.name, json.loads(o.arguments)) for o in plain.output]
    assert len(calls) >= 2 and {o.type for o in plain.output} == {"function_call"}  # several calls in 120 tokens
    with client.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()  # the SDK's own accumulation of the events
    per_call = ["response.output_item.added", "response.function_call_arguments.delta",
                "response.function_call_arguments.done", "response.output_item.done"]
    assert [e.type for e in events[2:-1]] == per_call * len(calls)
    assert events[-1].type == "response.completed" and plain.status == "completed"
    assert [(o.name, json.loads(o.arguments)) for o in final.output] == calls
    done = [e.item.call_id for e in events if e.type == "response.output_item.done"]
    assert done == [o.call_id for o in final.output]


def test_auto_calls_after_text_stream_as_a_message_then_calls(hermes_client: openai.OpenAI) -> None:
    """tool_choice auto: text, then two Hermes calls (a regex makes the random model write them). The plain
    answer is a message and two function_call items; streamed, the message closes before the first call."""
    regex = (r'Sure\.\n<tool_call>\{"name": "get_time", "arguments": \{"tz": "UTC"\}\}</tool_call>\n'
             r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"\}\}</tool_call>')
    body = {**GREEDY, "input": "Time and weather?", "tools": [WEATHER, TIME], "max_output_tokens": 400,
            "extra_body": {"structured_outputs": {"regex": regex}}}
    plain = hermes_client.responses.create(**body)
    assert [o.type for o in plain.output] == ["message", "function_call", "function_call"]
    assert plain.output_text == "Sure." and plain.status == "completed"
    with hermes_client.responses.stream(**body) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    first_call = kinds.index("response.function_call_arguments.delta")
    assert kinds.index("response.output_item.done") < first_call and kinds[-1] == "response.completed"
    assert final.output_text == "Sure." and [o.type for o in final.output] == [o.type for o in plain.output]
    assert [(o.name, o.arguments) for o in final.output[1:]] == [(o.name, o.arguments) for o in plain.output[1:]]


def test_previous_response_id_continues_from_the_cache(client: openai.OpenAI) -> None:
    """A follow-up renders the stored conversation plus its input: the chat of the same turns, whose shared
    prefix comes from the prefix cache. Instructions are not carried over (OpenAI's rule): a follow-up without
    them renders the conversation alone. GET returns the stored response."""
    system = {"role": "system", "content": "You are terse."}
    ask = {"role": "user", "content": "List three valves of the primary cooling loop, with their roles."}
    first = client.responses.create(**GREEDY, instructions=system["content"], input=ask["content"],
                                    max_output_tokens=8)
    follow = client.responses.create(**GREEDY, instructions=system["content"], previous_response_id=first.id,
                                     input="And the pumps?", max_output_tokens=8)
    assert follow.previous_response_id == first.id and first.usage is not None and follow.usage is not None
    assert follow.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt, from the cache
    turns = [ask, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And the pumps?"}]
    twin = _chat_twin(client, [system, *turns], 8)
    assert follow.usage.input_tokens == twin.usage.prompt_tokens
    assert follow.output_text == twin.choices[0].message.content
    third = client.responses.create(**GREEDY, previous_response_id=follow.id, input="Thanks.", max_output_tokens=4)
    bare = _chat_twin(client, [*turns, {"role": "assistant", "content": follow.output_text},
                               {"role": "user", "content": "Thanks."}], 4)
    assert third.instructions is None and third.usage is not None
    assert third.usage.input_tokens == bare.usage.prompt_tokens and third.output_text == bare.choices[0].message.content
    stored = client.responses.retrieve(first.id)
    assert stored.model_dump() == first.model_dump()


def test_output_sent_back_as_input_is_the_stored_conversation(client: openai.OpenAI, http: httpx.Client) -> None:
    """The SDK's own output objects sent back as input render as the stored conversation does; a last
    assistant message that is incomplete is continued, not answered (vLLM's rule), as chat's
    continue_final_message continues it."""
    ask = {"role": "user", "content": "Name the pumps."}
    first = client.responses.create(**GREEDY, input=[ask], max_output_tokens=6)  # type: ignore[list-item]
    assert first.status == "incomplete" and first.output[0].status == "incomplete"
    more = {"role": "user", "content": "More."}
    stateless = client.responses.create(**GREEDY, input=[ask, *first.output, more], max_output_tokens=4)  # type: ignore[list-item]
    stored = client.responses.create(**GREEDY, previous_response_id=first.id, input=[more], max_output_tokens=4)  # type: ignore[list-item]
    assert stateless.usage is not None and stored.usage is not None
    assert stateless.usage.input_tokens == stored.usage.input_tokens and stateless.output_text == stored.output_text
    go_on = client.responses.create(**GREEDY, input=[ask, *first.output], max_output_tokens=4)  # type: ignore[list-item]
    twin = http.post("/v1/chat/completions", json={
        **GREEDY, "max_tokens": 4, "add_generation_prompt": False, "continue_final_message": True,
        "messages": [ask, {"role": "assistant", "content": first.output_text}]}).json()
    assert go_on.usage is not None and go_on.usage.input_tokens == twin["usage"]["prompt_tokens"]
    assert go_on.output_text == twin["choices"][0]["message"]["content"]


def test_store_false_keeps_nothing_and_delete_forgets(client: openai.OpenAI, http: httpx.Client) -> None:
    r = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2, previous_response_id=r.id)
    assert err.value.code == "previous_response_not_found" and err.value.param == "previous_response_id"
    kept = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2)
    assert http.get(f"/v1/responses/{kept.id}", params={"stream": "true"}).status_code == 400
    assert http.delete(f"/v1/responses/{kept.id}").json() == {"id": kept.id, "object": "response.deleted",
                                                              "deleted": True}
    assert http.get(f"/v1/responses/{kept.id}").status_code == 404
    assert http.delete(f"/v1/responses/{kept.id}").status_code == 404


def test_input_items_list_what_a_stored_response_was_made_from(client: openai.OpenAI, http: httpx.Client) -> None:
    """The official client's `responses.input_items.list`: this request's input items with ids (the client's kept),
    newest first by default, paged by `limit` and `after` (the SDK follows `has_more` itself), `order` asc; a
    follow-up lists its own input only; bad queries are a 400 naming the field; unknown or unstored ids a 404."""
    items = [{"type": "message", "id": "msg_mine", "role": "user", "content": "Name a valve."},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "The gate."}]},
             {"type": "message", "role": "user", "content": "And another?"}]
    r = client.responses.create(model=MODEL_NAME, input=items, max_output_tokens=2)
    listed = client.responses.input_items.list(r.id)
    assert [i.role for i in listed.data] == ["user", "assistant", "user"][::-1]  # desc: newest first
    assert listed.data[-1].id == "msg_mine" and all(i.id.startswith("msg_") for i in listed.data)
    assert [c.text for i in listed.data for c in i.content] == ["And another?", "The gate.", "Name a valve."]
    assert listed.first_id == listed.data[0].id and listed.last_id == "msg_mine" and not listed.has_more
    page = client.responses.input_items.list(r.id, limit=2, order="asc")
    assert [i.id for i in page.data][0] == "msg_mine" and page.has_more
    assert [i.id for i in page] == [i.id for i in listed.data][::-1]  # auto-paging follows `after`
    again = client.responses.input_items.list(r.id)
    assert [i.id for i in again.data] == [i.id for i in listed.data]  # ids assigned once, when stored
    follow = client.responses.create(model=MODEL_NAME, input="Thanks.", max_output_tokens=2,
                                     previous_response_id=r.id)
    (only,) = client.responses.input_items.list(follow.id).data
    assert only.role == "user" and only.content[0].type == "input_text" and only.content[0].text == "Thanks."
    base = f"/v1/responses/{r.id}/input_items"
    for query, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"limit": "x"}, "limit"),
                         ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after"),
                         ({"include": "message.output_text.logprobs"}, "include")):
        bad = http.get(base, params=query)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (query, bad.text)
    assert http.get("/v1/responses/resp_missing/input_items").status_code == 404
    unstored = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(unstored.id)


def _stored(rid: str) -> StoredResponse:
    req = ResponsesRequest.model_validate({"input": rid})
    response = response_head(rid, req, SamplingParams(), MODEL_NAME, stored=True).snapshot("completed")
    return StoredResponse(response, (ChatMessage(role="user", content=rid),), len(rid))


def test_the_store_forgets_the_least_recently_used() -> None:
    store = ResponseStore(capacity=2)
    for rid in ("a", "b"):
        store.put(rid, _stored(rid))
    assert store.get("a") is not None  # now the most recent: b goes first
    store.put("c", _stored("c"))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert len(store) == 2 and store.delete("a") and not store.delete("a")
    off = ResponseStore(capacity=0)
    off.put("a", _stored("a"))
    assert not off.enabled and len(off) == 0


def test_the_store_size_flag() -> None:
    parser = argparse.ArgumentParser()
    add_http_args(parser)
    assert server_options(parser.parse_args([])).responses_store_size == 1000
    assert server_options(parser.parse_args(["--responses-store-size", "0"])).responses_store_size == 0
    with pytest.raises(SystemExit):
        server_options(parser.parse_args(["--responses-store-size", "-1"]))


def test_a_server_that_stores_nothing_says_so(tiny_model: Path) -> None:
    srv = ServerThread(build_app(AsyncEngine(LLMEngine(engine_config(tiny_model))),
                                 options=ServerOptions(responses_store_size=0)))
    srv.start()
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2)
        assert r.store is False
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r.id)
    finally:
        srv.stop()


def test_a_stream_closed_early_aborts(http: httpx.Client, server: Any) -> None:
    aborted = _aborted(http)
    body = {"model": MODEL_NAME, "input": "Tell me everything.", "max_output_tokens": 1000, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as h, h.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        deltas = 0
        for line in r.iter_lines():
            deltas += line == "event: response.output_text.delta"
            if deltas == 3:
                break
    _assert_all_returned(http)
    assert _aborted(http) == aborted + 1


OK: dict[str, Any] = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2}


def _with(**kw: Any) -> dict[str, Any]:
    return {**OK, **kw}


# (id, body, fragment of the message, param)
BAD: list[tuple[str, dict[str, Any], str, str]] = [
    ("unknown-field", _with(frequency=1), "Unsupported field(s): frequency", "frequency"),
    ("chat-field", _with(messages=[]), "Unsupported field(s): messages", "messages"),
    ("input-type", _with(input=5), "must be a string or a list of input items", "input"),
    ("input-empty", _with(input=[]), "must not be empty", "input"),
    ("item-type", _with(input=[{"type": "item_reference", "id": "x"}]), "type 'item_reference' is not supported",
     "input[0]"),
    ("reasoning-blob-damaged", _with(input=[{"type": "reasoning", "summary": [],
                                             "encrypted_content": "recap-reasoning-v1.eJzLSM3JyQcABiwCFQ"}]),
     "encrypted_content: not a reasoning blob recap wrote", "input[0]"),
    ("item-stray-field", _with(input=[{"role": "user", "content": "x", "call_id": "c"}]),
     "call_id: not a field of a message item", "input[0]"),
    ("call-missing-fields", _with(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]),
     "needs call_id", "input[0]"),
    ("part-type", _with(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "type 'input_image' is not supported (recap takes input_text, output_text, reasoning_text parts",
     "input[0].content[0]"),
    ("role", _with(input=[{"role": "tool", "content": "x"}]), "Input should be 'user'", "input[0].role"),
    ("max-output-tokens-type", _with(max_output_tokens="8"), "valid integer", "max_output_tokens"),
    ("max-output-tokens-zero", _with(max_output_tokens=0), "at least 1", "max_output_tokens"),
    ("max-output-tokens-huge", _with(max_output_tokens=10**9), f"maximum context length is {MAX_MODEL_LEN}",
     "max_output_tokens"),
    ("input-too-long", _with(input="word " * (MAX_MODEL_LEN * 2)), "maximum context length", "input"),
    ("temperature", _with(temperature="hot"), "valid number", "temperature"),
    ("negative-temperature", _with(temperature=-1), "temperature must be >= 0", "temperature"),
    ("unknown-previous", _with(previous_response_id="resp_nope"), "'resp_nope' not found", "previous_response_id"),
    ("reasoning-effort", _with(reasoning={"effort": "extreme"}), "Input should be 'none'", "reasoning.effort"),
    ("reasoning-summary", _with(reasoning={"summary": "detailed"}), "Input should be 'auto'", "reasoning.summary"),
    ("truncation-auto", _with(truncation="auto"), 'only "disabled"', "truncation"),
    ("background", _with(background=True), "background is not supported", "background"),
    ("include", _with(include=["file_search_call.results"]), "'file_search_call.results' is not supported",
     "include"),
    ("schema-missing", _with(text={"format": {"type": "json_schema", "name": "x"}}), "needs name and schema",
     "text.format"),
    ("bad-schema", _with(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}),
     "text.format", "text.format"),
    ("tool-chat-shape", _with(tools=[{"type": "function", "function": {"name": "f"}}]), "tools[0].function",
     "tools[0].function"),
    ("tool-name", _with(tools=[{"type": "function", "name": "a b"}]), "should match pattern", "tools[0].name"),
    ("tool-choice-unknown", _with(tools=[WEATHER], tool_choice={"type": "function", "name": "nope"}),
     "no tool named 'nope'", "tool_choice"),
    ("tool-choice-auto-no-parser", _with(tools=[WEATHER]), "needs a tool call parser", "tool_choice"),
    ("forced-and-format", _with(tools=[WEATHER], tool_choice="required", text={"format": {"type": "json_object"}}),
     "cannot be combined", "tool_choice"),
    ("metadata", _with(metadata={str(i): "v" for i in range(17)}), "at most 16 pairs", "metadata"),
    ("obfuscation", _with(stream=True, stream_options={"include_obfuscation": True}), "include_obfuscation",
     "stream_options"),
]


@pytest.mark.parametrize(("body", "fragment", "param"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_is_a_400_naming_the_field(http: httpx.Client, body: dict[str, Any], fragment: str,
                                             param: str) -> None:
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_fields_at_their_no_op_values_are_accepted(http: httpx.Client) -> None:
    body = _with(reasoning={"effort": None}, truncation="disabled", background=False, include=[], top_logprobs=0,
                 service_tier="auto", parallel_tool_calls=True, text={"format": {"type": "text"}, "verbosity": None},
                 user="u1", safety_identifier="s1", prompt_cache_key="k", store=None, top_p=None, stop=["\n\n"],
                 top_k=5, repetition_penalty=1.1, cache_salt="tenant-a")
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["store"] is True and out["top_p"] == 1.0 and out["user"] == "u1" and out["text"] == {
        "format": {"type": "text"}}


def test_debug_memory_counts_the_store(client: openai.OpenAI, http: httpx.Client) -> None:
    before = http.get("/debug/memory").json()["bounded"]["responses_store"]
    client.responses.create(model=MODEL_NAME, input="Count me.", max_output_tokens=2)
    after = http.get("/debug/memory").json()["bounded"]["responses_store"]
    assert after["capacity"] == before["capacity"] > 0
    assert after["count"] == min(before["count"] + 1, after["capacity"])
