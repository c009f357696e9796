"""One HTTP request through an ASGI app in-process, its response streamed back as it is produced.

A replica runs the single-instance FastAPI app (recap.server.app) unchanged; the ingress hands it the
request's bytes over Ray and relays what comes back. Closing the stream early (the client left, Ray
cancelled the call) tells the app the client disconnected, so it aborts the engine request and the
request's blocks and slots return to the pools, exactly as behind uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message

REPLICA_HEADER = b"x-recap-replica"  # every replica response names its replica
DISCONNECT_GRACE_S = 5.0  # how long the app may take to clean up after a disconnect before it is cancelled


@dataclass(frozen=True)
class HTTPRequest:
    """What crosses from the ingress to a replica: a plain, picklable HTTP request."""

    method: str
    path: str
    body: bytes = b""
    query: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()


@dataclass(frozen=True)
class ResponseStart:
    """The first item of a streamed response: status and headers; body chunks (bytes) follow."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name), None)


def _scope(request: HTTPRequest) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
        "query_string": request.query, "root_path": "", "headers": list(request.headers),
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {},
    }


async def call_asgi(app: ASGIApp, request: HTTPRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Yields the ResponseStart, then the body chunks. Raises what the app raised, if it sent nothing."""
    out: asyncio.Queue[Message | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await out.put(message)

    async def run() -> None:
        try:
            await app(_scope(request), receive, send)
        finally:
            out.put_nowait(None)

    task = asyncio.create_task(run())
    started = False
    try:
        while (message := await out.get()) is not None:
            if message["type"] == "http.response.start":
                started = True
                yield ResponseStart(message["status"], tuple((bytes(k), bytes(v)) for k, v in message["headers"]))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        if not started:
            await task  # raises the app's own error
            raise RuntimeError("the app finished without a response")
    finally:
        disconnected.set()
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_GRACE_S)
        if not done:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task  # collects its outcome (an error after the response started was logged by the app)
