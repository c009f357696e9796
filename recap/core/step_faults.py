"""A step the runner failed to execute: nothing it computed counts, its requests are retried apart, and the one
that fails again alone is the one that ends with an error. Every other request goes on.

Nothing of a step is registered before its update (blocks and checkpoints are committed from the runner's
report, DESIGN invariant 2), so a step that raised left no trace the cache can read: the slots and blocks it
may have half written belong to its own requests, and those are preempted (recompute: they keep their tokens
and resume from what the cache held before the step) or finished here, which frees them.

Blame without knowing the culprit: each request of a failed step becomes a *suspect* until it has computed
past the failed chunk's end (`Request.suspect_until`). A step holds one suspect at most, so a failure of a
step with a suspect is blamed on it: it ends with FINISHED_ERROR, the step's others are only preempted (were
one of them the culprit, its next failure would make it a suspect). A request that poisons every batch it
joins thus costs its neighbours a recompute or two, not their answers.

The step's tier orders may or may not have run (the runner may have raised anywhere): its loads are cancelled
(their requests queue again and recompute; the runner discards data still arriving for them), its saves are
forgotten and their copies dropped with the step's drops (core/tiers.py `undo`), so each store ends holding
at most what its index says.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from recap.core.request import Request, RequestStatus
from recap.core.stats import RequestUpdate

if TYPE_CHECKING:
    from recap.core.cache_manager import CacheManager
    from recap.core.output import SchedulerOutput
    from recap.core.stats import SchedulerCounters
    from recap.core.tiers import TierManager


class StepFaults:
    """Mixed into Scheduler, which provides these attributes and `_finish`, `_preempt`, `_drain`."""

    cache: CacheManager
    counters: SchedulerCounters
    tiers: TierManager | None
    _requests: dict[str, Request]
    _waiting: deque[Request]
    _flight: list[SchedulerOutput]
    _pins: dict[int, list[int]]
    _finished_ids: set[str]

    def fail_step(self, out: SchedulerOutput) -> list[RequestUpdate]:
        """The runner raised executing `out` (the oldest step in flight; any step before it is updated). Returns
        the requests finished with FINISHED_ERROR: the suspects of the step."""
        if out.scheduled:
            if not self._flight or out is not self._flight[0]:
                raise RuntimeError(f"step {out.step} is not the oldest step in flight")
            self._flight.pop(0)
        self.cache.unpin(self._pins.pop(out.step, ()))
        self.counters.num_failed_steps += 1
        if self.tiers is not None:
            for rid in self.tiers.undo(out):
                request = self._requests[rid]
                request.status = RequestStatus.WAITING
                self._waiting.appendleft(request)
                self._finished_ids.add(rid)  # the runner discards what its load still delivers
        failed: list[RequestUpdate] = []
        rows = [self._requests.get(sr.request_id) for sr in out.scheduled]
        for request in rows:
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished while the step ran: freed already
            if request.suspect_until:
                self._finish(request, RequestStatus.FINISHED_ERROR)  # type: ignore[attr-defined]
                failed.append(RequestUpdate(request.request_id, [], RequestStatus.FINISHED_ERROR,
                                            max(request.num_cached_tokens, 0)))  # fmt: skip
        for sr, request in zip(reversed(out.scheduled), reversed(rows)):  # the preempted queue in step order
            if request is not None and request.status == RequestStatus.RUNNING:
                if not failed:
                    request.suspect_until = sr.num_computed_tokens + len(sr.token_ids)
                    self.counters.num_step_suspects += 1
                self._preempt(request)  # type: ignore[attr-defined]
        self._drain(out.step)  # type: ignore[attr-defined]
        return failed

    @staticmethod
    def _sits_out(request: Request, plan: list[tuple[Request, int, int, list[int], int]]) -> bool:
        """A suspect waits while the step already holds one: a failure must name a single suspect. One that
        computed past the chunk it failed in is cleared here, as it is planned."""
        if not request.suspect_until:
            return False  # every request but a failed step's: one attribute read per step
        if request.num_computed_tokens >= request.suspect_until:
            request.suspect_until = 0
            return False
        return any(step[0].suspect_until for step in plan)
