"""Work that must not run on the event loop: parsing, chat rendering and tokenization of large inputs.

The event loop serves every connection (health checks, streams, small requests); a large body or a
conversation with thousands of messages takes the CPU for a while, so it runs on a small thread pool
instead and the loop only awaits it. Small inputs stay inline: a thread hop costs more than they do.
The GIL is shared, but the interpreter switches threads every few milliseconds (and the tokenizer
releases it), so the loop keeps answering while a pool thread works.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

INLINE_CHARS = 16_384  # inputs up to this size (characters, bytes or tokens) are prepared on the loop


class Offloader:
    def __init__(self, max_workers: int = 2, inline_size: int = INLINE_CHARS) -> None:
        self.inline_size = inline_size
        self._max_workers = max_workers
        self._pool: ThreadPoolExecutor | None = None

    async def run(self, size: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """fn(*args, **kwargs): inline when `size` is small, else on the pool (exceptions propagate)."""
        if size <= self.inline_size:
            return fn(*args, **kwargs)
        return await self.off_loop(fn, *args, **kwargs)

    async def off_loop(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """fn(*args, **kwargs) on the pool whatever its size (work whose cost the input's size does not bound)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="recap-prepare")
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
