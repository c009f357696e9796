"""The scheduler's lower-tier methods (a mixin of `Scheduler`; the bookkeeping is in recap.core.tiers).

While scheduling: a waiting request whose hit a lower tier makes deeper leaves the waiting queue with
status WAITING_FOR_TIER while the runner loads (`_promote`); the step's save, drop and load orders go into
its SchedulerOutput (`_tier_orders`). After the step: saves the runner reports written become readable,
finished loads are registered and their requests return to the head of the waiting queue (`_tier_update`).
"""

from __future__ import annotations

from collections import deque

from recap.config import CacheConfig, CacheLayout
from recap.core.cache_manager import CacheHit, CacheManager
from recap.core.output import ModelRunnerOutput, SchedulerOutput, TierLoad
from recap.core.request import Request, RequestStatus
from recap.core.tier_index import TierIndex
from recap.core.tiers import TierManager


def make_tier(cache_config: CacheConfig, layout: CacheLayout, cache: CacheManager) -> TierManager | None:
    """The lower tiers' manager (host memory, then disk, those with a budget), or None without any. Entry bytes
    are the payload bytes."""
    budgets = {"host": cache_config.cache_host_bytes or 0, "disk": cache_config.disk_tier_bytes}
    indexes = [TierIndex(name, budgets[name]) for name in cache_config.tier_names]
    if not indexes:
        return None
    kv_bytes = max(1, layout.kv_bytes_per_token * layout.block_size)
    window_bytes = max(1, layout.window_bytes_per_token * layout.block_size)
    return TierManager(cache, indexes, kv_bytes, max(1, layout.state_bytes_per_slot), window_bytes)


class TierScheduling:
    """Mixed into Scheduler, which provides these attributes."""

    tiers: TierManager | None
    _requests: dict[str, Request]
    _waiting: deque[Request]
    _tier_loads: list[TierLoad]

    @property
    def num_promoting(self) -> int:
        """Requests waiting for their lower-tier entries to load."""
        return len(self.tiers.promoting) if self.tiers is not None else 0

    def _promote(self, request: Request, hit: CacheHit) -> bool:
        """Start a load for the waiting head if a lower tier deepens its hit; True if it left the queue."""
        assert self.tiers is not None
        load = self.tiers.plan(request, hit)
        if load is None:
            return False
        self._waiting.popleft()
        request.status = RequestStatus.WAITING_FOR_TIER
        self._tier_loads.append(load)
        return True

    def _tier_orders(self, out: SchedulerOutput) -> None:
        if self.tiers is not None:
            out.tier_saves, out.tier_drops = self.tiers.take_orders()
            out.tier_loads, self._tier_loads = self._tier_loads, []

    def _tier_update(self, runner_out: ModelRunnerOutput) -> None:
        tiers = self.tiers
        if tiers is None:
            return
        for level in runner_out.tier_disabled:
            tiers.disable(level)
        tiers.saved(runner_out.tier_saved)
        for rid, report in runner_out.tier_loaded.items():
            if rid not in tiers.promoting:
                continue  # finished or aborted while loading: cancelled already
            request = self._requests[rid]
            tiers.complete(request, report)
            request.status = RequestStatus.WAITING
            self._waiting.appendleft(request)

    def _tier_forget(self, request: Request) -> None:
        """The request finishes: cancel its load if one is in flight."""
        if self.tiers is not None:
            if request.status == RequestStatus.WAITING_FOR_TIER:
                self.tiers.cancel(request.request_id)
            self.tiers.tried.discard(request.request_id)
