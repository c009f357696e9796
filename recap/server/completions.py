"""POST /v1/completions: one engine request per prompt; choice index = prompt index * n + sample.

`echo` puts the prompt before each choice's text (and, with `logprobs`, the prompt tokens' logprobs
before the generated ones, the first being null: what lm-eval's loglikelihood reads); `echo` with
`max_tokens: 0` returns the prompt alone (one token is run and dropped).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from recap.engine.input_processor import PreparedRequest
from recap.engine.outputs import CompletionOutput, RequestOutput
from recap.http.errors import APIError
from recap.http.guard import reserve_sequences
from recap.http.sse import SSE_DONE, SSEResponse, sse
from recap.server.errors import sse_error
from recap.server.logprobs import completion_logprobs, prompt_logprobs_out
from recap.server.protocol import CompletionRequest
from recap.server.responses import CompletionChoice, CompletionLogprobs, CompletionResponse, Usage
from recap.server.serving import (
    RequestLog,
    ServerState,
    collect_finals,
    merged,
    new_request_id,
    open_stream,
    prepare_all,
    prompt_size,
    response_size,
    sampling_params,
    usage,
)
from recap.server.transfer_params import attach_transfer, with_transfer_params


def _check_checkpoints(req: CompletionRequest, prepared: list[PreparedRequest]) -> None:
    for p in prepared:
        n = len(p.prompt_token_ids)
        bad = [c for c in req.checkpoints or () if not 0 < c <= n]
        if bad:
            raise APIError(f"checkpoints: offset {bad[0]} is outside the prompt (1..{n} for a {n}-token prompt)",
                           param="checkpoints")


async def create_completion(state: ServerState, req: CompletionRequest, request: Request) -> Response:
    state.check_model(req.model)
    params = await sampling_params(state, req, len(await request.body()))
    prompts = req.prompts()
    rid = new_request_id("cmpl")
    prepared = await state.offload.run(prompt_size(prompts), prepare_all, state, prompts, params, request_id=rid,
                                       boundaries=[req.checkpoints or ()] * len(prompts), cache_salt=req.cache_salt,
                                       fit_max_tokens=req.max_tokens_unset)
    _check_checkpoints(req, prepared)
    reserve_sequences(request.scope, params.n * len(prepared))  # --max-queued counts sequences
    prepared = attach_transfer(state.kv_transfer, state.engine.engine, req.kv_transfer_params, prepared,
                               stream=req.stream, n=params.n, request=request)
    it = merged(state.engine, prepared, RequestLog(prepared, req.user))
    if req.stream:
        first = await open_stream(request, it)
        if first is None:
            return Response(status_code=499)
        return SSEResponse(_stream(state, req, rid, params.n, first, it))
    finals = await collect_finals(request, it, len(prepared))
    if finals is None:
        return Response(status_code=499)
    size = response_size(finals, req.logprobs or 0, echo=req.echo)
    return await state.offload.run(size, _render, state, req, rid, params.n, finals)


def _render(state: ServerState, req: CompletionRequest, rid: str, n: int, finals: list[RequestOutput]) -> JSONResponse:
    """The whole answer, rendered: echo, logprob strings and JSON (off the loop when large)."""
    return JSONResponse(with_transfer_params(_response(state, req, rid, n, finals).model_dump(), finals))


def _echo(state: ServerState, req: CompletionRequest, out: RequestOutput) -> tuple[str, CompletionLogprobs | None, int]:
    """The prompt's part of a choice under echo: its text, its logprobs (when asked) and their end offset."""
    text = out.prompt if out.prompt is not None else state.tokenizer.decode(out.prompt_token_ids)
    if req.logprobs is None:
        return text, None, len(text)
    plp = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    lp, offset = completion_logprobs(state.token_text, out.prompt_token_ids, plp, req.logprobs, 0)
    return text, lp, offset


