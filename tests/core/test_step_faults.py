"""Steps the runner fails (core/step_faults.py): a poisoned request fails alone while its neighbours finish with
the tokens they would have had; random failures over random schedules (tiers, async scheduling, speculation-free
kinds and policies) never register what a failed step half wrote, never leak a block, slot or tier entry, and
every request that finishes normally has its fault-free tokens."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from recap.core.fake_executor import StepFault
from recap.core.output import ModelRunnerOutput, SchedulerOutput
from recap.core.request import Request, RequestStatus
from recap.core.scheduler import Scheduler
from tests.core.helpers import KINDS, POLICIES, Harness, make_scheduler, req
from tests.core.test_blast import VOCAB, make_request


def fault_free(h: Harness, r: Request) -> list[int]:
    return [h.executor.sample(r.request_id, i) for i in range(len(r.output_token_ids))]


def assert_idle(sched: Scheduler) -> None:
    sched.check_integrity()
    if sched.cache.kv is not None:
        assert sched.cache.kv.pool.num_in_use == 0, "blocks still held"
    if sched.cache.state is not None:
        assert sched.cache.state.pool.num_in_use == 0, "slots still held"
    assert sched.tiers is None or not sched.tiers.promoting


def test_a_poisoned_request_fails_alone_and_its_neighbours_finish_untouched() -> None:
    sched = make_scheduler("hybrid", "recap", 4, 40, 12, max_num_seqs=4, max_num_batched_tokens=64)
    h = Harness(sched)
    shared = [random.Random(1).randrange(VOCAB) for _ in range(10)]
    reqs = [h.add(req(f"r{i}", shared + [i, i + 1, i + 2], max_tokens=5)) for i in range(4)]
    h.executor.poison = {"r2"}
    h.run()
    assert h.finished["r2"].finished == RequestStatus.FINISHED_ERROR and not reqs[2].output_token_ids
    for r in reqs[:2] + reqs[3:]:
        assert h.finished[r.request_id].finished == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == fault_free(h, r) and len(r.output_token_ids) == 5
    # one failure with all four in the step, then r2's own step: its neighbours lost one recompute, no answer
    assert sched.counters.num_failed_steps == 2 and sched.counters.num_step_suspects == 4
    assert_idle(sched)


def test_a_request_poisoned_mid_decode_keeps_nothing_from_the_failed_step() -> None:
    """It fails after some tokens: its neighbours resume from the cache (the failed step registered nothing:
    the executor's garbage would fail their reads) and finish with their fault-free tokens."""
    sched = make_scheduler("hybrid", "all", 2, 40, 16, max_num_seqs=3, max_num_batched_tokens=8)
    h = Harness(sched)
    reqs = [h.add(req(f"r{i}", [i + 1] * 9 + [i], max_tokens=6)) for i in range(3)]
    for _ in range(6):
        h.step()
    assert all(r.output_token_ids for r in reqs), "every request decodes before the fault"
    h.executor.poison = {"r0"}
    h.run()
    assert h.finished["r0"].finished == RequestStatus.FINISHED_ERROR and reqs[0].output_token_ids
    for r in reqs[1:]:
        assert r.output_token_ids == fault_free(h, r) and len(r.output_token_ids) == 6
    assert_idle(sched)


def run_blast(sched: Scheduler, h: Harness, rng: random.Random, fault_rate: float) -> list[Request]:
    """Random arrivals and aborts; each step fails with `fault_rate`. Under async scheduling the engine's order:
    the step in flight is updated before the failed one is undone."""
    bases = [[rng.randrange(VOCAB) for _ in range(30)] for _ in range(3)]
    added: list[Request] = []
    pending: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
    step = 0
    while step < 150 or sched.has_unfinished_requests() or pending is not None:
        assert step < 6000, "requests still unfinished"
        if step < 150 and rng.random() < 0.4:
            done = [r for r in added if r.is_finished and r.output_token_ids]
            added.append(h.add(make_request(rng, f"r{len(added)}", bases, done, 48)))
        h.executor.fail_next = rng.random() < fault_rate
        h.executor.fail_early = rng.random() < 0.5
        out = sched.schedule()
        sched.check_integrity()
        try:
            result = h.executor.execute(out)
        except StepFault:
            if pending is not None:
                h.stepped(sched.update_from_output(*pending))
                pending = None
            h.stepped(sched.fail_step(out))
        else:
            if pending is not None:
                h.stepped(sched.update_from_output(*pending))
            pending = (out, result) if sched.config.async_scheduling and out.scheduled else None
            if pending is None:
                h.stepped(sched.update_from_output(out, result))
        if out.scheduled and rng.random() < 0.03:
            sched.abort_requests([rng.choice(out.scheduled).request_id])
        sched.check_integrity()
        step += 1
    return added


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    policy=st.sampled_from(POLICIES),
    block_size=st.sampled_from([1, 2, 4]),
    num_kv_blocks=st.integers(4, 40),
    num_state_slots=st.integers(2, 12),
    budget=st.integers(2, 40),
    tiers=st.sampled_from(["none", "disk", "host+disk"]),
    async_scheduling=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_blast_with_failing_steps(kind: str, policy: str, block_size: int, num_kv_blocks: int, num_state_slots: int,
                                  budget: int, tiers: str, async_scheduling: bool, seed: int) -> None:  # fmt: skip
    tiered = tiers != "none" and "window" not in kind
    sched = make_scheduler(kind, policy, block_size, num_kv_blocks, num_state_slots, 4, budget, 64,
                           cache_disk_bytes=30 if tiered else None,
                           cache_host_bytes=12 if tiered and tiers == "host+disk" else None,
                           async_scheduling=async_scheduling, kv_bytes_per_token=1, state_bytes_per_slot=3)  # fmt: skip
    rng = random.Random(seed)
    h = Harness(sched, seed=seed)
    h.executor.vocab_size = VOCAB
    added = run_blast(sched, h, rng, fault_rate=0.06)
    assert all(r.is_finished for r in added)
    for r in added:
        if r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
            assert r.output_token_ids == fault_free(h, r), f"{r.request_id} lost or changed tokens"
    assert sched.counters.num_failed_steps == h.executor.num_faults
    assert_idle(sched)
    if sched.tiers is not None:  # nothing stuck pending, and each store holds exactly what its index says
        for _ in range(2):
            h.step()
        for level, index in enumerate(sched.tiers.indexes):
            index.check()
            assert all(index.is_ready(k) for k in index.iter_keys()), f"tier {level}: an entry never written"
            held = {k for lv, k in h.executor.tier.store if lv == level}
            assert held == set(index.iter_keys()) or level in sched.tiers.disabled, f"tier {level}: orphans"
