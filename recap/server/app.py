"""The FastAPI app: routes, error handling and the engine's lifetime.

Request bodies are parsed by hand (JSON, then the pydantic model) so that every bad input,
from malformed JSON to an unknown field, gets the same OpenAI-style 4xx body.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import ProcessCollector
from prometheus_client.registry import Collector

from recap.engine.async_engine import AsyncEngine
from recap.engine.detokenizer import special_token_ids
from recap.http.errors import APIError, add_error_handlers
from recap.http.guard import Guard
from recap.http.limits import ServerLimits
from recap.http.request_counts import RequestCounts, RequestCountsCollector
from recap.http.wire import GENERATION_ROUTES, RESPONSES_ROUTE
from recap.process.census import census
from recap.server import process_memory
from recap.server.chat import create_chat_completion
from recap.server.completions import create_completion
from recap.server.errors import from_exception
from recap.server.metrics import make_registry, render
from recap.server.options import ServerOptions, install
from recap.server.protocol import ChatCompletionRequest, CompletionRequest
from recap.server.reasoning import reasoning_format
from recap.server.request_body import parse_request
from recap.server.response_store import ResponseStore
from recap.server.responses import ModelCard, ModelList
from recap.server.responses_api import create_response, delete_response, get_response, list_input_items
from recap.server.responses_api_request import ResponsesRequest
from recap.server.serving import ServerState
from recap.server.tokenize_api import add_tokenize_routes
from recap.server.tools import detect_parser, special_marker_ids
from recap.server.transfer_params import TransferHook

log = logging.getLogger("recap.server")


def _cache_labels(engine: AsyncEngine) -> dict[str, str]:
    cfg = engine.engine.config
    c = cfg.cache
    return {
        "block_size": str(c.block_size), "enable_prefix_caching": str(c.enable_prefix_caching).lower(),
        "checkpoint_policy": c.checkpoint_policy, "kv_cache_bytes": str(c.kv_cache_bytes or "auto"),
        "state_cache_bytes": str(c.state_cache_bytes or "auto"),
        "disk_cache_bytes": str(c.disk_tier_bytes),  # the disk tier (0: none)
        "host_cache_bytes": str(c.cache_host_bytes or 0),  # the host-memory tier (0: none)
        "max_num_seqs": str(cfg.scheduler.max_num_seqs),
        "max_num_batched_tokens": str(cfg.scheduler.max_num_batched_tokens),
    }


def build_app(
    engine: AsyncEngine, *, shutdown_engine: bool = True, collectors: Sequence[Collector] = (),
    options: ServerOptions | None = None, limits: ServerLimits | None = None, api_key: str | None = None,
    kv_transfer: TransferHook | None = None, replica: str | None = None,
) -> FastAPI:
    """An app serving `engine`; starts it on startup and (unless told not to) shuts it down on exit.

    `collectors`: extra Prometheus series for /metrics (e.g. recap.disagg's transfer counters).
    `options`: CORS and the request-id echo (recap.server.options).
    `limits`, `api_key`: request limits, admission and auth (recap.http.guard); /debug only if enabled.
    `kv_transfer`: a prefill or decode instance's kv_transfer_params hook (recap.server.transfer_params).
    `replica`: a Ray replica's id, which the ids of its stored responses carry (recap.http.response_ids).
    """
    llm = engine.engine
    state = ServerState(engine, llm.served_model_name, llm.config.scheduler.max_model_len, kv_transfer=kv_transfer)
    registry = make_registry(engine, state.model_name, _cache_labels(engine))
    for collector in collectors:
        registry.register(collector)

    options = options or ServerOptions()
    trimmer = None if options.malloc_trim_interval_s <= 0 else process_memory.MallocTrimmer(
        options.malloc_trim_interval_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        trimming = None if trimmer is None else asyncio.create_task(trimmer.run())
        try:
            yield
        finally:
            if trimming is not None:
                trimming.cancel()
            state.offload.shutdown()
            if shutdown_engine:
                engine.shutdown()

    app = FastAPI(title="recap", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.recap = state
    app.state.limits = limits = limits or ServerLimits()
    ProcessCollector(registry=registry)  # process_resident_memory_bytes etc. (the soak watches it)
    counts = RequestCounts()  # recap.http.request_counts: what became of each generation request
    registry.register(RequestCountsCollector(counts, state.model_name))
    app.add_middleware(Guard, limits=limits, api_key=api_key, admitted=(*GENERATION_ROUTES, RESPONSES_ROUTE),
                       counts=counts, to_error=from_exception)
    _set_parsers(state, options)
    state.template_sandbox = options.template_sandbox()
    install(app, options)  # added last: CORS (preflight) and the id echo wrap the guard
    add_tokenize_routes(app, state)
    add_error_handlers(app, log, logging.INFO, "rejected")
    _add_generation_routes(app, state, ResponseStore(options.responses_store_size, replica))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = ModelCard(id=state.model_name, created=state.created, max_model_len=state.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.get("/health")
    async def health() -> Response:
        if engine.dead is not None:
            return APIError(f"engine stopped: {engine.dead!r}", status=503, type="service_unavailable").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    if limits.enable_debug:
        _add_debug_routes(app, engine, trimmer)
    return app


def _add_generation_routes(app: FastAPI, state: ServerState, store: ResponseStore) -> None:
    """Completions, chat completions and OpenAI's Responses API (recap.server.responses_api), whose `store`
    keeps the responses asked to be stored (on app.state too: /debug/memory counts it)."""
    app.state.responses_store = store

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(state, await parse_request(request, CompletionRequest, state), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(state, await parse_request(request, ChatCompletionRequest, state), request)

    @app.post(RESPONSES_ROUTE)
    async def responses(request: Request) -> Response:
        return await create_response(state, store, await parse_request(request, ResponsesRequest, state), request)

    @app.get(RESPONSES_ROUTE + "/{response_id}")
    async def stored_response(response_id: str, request: Request) -> Response:
        return await get_response(store, response_id, request)

    @app.get(RESPONSES_ROUTE + "/{response_id}/input_items")
    async def response_input_items(response_id: str, request: Request) -> Response:
        return await list_input_items(store, response_id, request)

    @app.delete(RESPONSES_ROUTE + "/{response_id}")
    async def forget_response(response_id: str, request: Request) -> Response:
        return await delete_response(store, response_id, request)


def _tool_parser(flag: str | None, tokenizer: Any) -> str | None:
    """The tool-call parser (--tool-call-parser, else the one the chat template teaches), named in the log."""
    parser = flag or detect_parser(getattr(tokenizer, "chat_template", None))
    if parser is None:
        log.info("tool-call parser: none (the chat template teaches no tool-call format; tool_choice auto is "
                 "refused until --tool-call-parser names one)")
    else:
        log.info("tool-call parser: %s (%s)", parser, "--tool-call-parser" if flag else "from the chat template")
    return parser


def _set_parsers(state: ServerState, options: ServerOptions) -> None:
    """The tool-call parser and its markers held as special tokens; --reasoning-parser: the format (an unknown
    name is a ValueError listing the known ones), the end tag's token ids (where output constraints start) and
    the tags the tokenizer holds as special tokens (kept in the text)."""
    tok = state.tokenizer
    special = special_token_ids(tok)
    state.tool_parser = _tool_parser(options.tool_call_parser, tok)
    state.tool_marker_ids = special_marker_ids(tok, state.tool_parser, special)
    if options.reasoning_parser is None:
        return
    fmt = state.reasoning = reasoning_format(options.reasoning_parser)
    state.reasoning_end_ids = tuple(tok.encode(fmt.end, add_special_tokens=False))
    tags = [tok.encode(t, add_special_tokens=False) for t in (fmt.start, fmt.end)]
    state.reasoning_marker_ids = tuple(ids[0] for ids in tags if len(ids) == 1 and ids[0] in special)
    state.grammar_in_reasoning = options.grammar_in_reasoning
    log.info("reasoning parser: %s (end tag %s = token ids %s)", fmt.name, fmt.end, list(state.reasoning_end_ids))


def _add_debug_routes(app: FastAPI, engine: AsyncEngine, trimmer: process_memory.MallocTrimmer | None) -> None:
    @app.get("/debug/integrity")
    async def integrity() -> dict[str, Any]:
        """The cache core's accounting check (DESIGN §3.5) and the request counts, for tests and soaks."""
        error = await engine.check_integrity()
        pools = engine.pool_usage()  # read on the engine thread together with the check
        return {"ok": error is None, "error": error, "num_running": pools.pop("num_running", 0),
                "num_waiting": pools.pop("num_waiting", 0), "pools": pools}

    @app.get("/debug/memory")
    async def memory(trim: bool = False, collect: bool = False) -> dict[str, Any]:
        """The process's memory (recap.server.process_memory) and the engine's live records
        (recap.process.census, read on the engine thread), so a soak tells live-object growth from
        allocator noise. `?trim=true` first returns free malloc memory to the OS (malloc_trim);
        `?collect=true` first runs a full garbage collection."""
        records = await engine.call(census)
        records["per_request"]["async_streams"] = engine.num_streams
        store: ResponseStore = app.state.responses_store  # bounded by count (--responses-store-size)
        records["bounded"]["responses_store"] = {"count": len(store), "capacity": store.capacity}
        if trim:
            await asyncio.to_thread(process_memory.trim)
        proc = await asyncio.to_thread(process_memory.snapshot, True, collect)
        return {"process": {**proc, "malloc_trims": None if trimmer is None else trimmer.num_trims}, **records}
