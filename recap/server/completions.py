"""POST /v1/completions: one engine request per prompt; choice index = prompt index * n + sample."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from recap.disagg.api import attach_transfer, with_transfer_params
from recap.engine.outputs import RequestOutput
from recap.engine.processor import PreparedRequest
from recap.server.errors import APIError, from_value_error
from recap.server.logprobs import completion_logprobs
from recap.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from recap.server.serving import (
    RequestLog,
    ServerState,
    collect_finals,
    merged,
    new_request_id,
    open_stream,
    prepare_all,
    prompt_size,
    usage,
)
from recap.server.sse import SSE_DONE, SSEResponse, sse, sse_error


def _check_checkpoints(req: CompletionRequest, prepared: list[PreparedRequest]) -> None:
    for p in prepared:
        n = len(p.prompt_token_ids)
        bad = [c for c in req.checkpoints or () if not 0 < c <= n]
        if bad:
            raise APIError(f"checkpoints: offset {bad[0]} is outside the prompt (1..{n} for a {n}-token prompt)",
                           param="checkpoints")


async def create_completion(state: ServerState, req: CompletionRequest, request: Request) -> Response:
    state.check_model(req.model)
    try:
        params = req.sampling_params()
    except ValueError as e:
        raise from_value_error(e) from None
    prompts = req.prompts()
    rid = new_request_id("cmpl")
    prepared = await state.offload.run(prompt_size(prompts), prepare_all, state, prompts, params, request_id=rid,
                                       boundaries=[req.checkpoints or ()] * len(prompts), cache_salt=req.cache_salt)
    _check_checkpoints(req, prepared)
    prepared = attach_transfer(state.engine.engine, req.kv_transfer_params, prepared, stream=req.stream, n=params.n)
    it = merged(state.engine, prepared, RequestLog(prepared, req.user))
    if req.stream:
        first = await open_stream(request, it)
        if first is None:
            return Response(status_code=499)
        return SSEResponse(_stream(state, req, rid, params.n, first, it))
    finals = await collect_finals(request, it, len(prepared))
    if finals is None:
        return Response(status_code=499)
    return JSONResponse(with_transfer_params(_response(state, rid, params.n, finals).model_dump(), finals))


def _response(state: ServerState, rid: str, n: int, finals: list[RequestOutput]) -> CompletionResponse:
    choices = []
    for i, out in enumerate(finals):
        for o in out.outputs:
            lp = None if o.logprobs is None else completion_logprobs(state.token_text, o.logprobs, 0)[0]
            choices.append(CompletionChoice(index=i * n + o.index, text=o.text, logprobs=lp,
                                            finish_reason=o.finish_reason))
    choices.sort(key=lambda c: c.index)
    return CompletionResponse(id=rid, created=state.created, model=state.model_name, choices=choices,
                              usage=usage(finals))


async def _stream(
    state: ServerState, req: CompletionRequest, rid: str, n: int, first: tuple[int, RequestOutput],
    it: AsyncGenerator[tuple[int, RequestOutput], None],
) -> AsyncIterator[str]:
    finals: dict[int, RequestOutput] = {}
    done: set[int] = set()
    offsets: dict[int, int] = {}
    try:
        item: tuple[int, RequestOutput] | None = first
        while item is not None:
            i, out = item
            if out.finished:
                finals[i] = out
            choices = []
            for o in out.outputs:
                idx = i * n + o.index
                if idx in done or not (o.text_delta or o.logprobs_delta or o.finish_reason):
                    continue
                lp = None
                if o.logprobs is not None:
                    lp, offsets[idx] = completion_logprobs(state.token_text, o.logprobs_delta, offsets.get(idx, 0))
                choices.append(CompletionChoice(index=idx, text=o.text_delta, logprobs=lp,
                                                finish_reason=o.finish_reason))
                if o.finish_reason is not None:
                    done.add(idx)
            if choices:
                chunk = CompletionResponse(id=rid, created=state.created, model=state.model_name, choices=choices)
                yield sse(chunk.model_dump_json())
            item = await anext(it, None)
        if req.include_usage:
            last = CompletionResponse(id=rid, created=state.created, model=state.model_name, choices=[],
                                      usage=usage([finals[i] for i in sorted(finals)]))
            yield sse(last.model_dump_json())
    except Exception as e:  # noqa: BLE001 - the 200 is out: report in-stream, as OpenAI does
        yield sse_error(e)
    finally:
        await it.aclose()
    yield SSE_DONE

