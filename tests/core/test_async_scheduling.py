"""Async scheduling in the core (core/async_scheduling.py): the next step is scheduled before the step in flight is
updated. Against the synchronous loop on the same workloads: the same outputs, finish reasons and token counts,
the same blocks and checkpoints registered (where timing cannot change what is registered), integrity after every
call, no checkpoint registered past a request's computed tokens, and pools that return to empty."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recap.core.output import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, SchedulerOutput
from recap.core.request import Request, RequestStatus
from recap.core.scheduler import Scheduler
from recap.core.state_pool import SlotKind
from recap.core.stats import RequestUpdate
from tests.core.helpers import Harness, make_scheduler, req

EOS = 7


class AsyncHarness(Harness):
    """The engine's async loop: schedule and run step N+1, then update step N."""

    def __init__(self, sched: Scheduler, seed: int = 0) -> None:
        super().__init__(sched, seed)
        self.pending: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self.calls: list[tuple[str, int]] = []

    def step(self) -> list[RequestUpdate]:
        out = self.sched.schedule()
        self.calls.append(("schedule", out.step))
        self.sched.check_integrity()
        for sr in out.scheduled:  # counts stop on time: no row runs past max_tokens or max_model_len
            assert sr.num_output_tokens < self.requests[sr.request_id].max_tokens or not sr.sample, sr.request_id
            assert sr.num_computed_tokens + sr.num_new_tokens <= self.sched.config.max_model_len, sr.request_id
        result = self.executor.execute(out)
        done, self.pending = [self.pending] if self.pending is not None else [], None
        if out.scheduled:
            self.pending = (out, result)
        else:
            done.append((out, result))
        updates: list[RequestUpdate] = []
        for o, r in done:
            updates += self.sched.update_from_output(o, r)
            self.calls.append(("update", o.step))
            self.sched.check_integrity()
        return self.stepped(updates)

    def busy(self) -> bool:
        return self.sched.has_unfinished_requests() or self.pending is not None


@dataclass
class Result:
    outputs: dict[str, tuple[list[int], RequestStatus | None]]
    checkpoints: set[tuple[int, int]]
    kv_hashes: set[int]


def registered(sched: Scheduler) -> tuple[set[tuple[int, int]], set[int]]:
    state, kv = sched.cache.state, sched.cache.kv
    checkpoints = set()
    if state is not None:
        pool = state.pool
        checkpoints = {(pool.slot_hash[s], pool.slot_position[s]) for s in range(pool.num_slots)
                       if pool.kind[s] == SlotKind.CHECKPOINT}  # fmt: skip
    hashes = {b.block_hash for b in kv.pool.blocks if b.block_hash is not None} if kv is not None else set()
    return checkpoints, hashes


