"""Server-sent events: the streaming response that always closes its body generator, and errors as events."""

from __future__ import annotations

import json

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from recap.http.errors import APIError

SSE_DONE = "data: [DONE]\n\n"


def sse(data: str) -> str:
    return f"data: {data}\n\n"


def sse_event(err: APIError) -> str:
    """An error after the 200 went out: its OpenAI error body as one event (the stream then ends)."""
    return sse(json.dumps(err.body()))


class SSEResponse(StreamingResponse):
    """Starlette cancels the sending task when the client disconnects; if that happens while the
    body generator is parked at a `yield` the generator would only be closed by the garbage
    collector. Closing it here runs its cleanup at once (which aborts the engine requests)."""

    def __init__(self, content: object) -> None:
        super().__init__(content, media_type="text/event-stream",  # type: ignore[arg-type]
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
