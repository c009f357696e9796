"""The pyzmq transport (`recap serve --role prefill|decode`): ZeroMQ over TCP, one JSON header frame plus raw
tensor frames per message, speaking recap.disagg.transport's protocol.

Why ZeroMQ (pyzmq) rather than a torch.distributed process group: there is no rendezvous (a decode
instance connects to whatever prefill address a handle names, and either side may restart at any
time), every wait has a timeout (poll), a peer that dies shows up as a socket event within
milliseconds, and multipart messages carry tensor bytes without pickling.

Sockets: the decode side opens a DEALER socket per pull; the prefill side has one ROUTER socket served by
its own thread. Each message's header carries "op": "pull", "release", or (replies) "data". The proxy and
the decode side send a release also when the decode side is known to be gone (its request failed or was
aborted before the pull), so the prefill side frees at once, not after the hold timeout.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from recap.disagg.transport import Gather, Outbox, Transport, answer_accept, answer_pull, answer_release
from recap.engine.errors import KVTransferError
from recap.process.openmp import leave_threads_to_engine

log = logging.getLogger("recap.disagg")
POLL_MS = 100


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
        leave_threads_to_engine()  # it serializes tensors beside the engine thread (process/openmp.py)
        while not self._stop.is_set():
            if not self._sock.poll(POLL_MS):
                continue
            frames = self._sock.recv_multipart()
            try:
                header = json.loads(frames[-1])
                if header.get("op") == "pull":
                    self._send(frames[0], header)
                elif header.get("op") == "release":
                    answer_release(self.outbox, str(header.get("transfer_id")), str(header.get("mac", "")),
                                   self._on_ack)
                elif header.get("op") == "accept":
                    answer_accept(self.outbox, str(header.get("transfer_id")), str(header.get("mac", "")))
            except Exception:  # noqa: BLE001 - one bad message must not stop the server
                log.exception("KV transfer server: bad message")

    def _send(self, identity: bytes, header: dict[str, Any]) -> None:
        reply, frames = answer_pull(self.outbox, self._gather, header, self._delay)
        self._reply(identity, reply, frames)
        if reply["ok"]:
            self.num_sent += 1

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


def send_release(ctx: zmq.Context, address: str, transfer_id: str, mac: str, linger_ms: int = 1000,
                 op: str = "release") -> None:
    """Tell a prefill side that nobody will pull `transfer_id` (fire and forget; blocks up to `linger_ms`);
    with op "accept", that this side will."""
    assert op in ("release", "accept"), op
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, linger_ms)
    try:
        sock.connect(address)
        sock.send(json.dumps({"op": op, "transfer_id": transfer_id, "mac": mac}).encode())
    finally:
        sock.close()


class ZmqTransport(Transport):
    """A prefill side binds `host:port` (0: any free port); a decode side connects per pull."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, send_delay_s: float = 0.0) -> None:
        self.host, self.port, self.send_delay_s = host, port, send_delay_s
        self.ctx = zmq.Context()
        self.server: TransferServer | None = None

    def serve(self, outbox: Outbox, gather: Gather, on_ack: Callable[[], None]) -> str:
        self.server = TransferServer(self.host, self.port, outbox, gather, on_ack, self.send_delay_s)
        self.server.start()
        return self.server.address

    def pull(self, address: str, header: dict[str, Any], timeout_s: float) -> tuple[dict[str, Any], list[bytes]]:
        return pull(self.ctx, address, {"op": "pull", **header}, timeout_s)

    def release(self, address: str, transfer_id: str, mac: str) -> None:
        send_release(self.ctx, address, transfer_id, mac)

    def accept(self, address: str, transfer_id: str, mac: str) -> None:
        send_release(self.ctx, address, transfer_id, mac, op="accept")

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        # pulls still in flight end within their timeout; never wait for them here
        threading.Thread(target=self.ctx.term, name="recap-kv-ctx-term", daemon=True).start()
