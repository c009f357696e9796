"""POST /v1/chat/completions: the chat template renders the messages; message ends and
`cache_control` markers become segment boundaries (DESIGN §4)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, replace

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from recap.engine.outputs import RequestOutput
from recap.http.errors import APIError
from recap.http.guard import reserve_sequences
from recap.http.sse import SSE_DONE, SSEResponse, sse
from recap.sampling_params import SamplingParams
from recap.server.answer_stream import AnswerStream
from recap.server.chat_prompt import TemplateInputs
from recap.server.errors import sse_error
from recap.server.logprobs import chat_logprobs, prompt_logprobs_out
from recap.server.protocol import ChatCompletionRequest
from recap.server.reasoning import Opening, ReasoningStream, answer_reasoning_tokens, opening, split_reasoning
from recap.server.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionTokensDetails,
    Usage,
)
from recap.server.serving import (
    RequestLog,
    ServerState,
    collect_finals,
    merged,
    new_request_id,
    open_stream,
    prepare_all,
    response_size,
    sampling_params,
    usage,
)
from recap.server.template_sandbox import refuse_untrusted
from recap.server.tool_stream import ToolCallStream
from recap.server.tools import forced_calls, parse_tool_calls
from recap.server.transfer_params import attach_transfer, with_transfer_params


@dataclass
class ChatRun:
    """A chat request handed to the engine: its id, its sampling, the stream its answer comes from (closing
    the stream aborts it) and where its answer starts for the reasoning parser (None: no parser)."""

    rid: str
    params: SamplingParams
    it: AsyncGenerator[tuple[int, RequestOutput], None]
    reasoning: Opening | None = None


async def start_chat(
    state: ServerState, req: ChatCompletionRequest, request: Request, size: int, rid: str
) -> ChatRun:
    """Render, tokenize, admit and start a chat request (what /v1/chat/completions and /v1/responses share).
    `size`: the characters its messages, tools and grammars cost (whether the work runs off the event loop)."""
    params = await sampling_params(state, req, size)
    choice = req.effective_tool_choice
    if choice == "auto" and state.tool_parser is None:
        raise APIError("tool_choice: \"auto\" needs a tool call parser, and this model's chat template teaches no "
                       "tool-call format; start recap serve with --tool-call-parser (hermes, granite, nemotron, "
                       "qwen3_xml), or send tool_choice \"required\" or a named function", param="tool_choice")
    if req.tools and choice == "auto" and state.tool_marker_ids and params.skip_special_tokens:
        params = replace(params, keep_special_token_ids=state.tool_marker_ids)
    inputs = TemplateInputs.of(req)
    if inputs.template is None:
        chat = await state.offload.run(size, inputs.render, state.tokenizer, req.messages)
    elif state.template_sandbox is None:
        raise refuse_untrusted()
    else:  # the client's own program: its cost is not bounded by its size, so never on the loop
        render = state.template_sandbox.renderer(inputs.template, state.tokenizer)
        chat = await state.offload.off_loop(inputs.render, state.tokenizer, req.messages, render)
    where = None if state.reasoning is None else opening(state.reasoning, chat.generation_prompt,
                                                          inputs.kwargs.get("enable_thinking"))
    params = state.reasoning_params(params, where, req.include_reasoning)
    prepared = await state.offload.run(size, prepare_all, state, [chat.token_ids], params, request_id=rid,
                                       boundaries=[chat.segment_boundaries], cache_salt=req.cache_salt,
                                       fit_max_tokens=req.max_tokens_unset)
    reserve_sequences(request.scope, params.n)  # --max-queued counts sequences
    prepared = attach_transfer(state.kv_transfer, state.engine.engine, req.kv_transfer_params, prepared,
                               stream=req.stream, n=params.n, request=request)
    return ChatRun(rid, params, merged(state.engine, prepared, RequestLog(prepared, req.user or req.safety_identifier)),
                   where)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request) -> Response:
    state.check_model(req.model)
    size = len(await request.body())  # messages, tools and all: what rendering, tokenizing and grammars cost
    run = await start_chat(state, req, request, size, new_request_id("chatcmpl"))
    if req.stream:
        first = await open_stream(request, run.it)
        if first is None:
            return Response(status_code=499)
        return SSEResponse(_stream(state, req, run, first))
    finals = await collect_finals(request, run.it, 1)
    if finals is None:
        return Response(status_code=499)
    return await state.offload.run(response_size(finals, req.top_logprobs or 0), _response, state, req, run, finals)


def _response(state: ServerState, req: ChatCompletionRequest, run: ChatRun,
              finals: list[RequestOutput]) -> JSONResponse:
    """The whole answer, rendered: tool-call parsing, logprob strings and JSON (off the loop when large)."""
    out = finals[0]
    k = req.top_logprobs or 0
    choices = []
    for o in out.outputs:
        message, finish = assistant_message(state, req, o.text, o.finish_reason, run.reasoning)
        for call in message.tool_calls:
            call.index = None  # a position only in streamed deltas, as OpenAI has it
        if req.echoed:
            message.content = req.echoed + (message.content or "")
        choices.append(ChatChoice(
            index=o.index, message=message, finish_reason=finish,
            logprobs=None if o.logprobs is None else chat_logprobs(state.token_text, o.token_ids, o.logprobs, k)))
    resp = ChatCompletionResponse(id=run.rid, created=int(time.time()), model=state.model_name, choices=choices,
                                  usage=chat_usage(state, run, finals),
                                  prompt_logprobs=prompt_logprobs_out(out.prompt_logprobs))
    return JSONResponse(with_transfer_params(resp.model_dump(), finals))


def chat_usage(state: ServerState, run: ChatRun, finals: list[RequestOutput]) -> Usage:
    """usage(), and with a reasoning parser the tokens the choices' think blocks took."""
    u = usage(finals)
    if run.reasoning is None or state.reasoning is None:
        return u
    fmt, where = state.reasoning, run.reasoning
    thought = sum(answer_reasoning_tokens(o.text, [state.token_text(t) for t in o.token_ids], fmt, where)
                  for out in finals for o in out.outputs)  # fmt: skip
    return u.model_copy(update={"completion_tokens_details": CompletionTokensDetails(reasoning_tokens=thought)})


