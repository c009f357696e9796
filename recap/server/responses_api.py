"""POST /v1/responses (OpenAI's Responses API, with vLLM's semantics), and GET / DELETE /v1/responses/{id}.

A request is mapped onto a chat request (recap.server.responses_api_request) and runs recap's chat path
(recap.server.chat.start_chat: rendering, sampling, tools, output constraints, admission, disconnects); the
answer comes back as a `response` object (recap.server.responses_api_objects), or streamed as its events
(recap.server.responses_api_stream). Errors the chat path raises name this API's fields (`input`,
`max_output_tokens`, `text.format`). With `store` (OpenAI's default) the response and its conversation are
kept (recap.server.response_store) for `previous_response_id`, whose follow-up renders the stored
conversation plus its own input: the prefix the previous turn ran, so its prompt is read from the cache.

An unknown or forgotten `previous_response_id` is a 400 `previous_response_not_found` naming
`previous_response_id`, as OpenAI answers (vLLM answers a 404 naming `response_id`); an unknown id on GET or
DELETE is a 404.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from recap.engine.outputs import RequestOutput
from recap.http.errors import APIError
from recap.http.sse import SSEResponse
from recap.server.chat import ChatRun, assistant_message, start_chat
from recap.server.errors import from_validation_error
from recap.server.protocol import ChatCompletionRequest, ChatMessage
from recap.server.reasoning import read_answer, reasoning_tokens
from recap.server.response_store import ResponseStore, StoredResponse
from recap.server.responses_api_logprobs import content_from, content_logprobs
from recap.server.responses_api_objects import (
    ResponseHead,
    ResponseObject,
    as_input,
    output_items,
    response_head,
    status_of,
)
from recap.server.responses_api_request import InputItem, ResponsesRequest, chat_messages
from recap.server.responses_api_stream import response_events
from recap.server.responses_input_items import item_page, listed_items
from recap.server.serving import ServerState, collect_finals, open_stream, response_size, usage

# The chat path's names for this API's fields.
_NAMES = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens",
          "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}
_CHAT_WORDS = re.compile(r"\b(response_format|max_completion_tokens|max_tokens)\b")


def renamed(err: APIError) -> APIError:
    """A chat-path error in the Responses API's names (its indexes into `messages` do not map onto `input`)."""
    head = re.match(r"[A-Za-z_]+", err.param or "")
    if err.param is not None and head is not None and head.group(0) in _NAMES:
        new = _NAMES[head.group(0)]
        if err.message.startswith(err.param):
            err.message = new + err.message[len(err.param):]
        err.param = new
    err.message = _CHAT_WORDS.sub(lambda m: _NAMES[m.group(1)], err.message)
    return err


def _previous(store: ResponseStore, rid: str | None) -> StoredResponse | None:
    if rid is None:
        return None
    entry = store.get(rid)
    if entry is None:
        raise APIError(f"Previous response with id '{rid}' not found (never stored, deleted, or forgotten: the "
                       f"server keeps the last {store.capacity}, flag --responses-store-size)",
                       param="previous_response_id", code="previous_response_not_found")
    return entry


def _chat_request(req: ResponsesRequest, history: Sequence[ChatMessage]
                  ) -> tuple[ChatCompletionRequest, list[ChatMessage]]:
    try:
        return req.chat_request(history)
    except ValidationError as e:
        raise renamed(from_validation_error(e)) from None


class _Keeper:
    """Stores a finished response with its conversation: the history, this input and this answer. `chars`: the
    conversation's size before the answer (the history's and this body's)."""

    def __init__(self, store: ResponseStore, history: StoredResponse | None, new: list[ChatMessage],
                 chars: int, items: Sequence[InputItem]) -> None:
        self.store, self.history, self.new, self.chars, self.items = store, history, new, chars, items

    def __call__(self, response: ResponseObject) -> None:
        if not response.store:
            return
        answer = chat_messages(as_input(response.output))
        before = self.history.messages if self.history is not None else ()
        chars = self.chars + sum(len(m.text()) for m in answer)
        listed = listed_items(self.items)
        self.store.put(response.id, StoredResponse(response, (*before, *self.new, *answer), chars, listed))


async def create_response(state: ServerState, store: ResponseStore, req: ResponsesRequest,
                          request: Request) -> Response:
    state.check_model(req.model)
    previous = _previous(store, req.previous_response_id)
    size = len(await request.body()) + (previous.chars if previous is not None else 0)
    history = previous.messages if previous is not None else ()
    chat, new = await state.offload.run(size, _chat_request, req, history)
    rid = store.new_id()
    try:  # the chat path under the response's id (the engine's request is `<id>-0`)
        run = await start_chat(state, chat, request, size, rid)
        head = response_head(rid, req, run.params, state.model_name, stored=req.store and store.enabled)
        keep = _Keeper(store, previous, new, size, req.input)
        if req.stream:
            first = await open_stream(request, run.it)
            if first is None:
                return Response(status_code=499)
            return SSEResponse(response_events(state, chat, run, head, first, keep))
        finals = await collect_finals(request, run.it, 1)
    except APIError as e:  # engine-side refusals too (a prompt over the context, a grammar failing at once)
        raise renamed(e) from None
    if finals is None:
        return Response(status_code=499)
    size = response_size(finals, chat.top_logprobs or 0)
    response = await state.offload.run(size, _answer, state, chat, run, head, finals[0])
    keep(response)
    return JSONResponse(response.model_dump())


def _answer(state: ServerState, chat: ChatCompletionRequest, run: ChatRun, head: ResponseHead,
            final: RequestOutput) -> ResponseObject:
    """The whole answer as a response: its reasoning, its text and the tool calls parsed or forced from it."""
    o = final.outputs[0]
    message, _ = assistant_message(state, chat, o.text, o.finish_reason, run.reasoning)
    status = status_of(o.finish_reason)
    error = (final.error or "generation failed") if status == "failed" else None
    read = None if run.reasoning is None or state.reasoning is None else read_answer(o.text, state.reasoning,
                                                                                     run.reasoning)
    thought = 0 if read is None else reasoning_tokens([state.token_text(t) for t in o.token_ids], read)
    logprobs = None if o.logprobs is None else content_logprobs(state.token_text, o.token_ids, o.logprobs,
                                                                chat.top_logprobs or 0, content_from(read))
    items = output_items(head, message.content, message.tool_calls, o.finish_reason, message.reasoning, logprobs)
    return head.snapshot(status, items, usage([final]), o.finish_reason, error, reasoning_tokens=thought)


def _not_found(rid: str) -> APIError:
    return APIError(f"Response with id '{rid}' not found.", status=404, param="response_id", code="not_found")


def _no_query(request: Request) -> None:
    """GET's `stream` / `include` replay background runs, which recap has not: refused rather than ignored."""
    for name in request.query_params:
        raise APIError(f"{name}: not supported on this endpoint (recap runs no background responses)", param=name)


async def get_response(store: ResponseStore, rid: str, request: Request) -> Response:
    _no_query(request)
    entry = store.get(rid)
    if entry is None:
        raise _not_found(rid)
    return JSONResponse(entry.response.model_dump())


async def list_input_items(store: ResponseStore, rid: str, request: Request) -> Response:
    entry = store.get(rid)
    if entry is None:
        raise _not_found(rid)
    return JSONResponse(item_page(entry.input_items, request))


async def delete_response(store: ResponseStore, rid: str, request: Request) -> Response:
    _no_query(request)
    if not store.delete(rid):
        raise _not_found(rid)
    return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})
