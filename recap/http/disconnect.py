"""A request's client leaving: wait for it, or race it against the work done for that client.

Light on purpose (no engine import): the proxy uses it too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so receive() waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """Await `aw` unless the client disconnects first: then cancel it and raise ClientGone."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.create_task(wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()
