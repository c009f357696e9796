"""Async scheduling (vLLM's --async-scheduling): the next step is scheduled while the one before it runs.

With SchedulerConfig.async_scheduling, `schedule()` may be called once more before the step in flight is updated.
A request in that step is then scheduled *ahead*: from the end of its in-flight chunk and, where that chunk
samples, with one placeholder token (PLACEHOLDER_TOKEN_ID) that the runner fills from the step's sampled ids where
the model runs (runner/placeholders.py). Its host state (computed tokens, outputs, hashes, stops) still advances
only in `update_from_output`, one step at a time and in order, so blocks and checkpoints are still registered by
the update of the step that completes them (DESIGN invariant 2).

A request in flight waits (sits out the step) when it cannot run ahead:
- drafts or its sampler or grammar need its previous token on the host (speculation, Request.host_tokens);
- that token finishes it by count (max_tokens, max_model_len): the update finishes it on time;
- the placeholder completes a block while the state group plans checkpoints: that block has no hash yet.
No request is preempted while a step is in flight: a memory shortage ends the ahead step's running part, and the
next step, scheduled after the update, preempts as before.

A request that finishes (a stop seen a step late, an abort) while a step in flight still reads its slot and blocks
keeps them until that step's update (`_deferred`): pool accounting (invariant 5) counts them in use until then and
the integrity check counts them as holders. The step's row for it is dropped, token included; any checkpoint that
step planned for it is freed, never registered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from recap.config import SchedulerConfig
    from recap.core.cache_manager import CacheManager
    from recap.core.output import ScheduledRequest, SchedulerOutput
    from recap.core.request import Request
    from recap.core.speculation import Speculator


class AheadScheduling:
    """The Scheduler's steps in flight and deferred frees (a mixin: the Scheduler owns the queues)."""

    config: SchedulerConfig
    cache: CacheManager
    speculator: Speculator | None
    _flight: list[SchedulerOutput]  # steps scheduled and not yet updated, oldest first (two at most)
    _deferred: dict[int, list[Request]]  # step -> finished requests whose resources that step still reads

    def _ahead_rows(self) -> dict[str, ScheduledRequest]:
        """The rows of the step in flight, by request (empty when none); refused when it may not be overtaken."""
        if not self._flight:
            return {}
        if not self.config.async_scheduling or len(self._flight) > 1:
            raise RuntimeError(f"step {self._flight[-1].step} was scheduled but never updated")
        return {sr.request_id: sr for sr in self._flight[-1].scheduled}

    def _ahead_start(self, request: Request, sr: ScheduledRequest) -> tuple[int, int] | None:
        """(first position, placeholder tokens) of `request`'s next chunk past its in-flight row; None: it waits."""
        if self.speculator is not None or request.host_tokens or sr.num_draft_tokens:
            return None
        start = sr.num_computed_tokens + len(sr.token_ids)
        if not sr.sample:  # mid-prompt: the next chunk's tokens are on the host
            return start, 0
        num_tokens = request.num_tokens + 1  # with the token in flight
        if len(request.output_token_ids) + 1 >= request.max_tokens or num_tokens >= self.config.max_model_len:
            return None
        cache = self.cache
        if num_tokens % cache.block_size == 0 and cache.state is not None and cache.policy.enabled:
            return None
        return start, 1

    def _in_flight_step(self, request_id: str) -> int | None:
        """The newest step in flight that reads this request's slot and blocks, if any."""
        for out in reversed(self._flight):
            if any(sr.request_id == request_id for sr in out.scheduled):
                return out.step
        return None

    def _release(self, request: Request) -> None:
        """Free what the request holds now, or after the update of the step in flight that still reads it."""
        step = self._in_flight_step(request.request_id) if self._flight else None
        if step is None:
            self.cache.free(request)
        else:
            self._deferred.setdefault(step, []).append(request)

    def _drain(self, step: int) -> None:
        """`step` is updated: free what finished requests kept for it."""
        for request in self._deferred.pop(step, ()):
            self.cache.free(request)

    @property
    def deferred(self) -> list[Request]:
        """Finished requests whose slot and blocks a step in flight still reads."""
        return [r for held in self._deferred.values() for r in held]
