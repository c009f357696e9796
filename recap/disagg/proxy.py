"""`recap proxy --prefill URL --decode URL`: one OpenAI endpoint in front of a prefill and a decode instance.

Each POST /v1/completions or /v1/chat/completions goes first to a prefill instance, unstreamed, with
`kv_transfer_params: {"do_remote_decode": true}` (it computes the prompt, samples one token and holds
the KV), then to a decode instance with the handle it returned; the decode side's answer (plain or
streamed, usage included, cached_tokens = the decode side's hit) goes back to the client unchanged.
Errors: an error body from either side is passed through, except a decode side's refusal of the transfer
handle (the proxy's doing, not the client's: a 502 `kv_transfer_refused` carrying its reason); an
unreachable instance is a 502, a timeout a 504 and an upstream error without an OpenAI body a 502, each
with an OpenAI-style error body; a decode stream that breaks ends with an error event. When
the decode side fails, refuses or the client leaves before it answered, the proxy tells the prefill side
to release the held KV at once (not after its hold timeout); a client that leaves cancels the upstream
request, streamed or not (which aborts it there). Instances are taken round robin. Torch-free.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import zmq
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from recap.disagg.api import PARAM
from recap.disagg.zmq_transport import send_release
from recap.server.disconnect import ClientGone, race_disconnect
from recap.server.errors import APIError
from recap.server.guard import Guard
from recap.server.json_body import parse_json
from recap.server.limits import ServerLimits, check_body, server_limits
from recap.server.sse import SSE_DONE, SSEResponse, sse

log = logging.getLogger("recap.proxy")
ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class ProxyConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("the proxy needs at least one prefill and one decode instance")
        for url in (*self.prefill_urls, *self.decode_urls):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"instance URL {url!r} must start with http:// or https://")


def _upstream_error(side: str, url: str, err: httpx.HTTPError) -> APIError:
    if isinstance(err, httpx.TimeoutException):
        return APIError(f"the {side} instance at {url} timed out", status=504, type="upstream_error",
                        code="upstream_timeout")
    return APIError(f"the {side} instance at {url} is unreachable: {type(err).__name__}: {err}", status=502,
                    type="upstream_error", code="upstream_unreachable")


def _passthrough(r: httpx.Response, content: bytes) -> Response:
    return Response(content, status_code=r.status_code, media_type=r.headers.get("content-type", "application/json"))


def _error_of(content: bytes) -> dict[str, Any] | None:
    """The `error` object of an OpenAI error body, or None."""
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return None
    return error if isinstance(error, dict) else None


def _answer(side: str, url: str, r: httpx.Response, content: bytes) -> Response:
    """An upstream's non-200 answer for the client: an OpenAI error body passes through, except the decode
    side refusing the transfer handle the proxy sent (a 502 kv_transfer_refused with its reason); any other
    answer (a bare 500, an HTML page) becomes a 502 with a JSON error body."""
    error = _error_of(content)
    refused = side == "decode" and error is not None and (error.get("param") == PARAM
                                                           or error.get("code") == "kv_transfer_refused")
    if error is not None and not refused:  # an OpenAI error body (a 4xx, or the upstream's own 502/504)
        return _passthrough(r, content)
    reason = str(error.get("message")) if error is not None else content[:500].decode(errors="replace")
    if refused:
        return APIError(f"the decode instance at {url} refused the KV transfer handle ({r.status_code}): {reason}",
                        status=502, type="upstream_error", code="kv_transfer_refused").response()
    return APIError(f"the {side} instance at {url} failed ({r.status_code}): {reason}", status=502,
                    type="upstream_error", code="upstream_failed").response()


class Proxy:
    def __init__(self, config: ProxyConfig, limits: ServerLimits, api_key: str | None = None) -> None:
        self.config = config
        self.limits = limits
        self._prefill: Iterator[str] = itertools.cycle([u.rstrip("/") for u in config.prefill_urls])
        self._decode: Iterator[str] = itertools.cycle([u.rstrip("/") for u in config.decode_urls])
        headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}  # the deployment's key
        self.client = httpx.AsyncClient(timeout=config.timeout_s, headers=headers)
        self._zmq = zmq.Context()  # releases to prefill sides (recap.disagg.zmq_transport.send_release)

    def close(self) -> None:
        threading.Thread(target=self._zmq.term, name="recap-proxy-zmq-term", daemon=True).start()

    async def route(self, request: Request, path: str) -> Response:
        body = parse_json(await request.body(), self.limits.max_json_depth)
        check_body(body, self.limits)
        try:
            return await race_disconnect(request, self._route(body, path))  # cancelling closes the upstream request
        except ClientGone:
            return Response(status_code=499)

    async def _route(self, body: dict[str, Any], path: str) -> Response:
        if PARAM in body:
            raise APIError(f"{PARAM} is set by the proxy, not by clients", param=PARAM)
        prefill_url, decode_url = next(self._prefill), next(self._decode)
        first = {k: v for k, v in body.items() if k != "stream_options"}
        first.update(stream=False, **{PARAM: {"do_remote_decode": True}})
        try:
            r = await self.client.post(prefill_url + path, json=first)
        except httpx.HTTPError as e:
            raise _upstream_error("prefill", prefill_url, e) from None
        if r.status_code != 200:
            return _answer("prefill", prefill_url, r, r.content)
        try:
            handle = r.json().get(PARAM)
        except (ValueError, AttributeError):  # not JSON, or not an object
            handle = None
        if not isinstance(handle, dict):
            raise APIError(f"the prefill instance at {prefill_url} returned no {PARAM} (is it --role prefill?)",
                           status=502, type="upstream_error", code="upstream_bad_response")
        second = {**body, PARAM: {**handle, "do_remote_prefill": True}}
        answered = False
        try:
            if body.get("stream") is True:
                response = await self._stream(decode_url + path, second, decode_url)
            else:
                try:
                    r = await self.client.post(decode_url + path, json=second)
                except httpx.HTTPError as e:
                    raise _upstream_error("decode", decode_url, e) from None
                response = _passthrough(r, r.content) if r.status_code == 200 else _answer("decode", decode_url,
                                                                                            r, r.content)
            answered = response.status_code == 200  # a 200 from the decode side comes after its pull
            return response
        finally:
            if not answered:  # the decode side failed, refused or was left: nobody will pull
                self._release(handle)

    def _release(self, handle: dict[str, Any]) -> None:
        """Let the prefill side free the held KV at once (fire and forget, off the loop)."""
        address, tid, mac = handle.get("remote_address"), handle.get("transfer_id"), handle.get("mac")
        if isinstance(address, str) and isinstance(tid, str) and isinstance(mac, str):
            asyncio.get_running_loop().run_in_executor(None, send_release, self._zmq, address, tid, mac)

    async def _stream(self, url: str, body: dict[str, Any], base: str) -> Response:
        try:
            r = await self.client.send(self.client.build_request("POST", url, json=body), stream=True)
        except httpx.HTTPError as e:
            raise _upstream_error("decode", base, e) from None
        if r.status_code != 200:  # the decode side answers errors before its first event
            content = await r.aread()
            await r.aclose()
            return _answer("decode", base, r, content)

        async def events() -> AsyncIterator[bytes | str]:
            tail = b""
            try:
                async for chunk in r.aiter_raw():
                    tail = (tail + chunk)[-64:]
                    yield chunk
                if SSE_DONE.strip().encode() not in tail:
                    raise httpx.RemoteProtocolError("the stream ended before [DONE]")
            except httpx.HTTPError as e:  # the decode instance died mid-stream: tell the client in-stream
                log.warning("decode stream from %s broke: %s: %s", base, type(e).__name__, e)
                err = APIError(f"the decode instance at {base} failed mid-stream: {type(e).__name__}: {e}", status=502,
                               type="upstream_error", code="upstream_stream_broken")
                yield "\n\n" + sse(json.dumps(err.body())) + SSE_DONE
            finally:
                await r.aclose()  # a client that leaves closes the decode stream, which aborts the request

        return SSEResponse(events())


def build_proxy_app(config: ProxyConfig, limits: ServerLimits | None = None, api_key: str | None = None) -> FastAPI:
    """The proxy app; `limits` and `api_key` as for `recap serve` (recap.server.guard; no /debug here)."""
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
    app.add_middleware(Guard, limits=limits, api_key=api_key, admitted=ROUTES)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        log.warning("request failed (%d): %s", exc.status, exc.message)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(str(exc.detail), status=exc.status_code, code="not_found" if exc.status_code == 404 else None
                        ).response()

    for path in ROUTES:
        async def handler(request: Request, _path: str = path) -> Response:
            return await proxy.route(request, _path)

        app.add_api_route(path, handler, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        url = next(proxy._decode)
        try:
            r = await proxy.client.get(url + "/v1/models")
        except httpx.HTTPError as e:
            raise _upstream_error("decode", url, e) from None
        return _passthrough(r, r.content)

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
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = ProxyConfig(tuple(args.prefill), tuple(args.decode), args.timeout)
        limits = server_limits(args)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    from recap.server.timeouts import header_timeout_protocol

    log.info("proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port, config.prefill_urls,
             config.decode_urls)
    uvicorn.run(build_proxy_app(config, limits, args.api_key), host=args.host, port=args.port,
                log_level=args.log_level, access_log=False, http=header_timeout_protocol(limits.header_timeout_s),
                timeout_keep_alive=limits.idle_timeout_s)
    return 0