def assert_none_past_computed(sched: Scheduler, requests: Sequence[Request]) -> None:
    """Every registered checkpoint is the state after at most the tokens some request had computed."""
    checkpoints, _ = registered(sched)
    bs = sched.cache.block_size
    for block_hash, position in checkpoints:
        owners = [r for r in requests if len(r.block_hashes) >= position // bs
                  and r.block_hashes[position // bs - 1] == block_hash]  # fmt: skip
        assert any(position <= r.num_computed_tokens for r in owners), f"checkpoint at {position} past every finish"


def run(workload: list[tuple], async_on: bool, aborts: dict[int, str], sequential: bool, **kw: object) -> Result:
    sched = make_scheduler(async_scheduling=async_on, **kw)  # type: ignore[arg-type]
    h: Harness = AsyncHarness(sched) if async_on else Harness(sched)
    requests = []
    for rid, prompt, max_tokens, forced in workload:
        r = req(rid, prompt, max_tokens=max_tokens, eos_token_ids=frozenset({EOS}))
        requests.append(h.add(r, forced))
        if sequential:
            h.run()
    for _ in range(10_000):
        if not sched.has_unfinished_requests() and getattr(h, "pending", None) is None:
            break
        if h.steps in aborts:
            sched.abort_requests([aborts[h.steps]])
            sched.check_integrity()
        h.step()
    outputs = {r.request_id: (list(r.output_token_ids), h.finished.get(r.request_id, None)) for r in requests}
    statuses = {rid: (toks, u.finished if u is not None else None) for rid, (toks, u) in outputs.items()}
    checkpoints, kv_hashes = registered(sched)
    assert_none_past_computed(sched, requests)
    pools_empty(sched)
    return Result(statuses, checkpoints, kv_hashes)  # type: ignore[arg-type]


def pools_empty(sched: Scheduler) -> None:
    """Finished, aborted and preempted requests returned everything (invariant 5)."""
    assert not sched.view.deferred and sched.view.in_flight is None
    if sched.cache.kv is not None:
        assert sched.cache.kv.pool.num_in_use == 0, "KV blocks still in use"
    if sched.cache.state is not None:
        assert not sched.cache.state.running and not sched.cache.state.pending, "state slots still held"


base = st.lists(st.integers(8, 60), min_size=40, max_size=40)
workload_st = st.lists(
    st.tuples(st.integers(0, 1), st.integers(1, 40), st.integers(0, 12), st.integers(1, 12),
              st.one_of(st.none(), st.integers(0, 11))),  # base, shared prefix, suffix, max_tokens, EOS at
    min_size=1, max_size=6,
)  # fmt: skip


def build(bases: list[list[int]], spec: list[tuple]) -> list[tuple]:
    out = []
    for i, (b, shared, suffix, max_tokens, eos_at) in enumerate(spec):
        prompt = bases[b][:shared] + [100 + i * 13 + j for j in range(suffix)]
        forced = [200 + j for j in range(12)]
        if eos_at is not None:
            forced[eos_at] = EOS
        out.append((f"r{i}", prompt, max_tokens, forced))
    return out


@settings(max_examples=60, deadline=None)
@given(
    bases=st.tuples(base, base), spec=workload_st,
    policy=st.sampled_from(["align", "all", "recap", "none"]), budget=st.sampled_from([5, 16, 64]),
    kind=st.sampled_from(["hybrid", "ssm", "attention", "hybrid+window"]),
)  # fmt: skip
def test_same_outputs_and_registrations_as_the_synchronous_loop(bases, spec, policy, budget, kind) -> None:
    """Roomy pools (no eviction, no preemption): registrations do not depend on timing for align, all and none;
    under recap, learned branch points do, so it compares them on requests run one after another."""
    work = build(list(bases), spec)
    sequential = policy == "recap"
    kw = {"policy": policy, "max_num_batched_tokens": budget, "kind": kind, "num_state_slots": 128}
    sync = run(work, False, {}, sequential, **kw)
    ahead = run(work, True, {}, sequential, **kw)
    assert ahead.outputs == sync.outputs
    assert ahead.checkpoints == sync.checkpoints
    assert ahead.kv_hashes == sync.kv_hashes


@settings(max_examples=40, deadline=None)
@given(
    bases=st.tuples(base, base), spec=workload_st, policy=st.sampled_from(["align", "all", "recap"]),
    budget=st.sampled_from([5, 16, 64]), blocks=st.integers(8, 20), slots=st.integers(4, 10),
    abort=st.one_of(st.none(), st.tuples(st.integers(1, 12), st.integers(0, 5))),
)  # fmt: skip
def test_tiny_pools_and_aborts_keep_outputs_and_accounting(bases, spec, policy, budget, blocks, slots, abort) -> None:
    """Preemption, eviction and aborts: every request not aborted answers as in the synchronous loop (integrity
    after every call, pools empty at the end); an aborted one answers a prefix of it."""
    work = build(list(bases), spec)
    kw = {"policy": policy, "max_num_batched_tokens": budget, "num_kv_blocks": blocks, "num_state_slots": slots,
          "block_size": 4}  # fmt: skip
    aborts = {abort[0]: f"r{abort[1]}"} if abort is not None else {}
    sync = run(work, False, {}, False, **kw)
    ahead = run(work, True, aborts, False, **kw)
    for rid, (tokens, status) in sync.outputs.items():
        got, got_status = ahead.outputs[rid]
        if rid in aborts.values():
            assert tokens[: len(got)] == got, f"{rid}: aborted output is no prefix of the full one"
        else:
            assert (got, got_status) == (tokens, status), rid


def test_schedule_of_the_next_step_comes_before_the_update_of_the_one_in_flight() -> None:
    h = AsyncHarness(make_scheduler(async_scheduling=True, policy="none"))
    h.add(req("a", range(10), max_tokens=5))
    h.run()
    order = h.calls
    overlapped = [n for n in range(1, 10) if ("update", n) in order and ("schedule", n + 1) in order
                  and order.index(("schedule", n + 1)) < order.index(("update", n))]  # fmt: skip
    assert len(overlapped) >= 4, order
    assert h.finished["a"].finished == RequestStatus.FINISHED_LENGTH and len(h.requests["a"].output_token_ids) == 5


def test_a_decode_row_ahead_carries_a_placeholder_and_the_stop_a_step_late_drops_its_token() -> None:
    sched = make_scheduler(async_scheduling=True, policy="none")
    h = AsyncHarness(sched)
    h.add(req("a", range(6), max_tokens=10, eos_token_ids=frozenset({EOS})), forced=[3, EOS, 9, 9])
    first = sched.schedule()  # the prompt: nothing in flight
    r1 = h.executor.execute(first)
    second = sched.schedule()  # ahead of the prompt's update
    (row,) = second.scheduled
    assert row.placeholder and row.token_ids == [PLACEHOLDER_TOKEN_ID] and row.num_computed_tokens == 6
    r2 = h.executor.execute(second)
    sched.update_from_output(first, r1)
    third = sched.schedule()
    assert third.scheduled[0].num_computed_tokens == 7
    r3 = h.executor.execute(third)
    (u,) = sched.update_from_output(second, r2)  # EOS: finished, but step 3 still reads its slot and blocks
    assert u.finished == RequestStatus.FINISHED_STOPPED and u.new_token_ids == [EOS]
    assert [r.request_id for r in sched.view.deferred] == ["a"]
    sched.check_integrity()
    assert sched.update_from_output(third, r3) == []  # the extra step's token goes nowhere
    assert not sched.view.deferred
    sched.check_integrity()
    assert h.requests["a"].output_token_ids == [3, EOS]


def test_requests_that_need_their_tokens_on_the_host_wait() -> None:
    sched = make_scheduler(async_scheduling=True, policy="none")
    sched.add_request(req("a", range(6), max_tokens=8, host_tokens=True))
    sched.add_request(req("b", range(20, 26), max_tokens=8))
    first = sched.schedule()
    sched_rows = {sr.request_id for sr in sched.schedule().scheduled}
    assert sched_rows == {"b"} and first.step == 1


def test_overtaking_a_step_in_flight_without_async_scheduling_is_refused() -> None:
    sched = make_scheduler()
    sched.add_request(req("a", range(6)))
    sched.schedule()
    with pytest.raises(RuntimeError, match="never updated"):
        sched.schedule()
