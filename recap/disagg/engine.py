"""The engine for `recap serve --role prefill|decode`: LLMEngine plus the connector's two halves.

Prefill role: a request marked `RemoteDecode` runs with max_tokens=1 and is held when it finishes
(Scheduler.hold_on_finish); its output carries the handle (`kv_transfer_params`); the transfer server
thread serves pulls from the `Outbox`; acknowledged or expired transfers are released between steps (a
hold no decode side accepted expires at the accept timeout, an accepted one at the hold timeout). Holds
waiting for their pull are capped, globally and per client (KVTransferConfig.hold_caps): a request past a
cap is a 429 (BusyError) before it is queued, so held state slots leave room for running requests.

Decode role: a request carrying a `RemoteHandle` is queued as remote (Scheduler.add_remote_request);
between steps the engine starts a pull thread for each plan `start_receives` returns, writes what arrived into
the caches (`worker.scatter`) and calls `finish_receive`, so the request decodes on from the prompt end
with the prefill side's first token. A request whose pull cannot start yet (no room) tells its prefill
side it accepted the handle, so the hold waits past the accept timeout. A failed pull fails only its
request (KVTransferError, 502/504) or, with `fallback_local_prefill`, sends it to local prefill; so does a handle
this side cannot resume (another prompt, another model's window layout: else a 502 at once).

All scheduler and cache work happens on the engine thread; the pull and server threads only move bytes.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from recap.core.transfer import HeldRequest, ReceivePlan
from recap.disagg.config import KVTransferConfig, RemoteDecode, RemoteHandle
from recap.disagg.transport import Outbox, Transport
from recap.disagg.trust import HandleVerifier, prompt_fingerprint, sign
from recap.disagg.worker import TransferDataError, from_frames, gather, num_bytes, scatter, to_frame
from recap.disagg.zmq_transport import ZmqTransport
from recap.engine.async_engine import AsyncEngine
from recap.engine.config import EngineConfig
from recap.engine.errors import BusyError, InvalidRequestError, KVTransferError
from recap.engine.input_processor import PreparedRequest
from recap.engine.llm_engine import LLMEngine
from recap.engine.output_processor import child_id
from recap.engine.outputs import RequestOutput
from recap.process.openmp import leave_threads_to_engine

log = logging.getLogger("recap.disagg")

_Result = tuple[dict[str, Any], dict[str, torch.Tensor]] | KVTransferError


@dataclasses.dataclass
class TransferStats:
    """Counters of both roles (read by the Prometheus collector from any thread)."""

    transfers_sent: int = 0  # prefill: pulls answered with data
    transfers_received: int = 0  # decode: pulls written into the caches and registered
    transfers_failed: int = 0  # decode: pulls that failed (each failed or re-prefilled one request)
    fallbacks: int = 0  # decode: failed pulls re-run as local prefill
    holds_expired: int = 0  # prefill: held requests released by timeout (never pulled)
    blocks_sent: int = 0
    blocks_received: int = 0
    blocks_local: int = 0  # decode: full prompt blocks already held locally, so not asked for
    window_blocks_sent: int = 0  # sliding-window blocks (the next token's window, the checkpoints')
    window_blocks_received: int = 0
    checkpoints_sent: int = 0
    checkpoints_received: int = 0
    checkpoints_registered: int = 0
    states_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    requests_held: int = 0  # gauge (prefill)
    transfers_in_flight: int = 0  # gauge (decode)


class DisaggLLMEngine(LLMEngine):
    """Not thread-safe, like LLMEngine; `bind` gives it the async engine's wake and fail callbacks."""

    def __init__(self, config: EngineConfig, transfer: KVTransferConfig, transport: Transport | None = None) -> None:
        super().__init__(config)
        self.transfer_config = transfer
        self.kv_role = transfer.role
        self.stats = TransferStats()
        self._stats_lock = threading.Lock()
        self._wake: Callable[[], None] = lambda: None
        self._fail: Callable[[str, BaseException], None] = lambda rid, err: None
        self._inbox: queue.Queue[tuple[str, _Result]] = queue.Queue()
        self._handles: dict[str, RemoteHandle] = {}  # decode: child id -> handle, until its pull starts
        self._unannounced: list[str] = []  # decode: child ids added since the last step (accept unless pulled)
        self._prefill_ids: dict[str, str] = {}  # prefill: parent ids to hold -> the client that asked
        self._new_remote = False
        self.outbox: Outbox | None = None
        self.address: str | None = None  # prefill: where decode sides pull from (named in every handle)
        if transport is None:
            transport = ZmqTransport(transfer.kv_host, transfer.kv_port, transfer.send_delay_s)
        self.transport = transport
        self.verifier = HandleVerifier(transfer.secret, transfer.peers)  # decode: recap.disagg.api checks with it
        if transfer.role == "prefill":
            self.outbox = Outbox()
            self.address = transport.serve(self.outbox, self._gather, lambda: self._wake())

    def bind(self, wake: Callable[[], None], fail: Callable[[str, BaseException], None]) -> None:
        self._wake, self._fail = wake, fail

    def close(self) -> None:
        self.transport.close()

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    # ---- requests -------------------------------------------------------------------------------
    def add_prepared(self, p: PreparedRequest) -> None:
        if isinstance(p.kv_transfer, RemoteDecode):
            client = p.kv_transfer.client
            self._check_hold_caps(client)
            p = dataclasses.replace(p, max_tokens=1, kv_transfer=None)
            super().add_prepared(p)
            cid = child_id(p.request_id, 0)
            if self.scheduler.get_request(cid) is not None:
                self.scheduler.hold_on_finish(cid)
                self._prefill_ids[p.request_id] = client
            return
        if not isinstance(p.kv_transfer, RemoteHandle):
            return super().add_prepared(p)
        if p.request_id in self.outputs.parents:
            raise InvalidRequestError(f"request id {p.request_id!r} is already running")
        if not self.verifier.is_peer(p.kv_transfer.address):  # recap.disagg.api verified it; this guards others
            raise InvalidRequestError(f"remote_address {p.kv_transfer.address!r} is not a prefill peer (--kv-peer)")
        cid = child_id(p.request_id, 0)
        request = self.processor.make_core_request(p, cid, 0)
        self.outputs.add(p)
        try:
            self.scheduler.add_remote_request(request, p.kv_transfer.offer)
        except ValueError as e:
            self.outputs.remove(p.request_id)
            self._release_remote(p.kv_transfer)
            if self.transfer_config.fallback_local_prefill:  # e.g. a prefill side of another version mid-upgrade
                self._count(fallbacks=1)
                log.warning("request %s: cannot take over the prefilled request (%s); prefilling it locally", cid, e)
                super().add_prepared(dataclasses.replace(p, kv_transfer=None))
                return
            raise KVTransferError(f"cannot take over the prefilled request: {e}", 502) from None
        if self.scheduler.get_request(cid) is None:  # refused at once (does not fit): no pull will come
            self._release_remote(p.kv_transfer)
        else:
            self._handles[cid] = p.kv_transfer
            self._unannounced.append(cid)
        self._new_remote = True

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        super().abort_request(request_ids)
        for cid in [c for c in self._handles if self.scheduler.get_request(c) is None]:
            self._release_remote(self._handles.pop(cid))  # aborted before its pull started

    def _release_remote(self, handle: RemoteHandle) -> None:
        """Nobody here will pull `handle`: let its prefill side free the held KV now (off the engine thread)."""
        self._tell(self.transport.release, handle)

    @staticmethod
    def _tell(send: Callable[[str, str, str], None], handle: RemoteHandle) -> None:
        """A release or accept to `handle`'s prefill side, off the engine thread (it may block briefly)."""
        threading.Thread(target=send, args=(handle.address, handle.transfer_id, handle.mac),
                         name="recap-kv-notify", daemon=True).start()

    def has_unfinished_requests(self) -> bool:
        if not self._inbox.empty() or self._new_remote:
            return True
        if self.outbox is not None and self.outbox.has_due(time.monotonic()):
            return True
        if not super().has_unfinished_requests():
            return False
        s = self.scheduler
        # Requests waiting only on the network need no step: a finished pull wakes the loop.
        return len(self.outputs.parents) > s.num_receiving + s.num_remote_queued or s.has_updates

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.outbox is not None:
            self._release_due()
        if self.kv_role == "decode":
            self._apply_received()
            self._start_pulls()
        results = super().step()
        if self.outbox is not None:
            self._publish_held(results)
        return results

    # ---- prefill side ---------------------------------------------------------------------------
    def _check_hold_caps(self, client: str) -> None:
        """BusyError (429) when the holds waiting for their pull reach a cap. Requests still computing do not
        count: on a prefill instance every request becomes a hold, and the scheduler bounds those (at most
        max_num_seqs run); a slow or absent decode side is what piles up holds."""
        assert self.outbox is not None, "only a prefill instance holds"
        for rid in [r for r in self._prefill_ids if r not in self.outputs.parents]:
            del self._prefill_ids[rid]  # failed or aborted before it was held
        held, of_client = self.outbox.holds(client)
        total_cap, client_cap = self.transfer_config.hold_caps(self.config.scheduler.max_num_seqs)
        if held >= total_cap:
            raise BusyError(f"this prefill instance holds {total_cap} requests for decode instances already "
                            "(--kv-max-holds); retry later", "kv_holds_full")
        if of_client >= client_cap:
            raise BusyError(f"client {client or '?'} has {client_cap} requests held on this prefill instance "
                            "already (--kv-max-holds-per-client); retry later", "kv_holds_full")

    def _publish_held(self, results: list[RequestOutput]) -> None:
        assert self.outbox is not None and self.address is not None
        for out in results:
            if not out.finished or out.request_id not in self._prefill_ids:
                continue
            client = self._prefill_ids.pop(out.request_id)
            cid = child_id(out.request_id, 0)
            held = self.scheduler.held(cid)
            if held is None:
                continue
            tc = self.transfer_config
            handle = RemoteHandle(self.address, cid, self.config.cache.block_size, held.offer(),
                                  expires_at=time.time() + tc.hold_timeout_s)
            r = held.request
            mac = sign(tc.secret, handle.signed_fields(), prompt_fingerprint(r.prompt_token_ids, r.cache_salt))
            now = time.monotonic()
            self.outbox.publish(cid, held, now + tc.hold_timeout_s, mac, now + tc.accept_timeout_s, client)
            out.kv_transfer_params = dataclasses.replace(handle, mac=mac).to_params()
        self.stats.requests_held = len(self.outbox)

    def _release_due(self) -> None:
        assert self.outbox is not None
        expired = self.outbox.num_expired
        for tid in self.outbox.take_due(time.monotonic()):
            self.scheduler.release_held(tid)
        self._count(holds_expired=self.outbox.num_expired - expired)
        self.stats.requests_held = len(self.outbox)

    def _gather(self, held: HeldRequest, blocks: Sequence[int], positions: Sequence[int],
                window_blocks: Sequence[int]) -> tuple[dict, list]:
        """Runs on the transport's thread: the held blocks and slots cannot change until it returns (claimed)."""
        header, tensors = gather(self.runner.caches, held, blocks, positions, window_blocks)
        self._count(transfers_sent=1, blocks_sent=header["num_blocks"], checkpoints_sent=len(header["checkpoints"]),
                    window_blocks_sent=len(header["window_blocks"]), bytes_sent=num_bytes(tensors))
        return header, [to_frame(t) for t in tensors]

    # ---- decode side ----------------------------------------------------------------------------
    def _start_pulls(self) -> None:
        self._new_remote = False
        for plan in self.scheduler.start_receives():
            handle = self._handles.pop(plan.request_id)
            self._count(blocks_local=plan.num_local_blocks, transfers_in_flight=1)
            threading.Thread(target=self._pull, args=(plan, handle), name="recap-kv-pull", daemon=True).start()
        # A pull accepts its hold; a request still waiting for room tells its prefill side it will come.
        for cid in self._unannounced:
            if cid in self._handles:
                self._tell(self.transport.accept, self._handles[cid])
        self._unannounced.clear()

    def _pull(self, plan: ReceivePlan, handle: RemoteHandle) -> None:
        """Runs on a pull thread: bytes in, tensors out, nothing else."""
        leave_threads_to_engine()  # its tensor copies must not build a second OpenMP pool (process/openmp.py)
        header = {"transfer_id": handle.transfer_id, "mac": handle.mac,
                  "blocks": list(plan.block_indices),
                  "checkpoints": [c.write.position for c in plan.checkpoints],
                  "window_blocks": list(plan.window.indices),
                  "prompt_digest": handle.offer.prompt_digest}
        result: _Result
        try:
            reply, frames = self.transport.pull(handle.address, header, self.transfer_config.transfer_timeout_s)
            result = (reply, from_frames(reply, frames))
        except KVTransferError as e:
            result = e
        except Exception as e:  # noqa: BLE001 - bad data fails the request, not the engine
            result = KVTransferError(f"bad KV transfer from {handle.address}: {type(e).__name__}: {e}", 502)
        self._inbox.put((plan.request_id, result))
        self._wake()

    def _apply_received(self) -> None:
        while True:
            try:
                rid, result = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._count(transfers_in_flight=-1)
            plan = self.scheduler.remote.receiving.get(rid)
            if plan is None:
                continue  # aborted while its data was in flight
            if isinstance(result, KVTransferError):
                self._on_failure(rid, result)
                continue
            header, tensors = result
            try:
                written = scatter(self.runner.caches, plan, header, tensors)
            except TransferDataError as e:
                self._on_failure(rid, KVTransferError(f"bad KV transfer: {e}", 502))
                continue
            pool = self.scheduler.cache.state.pool if self.scheduler.cache.state else None
            before = pool.num_created if pool else 0
            self.scheduler.finish_receive(rid, written)
            self._count(transfers_received=1, blocks_received=header["num_blocks"], bytes_received=num_bytes(tensors),
                        window_blocks_received=len(plan.window.indices),
                        checkpoints_received=len(header["checkpoints"]), states_received=int(plan.state_slot >= 0),
                        checkpoints_registered=(pool.num_created - before) if pool else 0)

    def _on_failure(self, rid: str, err: KVTransferError) -> None:
        self._count(transfers_failed=1)
        if self.transfer_config.fallback_local_prefill:
            if self.scheduler.fail_receive(rid, fallback=True):
                self._count(fallbacks=1)
                log.warning("request %s: %s; prefilling it locally", rid, err)
            return
        log.warning("request %s failed: %s", rid, err)
        if self.scheduler.fail_receive(rid, fallback=False):
            parent = self.outputs.child_to_parent.get(rid)
            if parent is not None:
                self.outputs.remove(parent)
                self._fail(parent, err)


class DisaggAsyncEngine(AsyncEngine):
    """AsyncEngine whose loop the transfer threads can wake, and whose requests they can fail."""

    engine: DisaggLLMEngine

    def __init__(self, engine: DisaggLLMEngine) -> None:
        super().__init__(engine)
        engine.bind(self.wake, self._deliver)

    def wake(self) -> None:
        self._commands.put(("wake", None))

    def shutdown(self) -> None:
        super().shutdown()
        self.engine.close()