def _response(
    state: ServerState, req: CompletionRequest, rid: str, n: int, finals: list[RequestOutput]
) -> CompletionResponse:
    choices = []
    for i, out in enumerate(finals):
        for o in out.outputs:
            text, lp, offset = _echo(state, req, out) if req.echo else ("", None, 0)
            if req.prompt_only:
                finish, stop_reason = "length", None
            else:
                text += o.text
                if o.logprobs is not None:
                    lp = completion_logprobs(state.token_text, o.token_ids, o.logprobs, req.logprobs or 0, offset,
                                             lp)[0]
                finish, stop_reason = o.finish_reason, o.stop_reason
            choices.append(CompletionChoice(index=i * n + o.index, text=text, logprobs=lp, finish_reason=finish,
                                            stop_reason=stop_reason,
                                            prompt_logprobs=prompt_logprobs_out(out.prompt_logprobs)))
    choices.sort(key=lambda c: c.index)
    return CompletionResponse(id=rid, created=int(time.time()), model=state.model_name, choices=choices,
                              usage=usage(finals, drop_completion=req.prompt_only))


async def _stream(
    state: ServerState, req: CompletionRequest, rid: str, n: int, first: tuple[int, RequestOutput],
    it: AsyncGenerator[tuple[int, RequestOutput], None],
) -> AsyncIterator[str]:
    finals: dict[int, RequestOutput] = {}
    latest: dict[int, RequestOutput] = {}
    done: set[int] = set()
    offsets: dict[int, int] = {}
    created = int(time.time())
    try:
        item: tuple[int, RequestOutput] | None = first
        while item is not None:
            i, out = item
            latest[i] = out
            if out.finished:
                finals[i] = out
            choices = []
            for o in out.outputs:
                idx = i * n + o.index
                if idx in done:
                    continue
                started = idx in offsets
                size = (len(o.token_ids_delta) + (0 if started or not req.echo else len(out.prompt_token_ids))) * (
                    1 + (req.logprobs or 0))  # under echo the first chunk renders the prompt
                choice = await state.offload.run(size, _stream_choice, state, req, out, o, idx, started, offsets)
                if choice is None:
                    continue
                choices.append(choice)
                if choice.finish_reason is not None:
                    done.add(idx)
            if choices:
                chunk = CompletionResponse(id=rid, created=created, model=state.model_name, choices=choices,
                                           usage=_usage_so_far(req, latest))
                yield sse(chunk.model_dump_json())
            item = await anext(it, None)
        if req.include_usage:
            last = CompletionResponse(id=rid, created=created, model=state.model_name, choices=[],
                                      usage=usage([finals[i] for i in sorted(finals)], drop_completion=req.prompt_only))
            yield sse(last.model_dump_json())
    except Exception as e:  # noqa: BLE001 - the 200 is out: report in-stream, as OpenAI does
        yield sse_error(e)
    finally:
        await it.aclose()
    yield SSE_DONE


def _usage_so_far(req: CompletionRequest, latest: dict[int, RequestOutput]) -> Usage | None:
    """stream_options.continuous_usage_stats: the usage so far on every chunk (vLLM)."""
    return usage([latest[i] for i in sorted(latest)], drop_completion=req.prompt_only) if req.continuous_usage else None


def _stream_choice(
    state: ServerState, req: CompletionRequest, out: RequestOutput, o: CompletionOutput, idx: int, started: bool,
    offsets: dict[int, int],
) -> CompletionChoice | None:
    """This output's delta as a chunk choice (under echo the first one opens with the prompt); None if empty."""
    if not started and not (o.token_ids or o.finish_reason):
        return None  # the prompt may still be computing (its logprobs incomplete): open with the first token
    text, lp, offset = "", None, offsets.get(idx, 0)
    if req.echo and not started:
        text, lp, offset = _echo(state, req, out)
    offsets[idx] = offset
    if req.prompt_only:
        return CompletionChoice(index=idx, text=text, logprobs=lp, finish_reason="length") if not started else None
    if not (text or o.text_delta or o.logprobs_delta or o.finish_reason):
        return None
    text += o.text_delta
    if o.logprobs is not None:
        lp, offsets[idx] = completion_logprobs(state.token_text, o.token_ids_delta, o.logprobs_delta,
                                               req.logprobs or 0, offset, lp)
    return CompletionChoice(index=idx, text=text, logprobs=lp, finish_reason=o.finish_reason,
                            stop_reason=o.stop_reason if o.finish_reason else None,
                            prompt_logprobs=None if started else prompt_logprobs_out(out.prompt_logprobs))

