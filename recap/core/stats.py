"""What the scheduler reports: per-request updates after a step, and cache statistics."""

from __future__ import annotations

from dataclasses import dataclass

from recap.core.request import RequestStatus


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

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
