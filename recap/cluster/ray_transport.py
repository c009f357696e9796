"""The KV transfer between prefill and decode replicas on Ray Serve (recap.disagg.transport's protocol).

A prefill replica's address is `ray://app/deployment/replica_id`. Its `kv_pull`, `kv_release` and `kv_accept`
methods (recap.cluster.replica) answer with the shared prefill-side code (`answer_pull`, `answer_release`); the
gathered tensors (the state checkpoint and running state, and only the KV blocks the decode side asked
for, which are the ones it lacks) are put in Ray's object store by the prefill replica, and the reply
carries the object reference. A decode replica calls those methods from its pull threads over a
DeploymentHandle pinned to the replica the handle names (recap.cluster.router: a pin to a dead replica
falls back to a live one, which does not hold the transfer and refuses it: 502), then fetches the frames
from the object store. It writes and registers them as with any transport (recap.disagg.engine): the
hashes are its own (DESIGN invariant 7), and handles are signed and checked as in recap.disagg.trust
(the decode side's peer is the prefill deployment, `ray://app/deployment`).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray
from ray import serve
from ray.exceptions import GetTimeoutError, RayError

from recap.cluster.ray_router import ROUTE_KWARG
from recap.disagg.transport import Gather, Outbox, Transport, answer_accept, answer_pull, answer_release
from recap.engine.errors import KVTransferError

log = logging.getLogger("recap.cluster")
_ADDRESS = re.compile(r"ray://([A-Za-z0-9_.\-]+)/([A-Za-z0-9_.\-]+)/([A-Za-z0-9_.\-]+)")


def replica_address(app: str, deployment: str, replica_id: str) -> str:
    return f"ray://{app}/{deployment}/{replica_id}"


def deployment_peer(app: str, deployment: str) -> str:
    """The decode side's `peers` entry admitting every replica of a prefill deployment."""
    return f"ray://{app}/{deployment}"


def parse_address(address: str) -> tuple[str, str, str]:
    m = _ADDRESS.fullmatch(address)
    if m is None:
        raise KVTransferError(f"{address!r} is not a Ray prefill replica address (ray://app/deployment/replica)", 502)
    return m.group(1), m.group(2), m.group(3)


class RayTransport(Transport):
    """One replica's end. Prefill: `serve` records the outbox that `answer` and `acknowledge` (called by the
    replica's kv_pull / kv_release) read. Decode: `pull` and `release` call a prefill replica."""

    def __init__(self, app: str, deployment: str, replica_id: str) -> None:
        self.address = replica_address(app, deployment, replica_id)
        self._served: tuple[Outbox, Gather, Callable[[], None]] | None = None
        self._handles: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()
        self.num_sent = 0

    # -- prefill side --------------------------------------------------------------------------------
    def serve(self, outbox: Outbox, gather: Gather, on_ack: Callable[[], None]) -> str:
        self._served = (outbox, gather, on_ack)
        return self.address

    def answer(self, header: dict[str, Any]) -> dict[str, Any]:
        """A pull's reply; with data, the frames as one object in Ray's object store under "frames_ref".
        Runs on a worker thread of the replica (the gather copies the held blocks and slots)."""
        if self._served is None:
            return {"ok": False, "error": "this replica is not a prefill replica"}
        outbox, gather, _ = self._served
        reply, frames = answer_pull(outbox, gather, header)
        if reply["ok"]:
            reply["frames_ref"] = ray.put([np.frombuffer(f, dtype=np.uint8) for f in frames])
            self.num_sent += 1
        return reply

    def acknowledge(self, transfer_id: str, mac: str) -> bool:
        if self._served is None:
            return False
        outbox, _, on_ack = self._served
        return answer_release(outbox, transfer_id, mac, on_ack)

    def keep(self, transfer_id: str, mac: str) -> bool:
        """A decode replica accepted the handle (its kv_accept): hold until its pull or the hold timeout."""
        return self._served is not None and answer_accept(self._served[0], transfer_id, mac)

    # -- decode side ---------------------------------------------------------------------------------
    def _handle(self, app: str, deployment: str) -> Any:
        with self._lock:
            handle = self._handles.get((app, deployment))
            if handle is None:
                handle = self._handles[(app, deployment)] = serve.get_deployment_handle(deployment, app)
            return handle

    def _call(self, address: str, method: str, *args: Any) -> Any:
        app, deployment, replica = parse_address(address)
        handle = self._handle(app, deployment).options(method_name=method)
        return handle.remote(*args, **{ROUTE_KWARG: {"pin": replica}})

    def pull(self, address: str, header: dict[str, Any], timeout_s: float) -> tuple[dict[str, Any], Sequence[Any]]:
        try:
            reply = self._call(address, "kv_pull", header).result(timeout_s=timeout_s)
            if not reply.get("ok"):
                raise KVTransferError(f"the prefill replica {address} refused the transfer: {reply.get('error')}", 502)
            frames = ray.get(reply.pop("frames_ref"), timeout=timeout_s)
        except (TimeoutError, GetTimeoutError):
            raise KVTransferError(f"the KV transfer from {address} timed out after {timeout_s:g}s", 504) from None
        except RayError as e:
            raise KVTransferError(f"the prefill replica {address} went away during the KV transfer: "
                                  f"{type(e).__name__}", 502) from None
        self.release(address, header["transfer_id"], header["mac"])  # the data is here: free the held request
        return reply, frames

    def release(self, address: str, transfer_id: str, mac: str) -> None:
        self._tell(address, "kv_release", transfer_id, mac)

    def accept(self, address: str, transfer_id: str, mac: str) -> None:
        self._tell(address, "kv_accept", transfer_id, mac)

    def _tell(self, address: str, method: str, transfer_id: str, mac: str) -> None:
        try:
            self._call(address, method, transfer_id, mac)  # fire and forget
        except Exception as e:  # noqa: BLE001 - best effort: the hold (or accept) timeout frees it otherwise
            log.warning("%s of %s at %s failed: %r", method, transfer_id, address, e)

    def close(self) -> None:
        self._served = None
