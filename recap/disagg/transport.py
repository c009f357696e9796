"""The transport: ZeroMQ over TCP, one JSON header frame plus raw tensor frames per message.

Why ZeroMQ (pyzmq) rather than a torch.distributed process group: there is no rendezvous (a decode
instance connects to whatever prefill address a handle names, and either side may restart at any
time), every wait has a timeout (poll), a peer that dies shows up as a socket event within
milliseconds, and multipart messages carry tensor bytes without pickling.

Messages (decode side: a DEALER socket per pull; prefill side: one ROUTER socket in its own thread):
  decode  -> prefill  {"op": "pull", "transfer_id", "mac", "blocks", "checkpoints", "prompt_digest"}
  prefill -> decode   {"op": "data", "ok": true, header of recap.disagg.worker.gather} + tensor frames
                      or {"op": "data", "ok": false, "error": message}
  decode  -> prefill  {"op": "release", "transfer_id", "mac"}: the data arrived, the held request may go.
  proxy or decode -> prefill  the same release when the decode side is known to be gone (its request failed or
                      was aborted before the pull), so the prefill side frees at once, not after the hold timeout.

The `Outbox` is the only state the server thread shares with the engine thread: held transfers it may
read (a claimed one is never released under it) and the ones to release (acknowledged or expired).
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from recap.core.transfer import HeldRequest
from recap.engine.errors import KVTransferError

log = logging.getLogger("recap.disagg")
POLL_MS = 100


@dataclass
class _Entry:
    held: HeldRequest
    deadline: float
    mac: str = ""  # the handle's tag: a pull must carry it (recap.disagg.trust)
    busy: bool = False
    acked: bool = False


class Outbox:
    """Held transfers by id, shared by the engine thread (publish, take) and the server thread (claim, ack)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self.num_expired = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def publish(self, transfer_id: str, held: HeldRequest, deadline: float, mac: str = "") -> None:
        with self._lock:
            self._entries[transfer_id] = _Entry(held, deadline, mac)

    def claim(self, transfer_id: str, mac: str = "") -> HeldRequest | None:
        """Reserve a live transfer for sending (it cannot be released until `unclaim`); None if gone, or
        when `mac` is not the tag of its handle."""
        with self._lock:
            entry = self._entries.get(transfer_id)
            if entry is None or entry.busy or entry.acked or not hmac.compare_digest(entry.mac, mac):
                return None
            entry.busy = True
            return entry.held

    def unclaim(self, transfer_id: str) -> None:
        with self._lock:
            entry = self._entries.get(transfer_id)
            if entry is not None:
                entry.busy = False

    def ack(self, transfer_id: str, mac: str = "") -> bool:
        """Mark a transfer done (released between steps); False if unknown or `mac` is not its handle's tag."""
        with self._lock:
            entry = self._entries.get(transfer_id)
            if entry is None or not hmac.compare_digest(entry.mac, mac):
                return False
            entry.acked = True
            return True

    def _due(self, entry: _Entry, now: float) -> bool:
        return not entry.busy and (entry.acked or now >= entry.deadline)

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


Gather = Callable[[HeldRequest, Sequence[int], Sequence[int]], tuple[dict[str, Any], list[memoryview]]]


class TransferServer:
    """The prefill side's ROUTER socket, served by one daemon thread."""

    def __init__(
        self, host: str, port: int, outbox: Outbox, gather: Gather, on_ack: Callable[[], None],
        send_delay_s: float = 0.0,
    ) -> None:
        self.outbox = outbox
        self._gather = gather
        self._on_ack = on_ack
        self._delay = send_delay_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://{host}:{port or '*'}")
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="recap-kv-server", daemon=True)
        self.num_sent = 0

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        self._ctx.term()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(POLL_MS):
                continue
            frames = self._sock.recv_multipart()
            try:
                header = json.loads(frames[-1])
                if header.get("op") == "pull":
                    self._send(frames[0], header)
                elif header.get("op") == "release" and self.outbox.ack(str(header.get("transfer_id")),
                                                                       str(header.get("mac", ""))):
                    self._on_ack()
            except Exception:  # noqa: BLE001 - one bad message must not stop the server
                log.exception("KV transfer server: bad message")

    def _send(self, identity: bytes, header: dict[str, Any]) -> None:
        tid = str(header.get("transfer_id"))
        held = self.outbox.claim(tid, str(header.get("mac", "")))
        if held is None:
            return self._reply(identity, {"ok": False, "error": f"transfer {tid!r} is unknown, expired or taken"})
        try:
            if self._delay:
                time.sleep(self._delay)
            if header.get("prompt_digest") != held.offer().prompt_digest:
                return self._reply(identity, {"ok": False, "error": "the pull names another prompt"})
            meta, frames = self._gather(held, header.get("blocks", []), header.get("checkpoints", []))
            self._reply(identity, {"ok": True, "transfer_id": tid, **meta}, frames)
            self.num_sent += 1
        except Exception as e:  # noqa: BLE001 - reported to the decode side
            self._reply(identity, {"ok": False, "error": f"{type(e).__name__}: {e}"})
        finally:
            self.outbox.unclaim(tid)

    def _reply(self, identity: bytes, header: dict[str, Any], frames: Sequence[memoryview] = ()) -> None:
        self._sock.send_multipart([identity, json.dumps({"op": "data", **header}).encode(), *frames], copy=False)


def pull(
    ctx: zmq.Context, address: str, header: dict[str, Any], timeout_s: float
) -> tuple[dict[str, Any], list[bytes]]:
    """Send one pull and wait for its data; acknowledges it. Raises KVTransferError: 502 when the prefill
    instance cannot be reached, goes away or refuses, 504 when nothing arrives within `timeout_s`."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)  # lets the release message out before close
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
    try:
        sock.connect(address)
        sock.send(json.dumps(header).encode())
        frames = _await_reply(sock, monitor, address, time.monotonic() + timeout_s, timeout_s)
        reply = json.loads(frames[0])
        if not reply.get("ok"):
            raise KVTransferError(f"the prefill instance at {address} refused the transfer: {reply.get('error')}", 502)
        sock.send(json.dumps({"op": "release", "transfer_id": header["transfer_id"], "mac": header["mac"]}).encode())
        return reply, frames[1:]
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close()


def _await_reply(
    sock: zmq.Socket, monitor: zmq.Socket, address: str, deadline: float, timeout_s: float
) -> list[bytes]:
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    connected = False
    while (left := deadline - time.monotonic()) > 0:
        events = dict(poller.poll(min(left * 1000, POLL_MS)))
        if sock in events:
            return sock.recv_multipart()
        if monitor in events:
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                raise KVTransferError(f"the prefill instance at {address} went away during the KV transfer", 502)
            elif event == zmq.EVENT_CONNECT_RETRIED and not connected:
                raise KVTransferError(f"cannot reach the prefill instance at {address} for the KV transfer", 502)
    raise KVTransferError(f"the KV transfer from {address} timed out after {timeout_s:g}s", 504)


def send_release(ctx: zmq.Context, address: str, transfer_id: str, mac: str, linger_ms: int = 1000) -> None:
    """Tell a prefill side that nobody will pull `transfer_id` (fire and forget; blocks up to `linger_ms`)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, linger_ms)
    try:
        sock.connect(address)
        sock.send(json.dumps({"op": "release", "transfer_id": transfer_id, "mac": mac}).encode())
    finally:
        sock.close()
