"""Shared builders for the cache-core tests: small layouts, a scheduler, and a step harness."""

from __future__ import annotations

from collections.abc import Sequence

from recap.config import CacheConfig, CacheLayout, SchedulerConfig
from recap.core.fake_executor import FakeExecutor, StepFault
from recap.core.output import TierLoad
from recap.core.request import Request
from recap.core.scheduler import Scheduler
from recap.core.stats import RequestUpdate
from recap.core.tiers import TierManager

KINDS = ("hybrid", "attention", "ssm")
POLICIES = ("none", "align", "all", "recap")


def make_layout(
    kind: str = "hybrid", block_size: int = 4, num_kv_blocks: int = 65, num_state_slots: int = 32, **kw: object
) -> CacheLayout:
    """kind: hybrid | attention | ssm, or one of those + "+window" (a sliding-window group beside them:
    `sliding_window` tokens, default 6, over as many blocks as the KV group unless `num_window_blocks`)."""
    base = kind.partition("+")[0]
    if "window" in kind:
        kw.setdefault("sliding_window", 6)
        kw.setdefault("num_window_blocks", num_kv_blocks)
    return CacheLayout(
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        num_state_slots=num_state_slots,
        has_kv=base not in ("ssm", "window"),
        has_state=base not in ("attention", "window"),
        **kw,  # type: ignore[arg-type]
    )


def make_scheduler(
    kind: str = "hybrid",
    policy: str = "recap",
    block_size: int = 4,
    num_kv_blocks: int = 65,
    num_state_slots: int = 32,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
    checkpoint_interval: int | None = None,
    checkpoint_geometric: bool = False,
    cache_disk_bytes: int | None = None,
    cache_host_bytes: int | None = None,
    async_scheduling: bool = False,
    **layout_kw: object,
) -> Scheduler:
    cache = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        checkpoint_policy=policy,
        checkpoint_interval=checkpoint_interval,
        checkpoint_geometric=checkpoint_geometric,
        cache_disk_bytes=cache_disk_bytes,
        cache_host_bytes=cache_host_bytes,
    )
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        async_scheduling=async_scheduling,
    )
    return Scheduler(sched, cache, make_layout(kind, block_size, num_kv_blocks, num_state_slots, **layout_kw))


def req(
    rid: str,
    prompt: Sequence[int],
    max_tokens: int = 4,
    segments: Sequence[int] = (),
    salt: str | None = None,
    **kw: object,
) -> Request:
    return Request(rid, list(prompt), max_tokens, segment_boundaries=tuple(segments), cache_salt=salt, **kw)  # type: ignore[arg-type]


class Harness:
    """Runs a scheduler against a validating FakeExecutor, checking integrity around every step."""

    def __init__(self, sched: Scheduler, seed: int = 0, validate: bool = True) -> None:
        self.sched = sched
        self.requests: dict[str, Request] = {}
        self.executor = FakeExecutor(
            sched.cache.block_size,
            seed=seed,
            validate=validate,
            token_lookup=self._tokens,
            sliding_window=sched.layout.sliding_window,
        )
        self.finished: dict[str, RequestUpdate] = {}
        self.steps = 0

    def _tokens(self, rid: str) -> list[int] | None:
        r = self.sched.get_request(rid)
        return None if r is None else r.all_token_ids

    def add(self, request: Request, forced: Sequence[int] | None = None) -> Request:
        if forced is not None:
            self.executor.force_output(request.request_id, forced)
        self.requests[request.request_id] = request
        self.sched.add_request(request)
        return request

    def step(self) -> list[RequestUpdate]:
        out = self.sched.schedule()
        self.sched.check_integrity()
        try:
            result = self.executor.execute(out)
        except StepFault:  # as the engine: the step's requests are retried apart, its suspects fail
            updates = self.sched.fail_step(out)
        else:
            updates = self.sched.update_from_output(out, result)
        self.sched.check_integrity()
        return self.stepped(updates)

    def stepped(self, updates: list[RequestUpdate]) -> list[RequestUpdate]:
        """Count a step and keep its finished requests."""
        self.steps += 1
        for u in updates:
            if u.finished is not None:
                self.finished[u.request_id] = u
        return updates

    def busy(self) -> bool:
        return self.sched.has_unfinished_requests()

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.busy():
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def run_one(self, request: Request, forced: Sequence[int] | None = None) -> Request:
        """Add a request and run until everything finishes; returns the request."""
        self.add(request, forced)
        self.run()
        return request


def record_loads(tiers: TierManager) -> list[TierLoad]:
    """Every load the tiers plan, as they plan it (the list fills as the scheduler runs)."""
    loads: list[TierLoad] = []
    plan = tiers.plan

    def recording(request, hit):  # type: ignore[no-untyped-def]
        load = plan(request, hit)
        if load is not None:
            loads.append(load)
        return load

    tiers.plan = recording  # type: ignore[method-assign]
    return loads