def assistant_message(
    state: ServerState, req: ChatCompletionRequest, text: str, finish: str | None, where: Opening | None = None
) -> tuple[ChatResponseMessage, str | None]:
    """The assistant message of one choice: its reasoning (`where`: where the answer starts, None without a
    reasoning parser), then tool calls forced by the grammar or parsed from the content that follows."""
    reasoning: str | None = None
    content: str | None = text
    if where is not None:
        assert state.reasoning is not None
        reasoning, content = split_reasoning(text, state.reasoning, where)
    choice = req.effective_tool_choice
    calls = []
    if req.tools and choice != "none" and content is not None:  # calls come from the content only
        if choice == "auto":
            assert state.tool_parser is not None
            content, calls = parse_tool_calls(content, state.tool_parser, req.tools)
        else:
            calls = forced_calls(content, req.tools, choice)
            content = None if calls else content
    if calls and finish == "stop":
        finish = "tool_calls"
    message = ChatResponseMessage(content=content, tool_calls=calls)
    if reasoning is not None and req.include_reasoning:
        message.reasoning = message.reasoning_content = reasoning
    return message, finish


def _chunk(state: ServerState, rid: str, created: int, choices: list[ChatChunkChoice],
           usage_now: Usage | None = None) -> str:
    return sse(ChatCompletionChunk(id=rid, created=created, model=state.model_name, choices=choices,
                                   usage=usage_now).model_dump_json())


def answer_stream(state: ServerState, req: ChatCompletionRequest, where: Opening | None) -> AnswerStream | None:
    """One choice's splitter: reasoning first (with a parser), then tool calls from the content (with tools);
    None when the text goes out as it comes."""
    choice = req.effective_tool_choice
    tools = ToolCallStream(req.tools, choice, state.tool_parser) if req.tools and choice != "none" else None
    thinking = None if where is None or state.reasoning is None else ReasoningStream(state.reasoning, where)
    return None if tools is None and thinking is None else AnswerStream(thinking, tools)


def _delta(req: ChatCompletionRequest, answer: AnswerStream | None, text: str, finish: str | None,
           ) -> tuple[ChatDelta, str | None]:
    """A choice's delta for one step (empty when nothing is to be said yet), and its finish reason."""
    if answer is None:
        return (ChatDelta(content=text) if text else ChatDelta()), finish
    pieces = answer.step(text, last=finish is not None)
    if answer.called and finish == "stop":
        finish = "tool_calls"
    thought = (pieces.reasoning or None) if req.include_reasoning else None
    delta = ChatDelta(content=pieces.content or None, tool_calls=pieces.calls or None, reasoning=thought,
                      reasoning_content=thought)
    return delta, finish


async def _stream(
    state: ServerState, req: ChatCompletionRequest, run: ChatRun, first: tuple[int, RequestOutput],
) -> AsyncIterator[str]:
    final: RequestOutput | None = None
    done: set[int] = set()
    created = int(time.time())
    k = req.top_logprobs or 0
    rid, n, it = run.rid, run.params.n, run.it
    answers = {j: answer_stream(state, req, run.reasoning) for j in range(n)}
    try:
        yield _chunk(state, rid, created, [ChatChunkChoice(index=j, delta=ChatDelta(role="assistant", content=""))
                                           for j in range(n)])
        if req.echoed:
            yield _chunk(state, rid, created, [ChatChunkChoice(index=j, delta=ChatDelta(content=req.echoed))
                                               for j in range(n)])  # fmt: skip
        item: tuple[int, RequestOutput] | None = first
        while item is not None:
            _, out = item
            if out.finished:
                final = out
            choices = []
            for o in out.outputs:
                if o.index in done or not (o.text_delta or o.logprobs_delta or o.finish_reason):
                    continue
                lp = None if o.logprobs is None else await state.offload.run(
                    len(o.token_ids_delta) * (1 + k), chat_logprobs, state.token_text, o.token_ids_delta,
                    o.logprobs_delta, k)
                delta, finish = _delta(req, answers[o.index], o.text_delta, o.finish_reason)
                if answers[o.index] is not None and delta.empty and lp is None and not finish:
                    continue
                choices.append(ChatChunkChoice(index=o.index, delta=delta, logprobs=lp, finish_reason=finish))
                if o.finish_reason is not None:
                    done.add(o.index)
            if choices:
                yield _chunk(state, rid, created, choices, usage([out]) if req.continuous_usage else None)
            item = await anext(it, None)
        if req.include_usage and final is not None:
            last = ChatCompletionChunk(id=rid, created=created, model=state.model_name, choices=[],
                                       usage=chat_usage(state, run, [final]))
            yield sse(last.model_dump_json())
    except Exception as e:  # noqa: BLE001 - the 200 is out: report in-stream, as OpenAI does
        yield sse_error(e)
    finally:
        await it.aclose()
    yield SSE_DONE
