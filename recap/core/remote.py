"""The scheduler's disaggregation methods (a mixin of `Scheduler`; the bookkeeping is in recap.core.transfer).

Prefill side: `hold_on_finish` marks a request; when it finishes its blocks (the window group's too),
running slot and the checkpoints on its chain are held (`held`) until `release_held`. Decode side: `add_remote_request`
queues a request computed elsewhere (status WAITING_FOR_REMOTE_KV); `start_receives` allocates for it
(first come first served; a receiving request counts against max_num_seqs); `finish_receive` registers
what arrived and lets it decode from position prompt_len with the remote first token; `fail_receive`
frees everything and either re-queues it for local prefill or finishes it with FINISHED_ERROR.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from recap.config import SchedulerConfig
from recap.core.cache_manager import CacheHit, CacheManager
from recap.core.output import CheckpointWrite
from recap.core.request import Request, RequestStatus
from recap.core.stats import RequestUpdate
from recap.core.transfer import HeldRequest, ReceivePlan, RemoteBook, RemoteOffer, check_offer, plan_receive, release


class RemoteScheduling:
    """Disaggregation methods over the Scheduler's queues. Side effects: see each method."""

    # Provided by Scheduler.
    config: SchedulerConfig
    cache: CacheManager
    remote: RemoteBook
    _requests: dict[str, Request]
    _running: list[Request]
    _waiting: deque[Request]
    _updates: list[RequestUpdate]

    def _finish(self, request: Request, status: RequestStatus) -> None:
        raise NotImplementedError

    def _record_hit(self, request: Request, hit: CacheHit) -> None:
        raise NotImplementedError

    def _check_stop(self, request: Request, token: int, num_tokens: int) -> RequestStatus | None:
        raise NotImplementedError

    @property
    def num_receiving(self) -> int:
        """Remote requests holding blocks and a slot while their data is in flight."""
        return len(self.remote.receiving)

    @property
    def num_remote_queued(self) -> int:
        return len(self.remote.queue)

    # -- prefill side ----------------------------------------------------------------------------
    def hold_on_finish(self, request_id: str) -> None:
        """When this request finishes (stop or length, prompt computed), keep its blocks, running slot and
        the checkpoints on its chain for a remote pull instead of freeing them."""
        if request_id not in self._requests:
            raise KeyError(f"unknown request {request_id!r}")
        self.remote.hold_ids.add(request_id)

    def held(self, request_id: str) -> HeldRequest | None:
        return self.remote.held.get(request_id)

    def release_held(self, request_id: str) -> bool:
        """The pull is done (or timed out): free the held request as usual. False if not held."""
        held = self.remote.held.pop(request_id, None)
        if held is not None:
            release(self.cache, held)
        return held is not None

    # -- decode side -------------------------------------------------------------------------------
    def add_remote_request(self, request: Request, offer: RemoteOffer) -> None:
        """Queue a request whose prompt was computed remotely; `start_receives` allocates for it.

        Raises ValueError when the offer disagrees with the request's prompt.
        """
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        check_offer(request, offer, self.cache.window)
        if request.num_prompt_tokens >= self.config.max_model_len or not self.cache.fits_alone(request.num_tokens + 1):
            request.status = RequestStatus.FINISHED_ERROR
            self._updates.append(RequestUpdate(request.request_id, [], request.status, 0))
            return
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.cache.update_hashes(request)
        self._requests[request.request_id] = request
        self.remote.offers[request.request_id] = offer
        self.remote.queue.append(request)

    def start_receives(self) -> list[ReceivePlan]:
        """Allocate for queued remote requests, first come first served, while blocks, slots and seats last."""
        plans: list[ReceivePlan] = []
        book = self.remote
        while book.queue and len(self._running) + len(book.receiving) < self.config.max_num_seqs:
            request = book.queue[0]
            hit = self.cache.find_hit(request)
            plan = plan_receive(self.cache, request, book.offers[request.request_id], hit)
            if plan is None:
                break
            book.queue.popleft()
            book.receiving[request.request_id] = plan
            self._record_hit(request, hit)
            plans.append(plan)
        return plans

    def finish_receive(self, request_id: str, written: Iterable[CheckpointWrite]) -> bool:
        """The plan's data is in place: register the received full blocks and the checkpoints the worker
        reports written (provenance-checked against the plan), append the remote first token and
        continue decoding. False if the request is no longer receiving (aborted)."""
        plan = self.remote.receiving.pop(request_id, None)
        if plan is None:
            return False
        self.remote.offers.pop(request_id)
        request = self._requests[request_id]
        request.num_computed_tokens = plan.num_prompt_tokens
        self.cache.commit(request, list(written), bool(plan.checkpoints))
        request.status = RequestStatus.RUNNING
        self._running.append(request)
        token = plan.first_token_id
        request.output_token_ids.append(token)
        self.cache.update_hashes(request)
        status = self._check_stop(request, token, request.num_tokens)
        if status is not None:
            self._finish(request, status)
        self._updates.append(RequestUpdate(request_id, [token], status, request.num_cached_tokens))
        return True

    def fail_receive(self, request_id: str, *, fallback: bool) -> bool:
        """The transfer failed: free what was allocated, then either prefill locally (`fallback`) or finish
        the request with FINISHED_ERROR (no update: the caller reports the error). False if not remote."""
        request = self._requests.get(request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            return False
        if not fallback:
            self._finish(request, RequestStatus.FINISHED_ERROR)
            return True
        self.remote.drop(request)
        self.cache.free(request)
        request.status = RequestStatus.WAITING
        self._waiting.appendleft(request)
        return True
