"""The ASGI middleware in front of every route of the server and the proxy (issue 20):

- `--api-key` (recap.http.auth): a 401 before anything else;
- admission: at most `max_queued` generation requests at once (counted from the moment their body is in),
  past that a 429; every 429 and 503 carries Retry-After;
- the body: a Content-Length over `max_body_bytes` is a 413 before a byte is read, a chunked body is
  counted as it arrives (413), and the whole body must arrive within `body_timeout_s` (408);
- the catch-all: an unexpected exception fails only its request (a JSON 500, logged with its cause) and,
  unlike Starlette's own last-resort handler, is not re-raised, so the keep-alive connection stays open.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from recap.http.auth import check_key, needs_key
from recap.http.errors import APIError, from_exception
from recap.http.limits import ServerLimits
from recap.http.request_counts import RequestCounts

log = logging.getLogger("recap.server")


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v
    return None


async def _send_error(send: Send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(
        self, app: ASGIApp, limits: ServerLimits, api_key: str | None, admitted: Iterable[str],
        counts: RequestCounts | None = None, to_error: Callable[[BaseException], APIError] = from_exception,
    ) -> None:
        self.app = app
        self.limits = limits
        self.api_key = api_key
        self.admitted = frozenset(admitted)  # POST paths that count against max_queued (and in `counts`)
        self.counts = counts or RequestCounts()
        self.to_error = to_error  # the catch-all's mapping (the OpenAI app's names the request field)
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False
        status: int | None = None
        completed = False
        retry = (b"retry-after", str(self.limits.retry_after_s).encode())

        async def send_tracked(message: Message) -> None:
            nonlocal started, status, completed
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                completed = True
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
                if message["status"] in (429, 503):
                    message = {**message, "headers": [*message.get("headers", []), retry]}
                elif message["status"] in (408, 413):  # the rest of the body is unread: this connection is done
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        admission = [scope["path"] in self.admitted and scope["method"] == "POST", False]  # [admitted, counted]
        if admission[0]:
            self.counts.receive()
        try:
            self._check_headers(scope)
            await self.app(scope, self._limited(receive, admission), send_tracked)
        except Exception as e:  # noqa: BLE001 - the last resort: fail this request only, keep the connection
            err = self.to_error(e)
            if err.status >= 500:
                log.error("request %s %s failed: %s", scope["method"], scope["path"], err.message, exc_info=e)
            if not started:
                await _send_error(send_tracked, err)
        finally:
            if admission[1]:
                self.in_flight -= 1
            if admission[0]:
                self.counts.finish(status, completed)

    def _check_headers(self, scope: Scope) -> None:
        if self.api_key is not None and needs_key(scope["method"], scope["path"]):
            check_key(self.api_key, _header(scope, b"authorization"))
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limits.max_body_bytes:
            raise self._too_large()

    def _admit(self, admission: list[bool]) -> None:
        """Once the body is in: count the request, or a 429 when max_queued are in already."""
        if not admission[0] or admission[1]:
            return
        if self.in_flight >= self.limits.max_queued:
            raise APIError(f"the server is busy ({self.in_flight} requests in progress, server flag --max-queued); "
                           "retry later", status=429, type="rate_limit_error", code="server_busy")
        self.in_flight += 1
        admission[1] = True

    def _too_large(self) -> APIError:
        return APIError(f"the request body is larger than {self.limits.max_body_bytes} bytes (server flag "
                        "--max-body-bytes)", status=413, code="body_too_large")

    def _limited(self, receive: Receive, admission: list[bool]) -> Receive:
        """`receive` counting body bytes, with a deadline for the whole body, admitting the request once the
        body is complete (a slow body holds no admission slot); after that, unchanged."""
        deadline = time.monotonic() + self.limits.body_timeout_s
        received, complete = 0, False

        async def limited() -> Message:
            nonlocal received, complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except TimeoutError:
                raise APIError(f"the request body did not arrive within {self.limits.body_timeout_s:g}s (server flag "
                               "--body-timeout)", status=408, code="body_timeout") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limits.max_body_bytes:
                    raise self._too_large()
                complete = not message.get("more_body", False)
                if complete:
                    self._admit(admission)
            else:
                complete = True
            return message

        return limited
