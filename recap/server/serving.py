"""What both endpoints share: server state, preparing prompts, merging engine streams, client
disconnects, usage, token strings, and the one log line per request.

Every engine stream is consumed through `merged()`: closing it (or cancelling the task that
iterates it) closes each engine generator, which aborts whatever is still running, so the
request's blocks and slots return to the pools.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request

from recap.engine.async_engine import AsyncEngine
from recap.engine.input_processor import PreparedRequest
from recap.engine.outputs import RequestOutput
from recap.http.disconnect import ClientGone, race_disconnect
from recap.http.errors import APIError
from recap.http.offload import Offloader
from recap.sampling_params import SamplingParams
from recap.server.errors import from_exception, from_value_error
from recap.server.reasoning import Opening, ReasoningFormat
from recap.server.responses import PromptTokensDetails, Usage
from recap.server.template_sandbox import TemplateSandbox
from recap.server.transfer_params import TransferHook

log = logging.getLogger("recap.server")


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    max_model_len: int
    created: int = field(default_factory=lambda: int(time.time()))
    _token_text: dict[int, str] = field(default_factory=dict)
    offload: Offloader = field(default_factory=Offloader)  # large inputs are prepared off the event loop
    # How tool calls are read from free text (recap/server/tools.py); None: tool_choice "auto" is refused.
    tool_parser: str | None = None
    # The parser's markers that are special tokens: kept in the text of requests with tools.
    tool_marker_ids: tuple[int, ...] = ()
    kv_transfer: TransferHook | None = None  # a prefill or decode instance's (recap.server.transfer_params)
    # Where a request's own chat template renders; None: such requests are refused (--trust-request-chat-template).
    template_sandbox: TemplateSandbox | None = None
    # --reasoning-parser (recap/server/reasoning.py); None: answers are all content.
    reasoning: ReasoningFormat | None = None
    # The end tag's token ids: an output constraint starts after them (unless --structured-outputs-config.
    # enable_in_reasoning); and the tags that are special tokens, kept in the text for the parser.
    reasoning_end_ids: tuple[int, ...] = ()
    reasoning_marker_ids: tuple[int, ...] = ()
    grammar_in_reasoning: bool = False

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(f"The model `{name}` does not exist (this server serves `{self.model_name}`)",
                           status=404, param="model", code="model_not_found")

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


    def reasoning_params(self, params: SamplingParams, where: Opening | None,
                         include_reasoning: bool) -> SamplingParams:
        """A chat request's sampling once its answer's start is known: the think tags kept in its text, and its
        output constraint (response_format, a forced tool call) held until the think block ends, as vLLM does
        (not when the answer starts as content, nor with include_reasoning false: vLLM constrains those from
        the first token)."""
        if where is None:
            return params
        if self.reasoning_marker_ids and params.skip_special_tokens:
            keep = tuple(dict.fromkeys((*params.keep_special_token_ids, *self.reasoning_marker_ids)))
            params = replace(params, keep_special_token_ids=keep)
        thinking = where != "content" and include_reasoning and not self.grammar_in_reasoning
        if params.structured_outputs is not None and thinking:
            params = replace(params, structured_outputs_after=self.reasoning_end_ids)
        return params


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def prepare_all(
    state: ServerState,
    prompts: Sequence[str | list[int]],
    params: SamplingParams,
    *,
    request_id: str,
    boundaries: Sequence[Sequence[int]],
    cache_salt: str | None,
    fit_max_tokens: bool = False,
) -> list[PreparedRequest]:
    """Validate every prompt before any starts, so a bad one in a batch rejects the whole request.
    `fit_max_tokens`: the client sent no max_tokens (its default is capped at each prompt's room)."""
    out = []
    for i, prompt in enumerate(prompts):
        try:
            out.append(state.engine.prepare(
                prompt, params, request_id=f"{request_id}-{i}", segment_boundaries=boundaries[i],
                cache_salt=cache_salt, fit_max_tokens=fit_max_tokens))
        except ValueError as e:
            err = from_value_error(e)
            if len(prompts) > 1:
                err.message = f"prompt {i}: {err.message}"
            raise err from None
    return out


async def sampling_params(state: ServerState, req: Any, size: int) -> SamplingParams:
    """The request's SamplingParams (a ValueError is a 400 naming the field). Its output constraint is
    bounded and compiled here (recap.grammar_bounds), off the event loop when the body is large."""
    try:
        return await state.offload.run(size, req.sampling_params, state.engine.engine.default_sampling)
    except ValueError as e:
        raise from_value_error(e) from None


def prompt_size(prompts: Sequence[str | Sequence[int]]) -> int:
    """Characters or tokens to prepare: decides whether preparing runs off the event loop."""
    return sum(len(p) for p in prompts)


def response_size(finals: Sequence[RequestOutput], top_logprobs: int, echo: bool = False) -> int:
    """Tokens (times their top logprobs) and characters a response renders: decides whether rendering runs
    off the event loop."""
    per_token = 1 + top_logprobs
    size = 0
    for out in finals:
        if echo or out.prompt_logprobs is not None:
            size += len(out.prompt_token_ids) * per_token + len(out.prompt or "")
        size += sum(len(o.token_ids) * per_token + len(o.text) for o in out.outputs)
    return size


@dataclass
class RequestLog:
    """Collects the last output of each prompt; `emit` writes one line per engine request."""

    prepared: list[PreparedRequest]
    user: str | None
    last: dict[int, RequestOutput] = field(default_factory=dict)

    def emit(self) -> None:
        for i, p in enumerate(self.prepared):
            out = self.last.get(i)
            outs = out.outputs if out is not None else []
            finish = ",".join(o.finish_reason or "abort" for o in outs) if outs and out.finished else "abort"
            ttft = out.metrics.ttft if out is not None and out.metrics is not None else None
            log.info(
                "request %s prompt_tokens=%d cached_tokens=%d completion_tokens=%d finish=%s ttft=%s "
                "latency=%.3fs user=%s",
                p.request_id, len(p.prompt_token_ids), out.num_cached_tokens if out else 0,
                sum(len(o.token_ids) for o in outs), finish, "-" if ttft is None else f"{ttft:.3f}s",
                time.monotonic() - p.arrival_time, "-" if self.user is None else repr(self.user),
            )


async def merged(
    engine: AsyncEngine, prepared: list[PreparedRequest], rlog: RequestLog
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(prompt index, output) from every prompt's engine stream as they come; closing aborts the rest."""
    try:
        if len(prepared) == 1:
            async with contextlib.aclosing(engine.generate(prepared[0])) as gen:
                async for out in gen:
                    rlog.last[0] = out
                    yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, p: PreparedRequest) -> None:
            try:
                async with contextlib.aclosing(engine.generate(p)) as gen:
                    async for out in gen:
                        queue.put_nowait((i, out))
            except Exception as e:  # noqa: BLE001 - re-raised by the consumer
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prepared)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    rlog.last[i] = item
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()  # each pump closes its engine generator, which aborts its request
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        rlog.emit()


