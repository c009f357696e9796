"""AsyncEngine: the step loop on its own thread, with asyncio streams per request.

Model compute blocks, so it runs on a dedicated thread; the event loop only validates input,
enqueues commands and awaits outputs. A consumer that stops iterating (client disconnect)
aborts its request, which returns its blocks and slots to the pools.
The engine thread keeps the process's OpenMP threads: the thread that built the engine and the one that
starts it give up their OpenMP pools and run later parallel regions on one thread (process/openmp.py: a
second pool made every parallel region of the engine thread ~1.4x slower at 2 threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from recap.engine.errors import EngineDeadError, StepFailedError
from recap.engine.input_processor import PreparedRequest
from recap.engine.llm_engine import LLMEngine
from recap.engine.metrics import MetricsSnapshot
from recap.engine.outputs import RequestOutput
from recap.process.openmp import leave_threads_to_engine
from recap.sampling_params import SamplingParams

log = logging.getLogger("recap.engine")
T = TypeVar("T")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.dead: BaseException | None = None
        # Snapshots taken on the engine thread, so readers never race the step loop.
        self._snapshot: MetricsSnapshot = engine.metrics_snapshot()
        self._integrity: str | None = None
        self._pools: dict[str, int] = {}
        leave_threads_to_engine()  # this thread loaded the model: its OpenMP pool would slow the engine thread's

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def start(self) -> None:
        if self._thread is None:
            leave_threads_to_engine()  # the serving thread, when it is not the one that built the engine
            self._thread = threading.Thread(target=self._loop, name="recap-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._thread is None or not self._thread.is_alive():
            self.engine.close()  # the disk tier's writes, for a restart

    def prepare(self, prompt: str | Sequence[int], params: SamplingParams, **kw: Any) -> PreparedRequest:
        return self.engine.prepare(prompt, params, **kw)

    async def generate(self, prepared: PreparedRequest) -> AsyncIterator[RequestOutput]:
        """Stream outputs of a validated request until it finishes; aborts it if the consumer leaves."""
        if self.dead is not None:
            raise EngineDeadError(f"engine stopped: {self.dead!r}")
        self.start()
        rid = prepared.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already running")
            self._streams[rid] = stream
        self._commands.put(("add", prepared))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if finished and item.internal_error:
                    raise StepFailedError(item.error or "the engine step running this request failed")
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def metrics(self) -> MetricsSnapshot:
        return self._snapshot

    async def check_integrity(self) -> str | None:
        """Run the core's integrity check on the engine thread; None when it holds, else the message."""
        done = threading.Event()
        self._commands.put(("integrity", done))
        await asyncio.get_running_loop().run_in_executor(None, done.wait, 30)
        return self._integrity

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps (reads the cache core without racing it)."""
        if self.dead is not None:
            raise EngineDeadError(f"engine stopped: {self.dead!r}")
        self.start()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._commands.put(("call", (fn, future, loop)))
        return await future

    @property
    def num_streams(self) -> int:
        """Requests with an open output stream (0 when nothing is in flight)."""
        with self._lock:
            return len(self._streams)

    def pool_usage(self) -> dict[str, int]:
        """KV block and state slot occupancy, read on the engine thread by the last check_integrity()."""
        return dict(self._pools)

    # ---- engine thread ----------------------------------------------------------------------------
    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(rid)
        if stream is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed under us
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _handle(self, kind: str, arg: Any) -> None:
        if kind == "add":
            try:
                self.engine.add_prepared(arg)
            except Exception as e:  # noqa: BLE001 - handed to the waiting client
                self._deliver(arg.request_id, e)
        elif kind == "abort":
            self.engine.abort_request(arg)
        elif kind == "integrity":
            try:
                self.engine.scheduler.check_integrity()
                self._integrity = None
            except AssertionError as e:
                self._integrity = str(e) or "integrity check failed"
            self._pools = _pool_usage(self.engine)
            arg.set()
        elif kind == "call":
            fn, future, loop = arg
            try:
                result = fn(self.engine)
            except Exception as e:  # noqa: BLE001 - handed to the awaiting caller
                _settle(loop, future, e)
            else:
                _settle(loop, future, result)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                block = not self.engine.has_unfinished_requests()
                try:
                    kind, arg = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
                    self._handle(kind, arg)
                    while True:
                        kind, arg = self._commands.get_nowait()
                        self._handle(kind, arg)
                except queue.Empty:
                    pass
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out.request_id, out)
                self._snapshot = self.engine.metrics_snapshot()
        except BaseException as e:  # noqa: BLE001 - fail every waiting request instead of hanging
            log.exception("engine loop died")
            self.dead = e
            with self._lock:
                rids = list(self._streams)
            for rid in rids:
                self._deliver(rid, EngineDeadError(f"engine stopped: {e!r}"))
            while True:  # calls queued behind the failure would wait forever
                try:
                    kind, arg = self._commands.get_nowait()
                except queue.Empty:
                    break
                if kind == "call":
                    _settle(arg[2], arg[1], EngineDeadError(f"engine stopped: {e!r}"))


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], value: Any) -> None:
    """Complete `future` on its own loop from the engine thread (an exception is raised to the awaiter)."""

    def done() -> None:
        if future.done():
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    with contextlib.suppress(RuntimeError):  # the loop closed under us
        loop.call_soon_threadsafe(done)


def _pool_usage(engine: LLMEngine) -> dict[str, int]:
    cache = engine.scheduler.cache
    out = {"num_running": engine.scheduler.num_running, "num_waiting": engine.scheduler.num_waiting,
           "num_unfinished_outputs": len(engine.outputs.parents)}
    if cache.kv is not None:
        kv = cache.kv.pool
        out.update(kv_blocks_total=kv.num_usable, kv_blocks_free=kv.num_free, kv_blocks_in_use=kv.num_in_use,
                   kv_blocks_cached=kv.num_cached)
    if cache.state is not None:
        st = cache.state.pool
        out.update(state_slots_total=st.num_slots, state_slots_free=st.num_free, state_slots_in_use=st.num_in_use,
                   state_checkpoints=st.num_checkpoints)
    return out
