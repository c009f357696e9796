"""The ASGI middleware in front of every route of the server and the proxy (issue 20):

- `--api-key` (recap.http.auth): a 401 before anything else;
- admission: at most `max_queued` generation sequences at once (n x prompts: each sequence costs engine
  time alike). A request holds one from the moment its body is in; once parsed, the handler reserves its
  full count (`reserve_sequences`). Past the limit a 429; a request that alone asks for more than the limit
  can never run, so it is a 400. Every 429 and 503 carries Retry-After;
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
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from recap.http.auth import check_key, needs_key
from recap.http.errors import APIError, from_exception
from recap.http.limits import ServerLimits
from recap.http.request_counts import RequestCounts

log = logging.getLogger("recap.server")

TICKET = "recap.admission"  # the scope key of a generation request's `Ticket`


@dataclass
class Ticket:
    """What one admitted request holds of `Guard.in_flight` (0 until its body is in, then its sequences)."""

    guard: Guard
    held: int = 0

    def reserve(self, sequences: int) -> None:
        """Hold `sequences` (the request's n x prompts) in all: a 400 when that alone is over the limit,
        a 429 when the server has no room for the rest now."""
        limit = self.guard.limits.max_queued
        if sequences > limit:
            raise APIError(f"n x prompts: this request asks for {sequences} sequences, at most {limit} are allowed "
                           "at once (server flag --max-queued)", param="n", code="limit_exceeded")
        extra = sequences - self.held
        if extra > 0 and self.guard.in_flight + extra > limit:
            raise self.guard.busy()
        self.guard.in_flight += max(extra, 0)
        self.held = max(sequences, self.held)


def reserve_sequences(scope: Scope, sequences: int) -> None:
    """A parsed generation request's sequences against --max-queued (raises APIError 400 / 429); no-op for a
    request the guard does not admit (an app without the guard, in tests)."""
    ticket = scope.get(TICKET)
    if ticket is not None:
        ticket.reserve(sequences)


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

        admitted = scope["path"] in self.admitted and scope["method"] == "POST"
        ticket = Ticket(self)
        if admitted:
            self.counts.receive()
            scope[TICKET] = ticket
        try:
            self._check_headers(scope)
            await self.app(scope, self._limited(receive, ticket if admitted else None), send_tracked)
        except Exception as e:  # noqa: BLE001 - the last resort: fail this request only, keep the connection
            err = self.to_error(e)
            if err.status >= 500:
                log.error("request %s %s failed: %s", scope["method"], scope["path"], err.message, exc_info=e)
            if not started:
                await _send_error(send_tracked, err)
        finally:
            self.in_flight -= ticket.held
            if admitted:
                self.counts.finish(status, completed)

    def _check_headers(self, scope: Scope) -> None:
        if self.api_key is not None and needs_key(scope["method"], scope["path"]):
            check_key(self.api_key, _header(scope, b"authorization"))
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limits.max_body_bytes:
            raise self._too_large()

    def busy(self) -> APIError:
        return APIError(f"the server is busy ({self.in_flight} sequences in progress, server flag --max-queued); "
                        "retry later", status=429, type="rate_limit_error", code="server_busy")

    def _too_large(self) -> APIError:
        return APIError(f"the request body is larger than {self.limits.max_body_bytes} bytes (server flag "
                        "--max-body-bytes)", status=413, code="body_too_large")

    def _limited(self, receive: Receive, ticket: Ticket | None) -> Receive:
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
                if complete and ticket is not None:
                    ticket.reserve(1)  # once the body is in, the request holds one sequence
            else:
                complete = True
            return message

        return limited
