"""A client must send its request headers within `header_timeout_s`, or its connection is closed.

uvicorn times out only idle keep-alive connections (between requests); a connection that opens and sends
nothing, or drips its headers a byte at a time, is held forever, so a few hundred of them take every
file descriptor. The protocol below arms a timer when a connection opens and whenever a new request
begins, and disarms it when the headers are complete (the body has its own deadline: recap.http.guard).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from recap.http.limits import ServerLimits


def header_timeout_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with a header deadline (pass as uvicorn's `http=`)."""

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


def run_server(app: ASGIApp, host: str, port: int, log_level: str, limits: ServerLimits) -> None:
    """Serve `app` under uvicorn with the limits' connection timeouts (header deadline, keep-alive)."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False,
                http=header_timeout_protocol(limits.header_timeout_s), timeout_keep_alive=limits.idle_timeout_s)
