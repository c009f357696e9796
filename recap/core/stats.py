"""What the scheduler reports: per-request updates after a step, and cache statistics."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from recap.core.request import RequestStatus
from recap.core.speculation import SpecCounters
from recap.core.tier_index import TierCounters, TierIndex

if TYPE_CHECKING:
    from recap.core.cache_manager import CacheManager
    from recap.core.tiers import TierManager


@dataclass
class RequestUpdate:
    """One request's news from a step: tokens sampled, and its finish status if it just finished."""

    request_id: str
    new_token_ids: list[int]
    finished: RequestStatus | None
    num_cached_tokens: int


@dataclass
class SchedulerCounters:
    """Counters the scheduler bumps as it goes (tokens unless named otherwise)."""

    num_steps: int = 0
    prefix_cache_requests: int = 0  # first admissions
    prefix_cache_queries: int = 0  # tokens of first admissions
    prefix_cache_hits: int = 0  # of which served from the cache
    checkpoint_miss_tokens: int = 0  # KV matched past the best checkpoint, at first admissions
    num_preemptions: int = 0
    num_resumed_hit_tokens: int = 0  # tokens preempted requests skipped when readmitted
    num_failed_steps: int = 0  # steps the runner raised on (core/step_faults.py)
    num_step_suspects: int = 0  # requests of those steps preempted to be retried apart


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of `SchedulerCounters` plus the pools' occupancy and checkpoint counts."""

    num_steps: int
    num_running: int
    num_waiting: int
    prefix_cache_requests: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    checkpoint_miss_tokens: int
    preemptions: int
    num_resumed_hit_tokens: int
    failed_steps: int  # steps the runner raised on
    step_suspects: int  # their requests preempted to be retried apart
    checkpoints: int  # registered now
    checkpoint_bytes: int
    checkpoints_created: int
    checkpoints_evicted: int
    checkpoints_stranded: int  # dropped because the KV block they end on was evicted
    checkpoints_refused: int  # provenance mismatches (never registered)
    checkpoint_writes_planned: int
    checkpoint_writes_skipped: int  # no slot worth taking (never preempted for)
    num_branch_points: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_blocks_evicted: int
    state_slots_free: int
    # Speculative decoding (vLLM's spec-decode counters, a copy); zeros without speculation.
    spec: SpecCounters = field(default_factory=SpecCounters)
    # The disk tier (core/tiers.py): entries and payload bytes held now, and its counters (a copy); zeros without.
    tier_entries: int = 0
    tier_bytes: int = 0
    tier: TierCounters = field(default_factory=TierCounters)
    # The host-memory tier, likewise.
    host_tier_entries: int = 0
    host_tier_bytes: int = 0
    host_tier: TierCounters = field(default_factory=TierCounters)
    num_promoting: int = 0  # requests waiting for their tier entries to load

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def scheduler_stats(
    c: SchedulerCounters, cache: CacheManager, num_running: int, num_waiting: int, spec: SpecCounters | None,
    tiers: TierManager | None = None,
) -> SchedulerStats:
    """A snapshot of the scheduler's counters, its cache's pools and its speculation counters."""
    kv_pool = cache.kv.pool if cache.kv else None
    state = cache.state
    pool = state.pool if state else None
    return SchedulerStats(
        num_steps=c.num_steps,
        num_running=num_running,
        num_waiting=num_waiting,
        prefix_cache_requests=c.prefix_cache_requests,
        prefix_cache_queries=c.prefix_cache_queries,
        prefix_cache_hits=c.prefix_cache_hits,
        checkpoint_miss_tokens=c.checkpoint_miss_tokens,
        preemptions=c.num_preemptions,
        num_resumed_hit_tokens=c.num_resumed_hit_tokens,
        failed_steps=c.num_failed_steps,
        step_suspects=c.num_step_suspects,
        checkpoints=pool.num_checkpoints if pool else 0,
        checkpoint_bytes=pool.num_checkpoints * pool.bytes_per_slot if pool else 0,
        checkpoints_created=pool.num_created if pool else 0,
        checkpoints_evicted=pool.num_evicted if pool else 0,
        checkpoints_stranded=pool.num_stranded if pool else 0,
        checkpoints_refused=pool.num_refused if pool else 0,
        checkpoint_writes_planned=state.num_planned if state else 0,
        checkpoint_writes_skipped=pool.num_declined if pool else 0,
        num_branch_points=cache.policy.num_branch_points,
        kv_blocks_free=kv_pool.num_free if kv_pool else 0,
        kv_blocks_cached=kv_pool.num_cached if kv_pool else 0,
        kv_blocks_evicted=kv_pool.num_evicted if kv_pool else 0,
        state_slots_free=pool.num_free if pool else 0,
        spec=spec.copy() if spec else SpecCounters(),
        **_tier_fields("", _named(tiers, "disk")),
        **_tier_fields("host_", _named(tiers, "host")),
        num_promoting=len(tiers.promoting) if tiers else 0,
    )


def _named(tiers: TierManager | None, name: str) -> TierIndex | None:
    return next((t for t in tiers.indexes if t.name == name), None) if tiers is not None else None


def _tier_fields(prefix: str, index: TierIndex | None) -> dict[str, object]:
    return {
        f"{prefix}tier_entries": index.num_entries if index else 0,
        f"{prefix}tier_bytes": index.num_bytes if index else 0,
        f"{prefix}tier": replace(index.counters) if index else TierCounters(),
    }
