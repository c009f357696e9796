"""How held KV moves from a prefill instance to a decode instance: the `Transport` interface, the prefill
side's `Outbox` of held transfers, and the protocol both sides speak over any transport.

Protocol (each message a JSON-able header; data replies add the tensors as raw byte frames):
  decode  -> prefill  pull {"transfer_id", "mac", "blocks", "checkpoints", "window_blocks", "prompt_digest"}: the
                      blocks (indices into the held block table) the decode side lacks, the checkpoint
                      positions it wants, and the sliding-window blocks it lacks (indices into the held run)
  prefill -> decode   {"ok": true, header of recap.disagg.worker.gather} + tensor frames,
                      or {"ok": false, "error": message}
  decode  -> prefill  release {"transfer_id", "mac"}: the data arrived (or nobody will pull), the held request
                      may go now rather than at its hold timeout.
  decode  -> prefill  accept {"transfer_id", "mac"}: the decode side verified the handle and queued its request
                      (the pull follows when it has room): the hold waits up to its hold timeout, where one
                      nobody accepted (or pulled) goes at the shorter accept timeout.
`answer_pull`, `answer_release` and `answer_accept` are the prefill side of it, shared by every transport.
Implementations: recap.disagg.zmq_transport (pyzmq over TCP, `recap serve --role`) and
recap.cluster.ray_transport (Ray actors, the frames through Ray's object store, `recap serve
--prefill-replicas/--decode-replicas`).

The `Outbox` is the only state a transport shares with the engine thread: held transfers it may read (a
claimed one is never released under it) and the ones to release (acknowledged or expired).
"""

from __future__ import annotations

import hmac
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from recap.core.transfer import HeldRequest

Frame = bytes | memoryview  # or any object with the buffer protocol (a numpy array)
# (held, KV block indices, checkpoint positions, window block indices) -> reply header, tensor frames
Gather = Callable[[HeldRequest, Sequence[int], Sequence[int], Sequence[int]], tuple[dict[str, Any], list[memoryview]]]


@dataclass
class _Entry:
    held: HeldRequest
    deadline: float
    mac: str = ""  # the handle's tag: a pull must carry it (recap.disagg.trust)
    accept_deadline: float = float("inf")  # released then unless a decode side accepted or pulled it
    client: str = ""  # who asked for the hold (the per-client cap counts by it)
    busy: bool = False
    acked: bool = False
    accepted: bool = False


class Outbox:
    """Held transfers by id, shared by the engine thread (publish, take) and the server thread (claim, ack)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self.num_expired = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def publish(self, transfer_id: str, held: HeldRequest, deadline: float, mac: str = "",
                accept_deadline: float = float("inf"), client: str = "") -> None:
        with self._lock:
            self._entries[transfer_id] = _Entry(held, deadline, mac, min(accept_deadline, deadline), client)

    def holds(self, client: str) -> tuple[int, int]:
        """(all holds, those of `client`)."""
        with self._lock:
            return len(self._entries), sum(e.client == client for e in self._entries.values())

    def accept(self, transfer_id: str, mac: str) -> bool:
        """A decode side took the handle: wait for its pull up to the hold deadline. False if unknown or `mac`
        is not the handle's tag."""
        with self._lock:
            entry = self._signed(transfer_id, mac)
            if entry is None:
                return False
            entry.accepted = True
            return True

    def claim(self, transfer_id: str, mac: str = "") -> HeldRequest | None:
        """Reserve a live transfer for sending (it cannot be released until `unclaim`); None if gone, or
        when `mac` is not the tag of its handle."""
        with self._lock:
            entry = self._signed(transfer_id, mac)
            if entry is None or entry.busy or entry.acked:
                return None
            entry.busy = entry.accepted = True
            return entry.held

    def unclaim(self, transfer_id: str) -> None:
        with self._lock:
            entry = self._entries.get(transfer_id)
            if entry is not None:
                entry.busy = False

    def ack(self, transfer_id: str, mac: str = "") -> bool:
        """Mark a transfer done (released between steps); False if unknown or `mac` is not its handle's tag."""
        with self._lock:
            entry = self._signed(transfer_id, mac)
            if entry is None:
                return False
            entry.acked = True
            return True

    def _signed(self, transfer_id: str, mac: str) -> _Entry | None:
        """The live entry of `transfer_id` when `mac` is its handle's tag (call under the lock)."""
        entry = self._entries.get(transfer_id)
        return entry if entry is not None and hmac.compare_digest(entry.mac, mac) else None

    def _due(self, entry: _Entry, now: float) -> bool:
        expired = now >= entry.deadline or (not entry.accepted and now >= entry.accept_deadline)
        return not entry.busy and (entry.acked or expired)

    def has_due(self, now: float) -> bool:
        with self._lock:
            return any(self._due(e, now) for e in self._entries.values())

    def take_due(self, now: float) -> list[str]:
        """Remove and return the transfers to release: acknowledged, or expired and not being sent."""
        with self._lock:
            due = [tid for tid, e in self._entries.items() if self._due(e, now)]
            for tid in due:
                if not self._entries.pop(tid).acked:
                    self.num_expired += 1
            return due