def usage(finals: Sequence[RequestOutput], *, drop_completion: bool = False) -> Usage:
    """`drop_completion`: the generated tokens are not returned (echo with max_tokens 0)."""
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = 0 if drop_completion else sum(len(c.token_ids) for o in finals for c in o.outputs)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in finals)),
    )


def _refused(out: RequestOutput) -> None:
    """The scheduler finishes a request that can never fit its pools at once, with no tokens."""
    if out.finished and any(o.finish_reason == "error" and not o.token_ids for o in out.outputs):
        raise APIError(out.error or "the request does not fit in this server's cache pools (prompt + max_tokens "
                       "need more KV blocks or state slots than exist); send a shorter prompt or max_tokens")


async def open_stream(
    request: Request, it: AsyncGenerator[tuple[int, RequestOutput], None]
) -> tuple[int, RequestOutput] | None:
    """The first output, awaited before the 200 goes out so that engine-side rejections are still
    a 4xx; None when the client left first (the request is aborted)."""

    async def first() -> tuple[int, RequestOutput]:
        item = await anext(it)
        _refused(item[1])
        return item

    try:
        return await race_disconnect(request, first())
    except ClientGone:
        return None
    except Exception as e:
        await it.aclose()
        raise from_exception(e) from None


async def collect_finals(
    request: Request, it: AsyncGenerator[tuple[int, RequestOutput], None], count: int
) -> list[RequestOutput] | None:
    """Every prompt's final output in prompt order; None when the client left first (aborted)."""

    async def drain() -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for i, out in it:
            if out.finished:
                _refused(out)
                finals[i] = out
        return [finals[i] for i in range(count)]

    try:
        return await race_disconnect(request, drain())
    except ClientGone:
        return None
    except Exception as e:
        raise from_exception(e) from None
    finally:
        await it.aclose()
