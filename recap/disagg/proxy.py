"""`recap proxy --prefill URL --decode URL`: one OpenAI endpoint in front of a prefill and a decode instance.

Each POST /v1/completions or /v1/chat/completions goes first to a prefill instance, unstreamed, with
`kv_transfer_params: {"do_remote_decode": true}` and the deployment's KV credential (header x-kv-api-key:
--kv-api-key, or derived from --kv-secret-file; a prefill instance takes do_remote_decode from nobody else)
(it computes the prompt, samples one token and holds the KV), then to a decode instance with the handle it
returned; the decode side's answer (plain or streamed, usage included, cached_tokens = the decode side's hit)
goes back to the client unchanged. The flow and its errors are recap.disagg.flow's (the Ray P/D ingress runs
the same): an error body from either side is passed through, except a decode side's refusal of the transfer
handle (the proxy's doing, not the client's: a 502 `kv_transfer_refused` carrying its reason); an unreachable
instance is a 502, a timeout a 504 and an upstream error without an OpenAI body a 502, each with an OpenAI-
style error body; a decode stream that breaks ends with an error event. When the decode side fails, refuses or
the client leaves before it answered, the proxy tells the prefill side to release the held KV at once (not
after its hold timeout); a client that leaves cancels the upstream request, streamed or not (which aborts it
there).
Instances are taken round robin. Torch-free.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import zmq
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from recap.disagg.config import proxy_kv_api_key
from recap.disagg.flow import (
    Answer,
    error_answer,
    passthrough,
    prefill_then_decode,
    refuse_client_params,
    upstream_timeout,
)
from recap.disagg.zmq_transport import send_release
from recap.http.disconnect import ClientGone, race_disconnect
from recap.http.errors import APIError, add_error_handlers
from recap.http.guard import Guard
from recap.http.limits import ServerLimits, parse_body, server_limits
from recap.http.sse import SSE_DONE, SSEResponse, sse_event
from recap.http.wire import GENERATION_ROUTES, KV_API_KEY_HEADER

log = logging.getLogger("recap.proxy")


@dataclass(frozen=True)
class ProxyConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    timeout_s: float = 600.0
    kv_api_key: str = field(default="", repr=False)  # sent to prefill instances (recap.disagg.api)

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("the proxy needs at least one prefill and one decode instance")
        for url in (*self.prefill_urls, *self.decode_urls):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"instance URL {url!r} must start with http:// or https://")


def _instance(side: str, url: str) -> str:
    return f"the {side} instance at {url}"


def _upstream_error(name: str, err: httpx.HTTPError) -> APIError:
    if isinstance(err, httpx.TimeoutException):
        return upstream_timeout(name)
    return APIError(f"{name} is unreachable: {type(err).__name__}: {err}", status=502, type="upstream_error",
                    code="upstream_unreachable")


def _answer(r: httpx.Response, content: bytes) -> Answer:
    return Answer(r.status_code, content, r.headers.get("content-type", "application/json"))


class Proxy:
    def __init__(self, config: ProxyConfig, limits: ServerLimits, api_key: str | None = None) -> None:
        self.config = config
        self.limits = limits
        self._prefill: Iterator[str] = itertools.cycle([u.rstrip("/") for u in config.prefill_urls])
        self._decode: Iterator[str] = itertools.cycle([u.rstrip("/") for u in config.decode_urls])
        headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}  # the deployment's key
        self.client = httpx.AsyncClient(timeout=config.timeout_s, headers=headers)
        self.zmq = zmq.Context()  # releases to prefill sides (recap.disagg.zmq_transport.send_release)

    def close(self) -> None:
        threading.Thread(target=self.zmq.term, name="recap-proxy-zmq-term", daemon=True).start()

    async def route(self, request: Request, path: str) -> Response:
        body = parse_body(await request.body(), self.limits)
        try:
            return await race_disconnect(request, self._route(body, path))  # cancelling closes the upstream request
        except ClientGone:
            return Response(status_code=499)

    async def _route(self, body: dict[str, Any], path: str) -> Response:
        refuse_client_params(body, "proxy")
        prefill = HTTPUpstream(self, "prefill", next(self._prefill), path, {KV_API_KEY_HEADER: self.config.kv_api_key})
        return await prefill_then_decode(body, prefill, HTTPUpstream(self, "decode", next(self._decode), path))


class HTTPUpstream:
    """One prefill or decode instance, for one request (recap.disagg.flow.Upstream)."""

    hint = " (is it --role prefill?)"

    def __init__(self, proxy: Proxy, side: str, url: str, path: str, headers: dict[str, str] | None = None) -> None:
        self.proxy, self.url, self.path, self.headers = proxy, url, path, headers or {}
        self.name = _instance(side, url)

    async def post(self, body: dict[str, Any]) -> Answer:
        try:
            r = await self.proxy.client.post(self.url + self.path, json=body, headers=self.headers)
        except httpx.HTTPError as e:
            raise _upstream_error(self.name, e) from None
        return _answer(r, r.content)

    async def respond(self, body: dict[str, Any]) -> Response:
        if body.get("stream") is True:
            return await self._stream(body)
        answer = await self.post(body)
        return passthrough(answer) if answer.status == 200 else error_answer(self.name, answer, refusal=True)

    def release(self, handle: dict[str, Any]) -> None:
        """Let the prefill side free the held KV at once (fire and forget, off the loop)."""
        address, tid, mac = handle.get("remote_address"), handle.get("transfer_id"), handle.get("mac")
        if isinstance(address, str) and isinstance(tid, str) and isinstance(mac, str):
            asyncio.get_running_loop().run_in_executor(None, send_release, self.proxy.zmq, address, tid, mac)

    async def _stream(self, body: dict[str, Any]) -> Response:
        client = self.proxy.client
        try:
            r = await client.send(client.build_request("POST", self.url + self.path, json=body), stream=True)
        except httpx.HTTPError as e:
            raise _upstream_error(self.name, e) from None
        if r.status_code != 200:  # the decode side answers errors before its first event
            content = await r.aread()
            await r.aclose()
            return error_answer(self.name, _answer(r, content), refusal=True)

        async def events() -> AsyncIterator[bytes | str]:
            tail = b""
            try:
                async for chunk in r.aiter_raw():
                    tail = (tail + chunk)[-64:]
                    yield chunk
                if SSE_DONE.strip().encode() not in tail:
                    raise httpx.RemoteProtocolError("the stream ended before [DONE]")
            except httpx.HTTPError as e:  # the decode instance died mid-stream: tell the client in-stream
                log.warning("decode stream from %s broke: %s: %s", self.url, type(e).__name__, e)
                err = APIError(f"{self.name} failed mid-stream: {type(e).__name__}: {e}", status=502,
                               type="upstream_error", code="upstream_stream_broken")
                yield "\n\n" + sse_event(err) + SSE_DONE
            finally:
                await r.aclose()  # a client that leaves closes the decode stream, which aborts the request

        return SSEResponse(events())


def build_proxy_app(config: ProxyConfig, limits: ServerLimits | None = None, api_key: str | None = None) -> FastAPI:
    """The proxy app; `limits` and `api_key` as for `recap serve` (recap.http.guard; no /debug here)."""
    limits = limits or ServerLimits()
    proxy = Proxy(config, limits, api_key)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await proxy.client.aclose()
            proxy.close()

    app = FastAPI(title="recap proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = proxy
    app.add_middleware(Guard, limits=limits, api_key=api_key, admitted=GENERATION_ROUTES)

    add_error_handlers(app, log, logging.WARNING, "request failed")

    for path in GENERATION_ROUTES:
        async def handler(request: Request, _path: str = path) -> Response:
            return await proxy.route(request, _path)

        app.add_api_route(path, handler, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        url = next(proxy._decode)
        try:
            r = await proxy.client.get(url + "/v1/models")
        except httpx.HTTPError as e:
            raise _upstream_error(_instance("decode", url), e) from None
        return passthrough(_answer(r, r.content))

    @app.get("/health")
    async def health() -> Response:
        down = []
        for url in {*config.prefill_urls, *config.decode_urls}:
            try:
                ok = (await proxy.client.get(url.rstrip("/") + "/health", timeout=5)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                down.append(url)
        if down:
            err = APIError(f"instances down: {', '.join(sorted(down))}", status=503, type="service_unavailable")
            return err.response()
        return JSONResponse({"status": "ok"})

    return app


def run_proxy(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = ProxyConfig(tuple(args.prefill), tuple(args.decode), args.timeout, proxy_kv_api_key(args))
        limits = server_limits(args)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    from recap.http.timeouts import run_server

    log.info("proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port, config.prefill_urls,
             config.decode_urls)
    run_server(build_proxy_app(config, limits, args.api_key), args.host, args.port, args.log_level, limits)
    return 0