def answer_pull(outbox: Outbox, gather: Gather, header: dict[str, Any], delay_s: float = 0.0
                ) -> tuple[dict[str, Any], list[memoryview]]:
    """The prefill side's answer to one pull: the data, or {"ok": False, "error"} (never raises)."""
    tid = str(header.get("transfer_id"))
    held = outbox.claim(tid, str(header.get("mac", "")))
    if held is None:
        return {"ok": False, "error": f"transfer {tid!r} is unknown, expired or taken"}, []
    try:
        if delay_s:
            time.sleep(delay_s)
        if header.get("prompt_digest") != held.offer().prompt_digest:
            return {"ok": False, "error": "the pull names another prompt"}, []
        meta, frames = gather(held, header.get("blocks", []), header.get("checkpoints", []),
                              header.get("window_blocks", []))
        return {"ok": True, "transfer_id": tid, **meta}, frames
    except Exception as e:  # noqa: BLE001 - reported to the decode side
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}, []
    finally:
        outbox.unclaim(tid)


def answer_release(outbox: Outbox, transfer_id: str, mac: str, on_ack: Callable[[], None]) -> bool:
    """The prefill side's handling of a release; False (and nothing done) unless `mac` is the handle's tag."""
    if outbox.ack(transfer_id, mac):
        on_ack()
        return True
    return False


def answer_accept(outbox: Outbox, transfer_id: str, mac: str) -> bool:
    """The prefill side's handling of an accept; False (and nothing done) unless `mac` is the handle's tag."""
    return outbox.accept(transfer_id, mac)


class Transport(ABC):
    """One instance's end of the KV transfer. The prefill side `serve`s its outbox under an address that its
    handles name; the decode side `pull`s from and `release`s to such addresses (from its own threads, never
    the engine thread)."""

    @abstractmethod
    def serve(self, outbox: Outbox, gather: Gather, on_ack: Callable[[], None]) -> str:
        """Prefill: start answering pulls and releases for `outbox`; the address decode sides reach it at."""

    @abstractmethod
    def pull(self, address: str, header: dict[str, Any], timeout_s: float) -> tuple[dict[str, Any], Sequence[Frame]]:
        """Decode: one pull and its data (reply header, tensor frames), acknowledged. Raises KVTransferError:
        502 when the prefill side cannot be reached, goes away or refuses, 504 after `timeout_s`."""

    @abstractmethod
    def release(self, address: str, transfer_id: str, mac: str) -> None:
        """Tell a prefill side that nobody will pull `transfer_id` (best effort; may block briefly)."""

    @abstractmethod
    def accept(self, address: str, transfer_id: str, mac: str) -> None:
        """Tell a prefill side that this decode side will pull `transfer_id` (best effort; may block briefly)."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving and drop connections (pulls in flight end within their timeout)."""
