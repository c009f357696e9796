"""RecapRequestRouter's hand-over: a replica chosen for one pending request goes to that request."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("ray")
from recap.cluster.ray_router import RecapRequestRouter  # noqa: E402


@dataclass
class Pending:
    metadata: Any
    future: asyncio.Future


@dataclass
class FakeRouter:
    """The parts of Serve's RequestRouter the hand-over uses."""

    _pending_requests_to_fulfill: deque = field(default_factory=deque)
    cancelled: list[Pending] = field(default_factory=list)

    def _cancel_routing_task_for_pending_request(self, pending: Pending) -> None:
        self.cancelled.append(pending)

    def _record_queue_wait_time(self, pending: Pending) -> None:
        pass

    def _remove_pending_request_from_indices(self, pending: Pending) -> None:
        pass

    fulfill = RecapRequestRouter._fulfill_next_pending_request


def test_choice_goes_to_the_request_it_was_made_for_even_with_a_shared_request_id() -> None:
    loop = asyncio.new_event_loop()
    try:
        # Two calls fanned out by one ingress request: same internal id, different pins (metadata objects).
        first, second = (Pending({"internal_request_id": "same", "pin": p}, loop.create_future()) for p in "ab")
        router = FakeRouter(deque([first, second]))
        router.fulfill("replica-b", second.metadata)  # chosen for the second: FIFO would hand it to the first
        assert second.future.result() == "replica-b" and not first.future.done()
        router.fulfill("replica-a", first.metadata)
        assert first.future.result() == "replica-a"
        router.fulfill("replica-a", first.metadata)  # no longer pending: nothing else is fulfilled
        assert router.cancelled == [second, first]
    finally:
        loop.close()
