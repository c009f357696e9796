"""Scheduler API: chunking, ordering, limits, stops, aborts, errors, stats."""

from __future__ import annotations

import pytest

from recap.core.fake_executor import FakeExecutor
from recap.core.output import ModelRunnerOutput
from recap.core.request import RequestStatus
from tests.core.helpers import Harness, make_scheduler, req


def test_chunked_prefill_has_no_alignment_and_samples_at_the_end() -> None:
    h = Harness(make_scheduler(max_num_batched_tokens=5))
    h.add(req("a", range(13), max_tokens=2))
    chunks = []
    for _ in range(3):
        out = h.sched.schedule()
        sr = out.scheduled[0]
        chunks.append((sr.num_computed_tokens, sr.num_new_tokens, sr.sample))
        h.sched.update_from_output(out, h.executor.execute(out))
        h.sched.check_integrity()
    assert chunks == [(0, 5, False), (5, 5, False), (10, 3, True)]
    h.run()
    assert h.finished["a"].finished == RequestStatus.FINISHED_LENGTH


def test_running_first_then_waiting_fcfs_under_limits() -> None:
    h = Harness(make_scheduler(max_num_seqs=2, max_num_batched_tokens=8))
    for rid in "abc":
        h.add(req(rid, range(6), max_tokens=3))
    out = h.sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 6), ("b", 2)]
    h.sched.update_from_output(out, h.executor.execute(out))
    out = h.sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 4)]  # c waits: 2 seqs
    h.sched.update_from_output(out, h.executor.execute(out))
    h.run()
    assert set(h.finished) == {"a", "b", "c"}


def test_schedule_twice_without_update_is_an_error() -> None:
    h = Harness(make_scheduler())
    h.add(req("a", range(6)))
    h.sched.schedule()
    with pytest.raises(RuntimeError):
        h.sched.schedule()


@pytest.mark.parametrize(
    ("kw", "forced", "n_out", "status"),
    [
        ({"eos_token_ids": frozenset({9})}, [1, 9, 2], 2, RequestStatus.FINISHED_STOPPED),
        ({"eos_token_ids": frozenset({9}), "min_tokens": 3}, [9, 9, 9, 2], 3, RequestStatus.FINISHED_STOPPED),
        ({"stop_token_ids": frozenset({5})}, [1, 2, 5], 3, RequestStatus.FINISHED_STOPPED),
        ({}, [1, 2, 3, 4, 5, 6], 4, RequestStatus.FINISHED_LENGTH),
    ],
)
def test_stop_conditions(kw: dict, forced: list[int], n_out: int, status: RequestStatus) -> None:
    h = Harness(make_scheduler())
    r = h.run_one(req("a", range(6), max_tokens=4, **kw), forced=forced)
    assert r.output_token_ids == forced[:n_out] and h.finished["a"].finished == status
    assert r.status == status


def test_max_model_len_stops_generation() -> None:
    h = Harness(make_scheduler(max_model_len=10))
    r = h.run_one(req("a", range(7), max_tokens=50))
    assert r.num_tokens == 10 and r.status == RequestStatus.FINISHED_LENGTH


def test_prompts_that_can_never_fit_fail() -> None:
    h = Harness(make_scheduler(max_model_len=10, num_kv_blocks=3))  # 2 usable blocks of 4 tokens
    h.add(req("long", range(11)))
    h.add(req("big", range(9)))  # fits max_model_len, not the KV pool
    h.add(req("ok", range(5), max_tokens=2))
    h.run()
    assert h.finished["long"].finished == RequestStatus.FINISHED_ERROR
    assert h.finished["big"].finished == RequestStatus.FINISHED_ERROR
    assert h.finished["ok"].finished == RequestStatus.FINISHED_LENGTH


def test_decode_past_the_pool_finishes_with_length() -> None:
    h = Harness(make_scheduler(num_kv_blocks=3))  # 8 tokens of KV at most
    r = h.run_one(req("a", range(6), max_tokens=50))
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 9  # 8 computed + the last sampled


def test_abort_mid_prefill_and_mid_step_frees_everything() -> None:
    h = Harness(make_scheduler(max_num_batched_tokens=4))
    h.add(req("a", range(20)))
    h.add(req("b", range(20)))
    h.step()
    h.sched.abort_requests(["a", "unknown"])
    h.sched.check_integrity()
    out = h.sched.schedule()
    result = h.executor.execute(out)
    h.sched.abort_requests(["b"])  # while the step runs
    assert h.sched.update_from_output(out, result) == []
    h.sched.check_integrity()
    assert not h.sched.has_unfinished_requests()
    stats = h.sched.stats
    assert stats.kv_blocks_free == 64 and stats.state_slots_free + stats.checkpoints == 32
    assert out.scheduled and "a" in out.finished_request_ids


def test_finish_requests_from_the_engine() -> None:
    h = Harness(make_scheduler())
    h.add(req("a", range(6), max_tokens=10))
    h.step()
    h.sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert h.sched.get_request("a") is None and not h.sched.has_unfinished_requests()
    with pytest.raises(ValueError):
        h.sched.finish_requests(["a"], RequestStatus.RUNNING)


def test_duplicate_request_id_rejected() -> None:
    h = Harness(make_scheduler())
    h.add(req("a", range(6)))
    with pytest.raises(ValueError):
        h.sched.add_request(req("a", range(6)))


def test_num_cached_tokens_and_stats() -> None:
    h = Harness(make_scheduler())
    h.run_one(req("a", range(22), max_tokens=1))
    b = h.run_one(req("b", range(22), max_tokens=1))
    assert b.num_cached_tokens == 20
    assert h.finished["b"].num_cached_tokens == 20
    s = h.sched.stats
    assert (s.prefix_cache_requests, s.prefix_cache_queries, s.prefix_cache_hits) == (2, 44, 20)
    assert s.checkpoints >= 1 and s.checkpoints_created >= 1 and s.preemptions == 0
    assert s.prefix_cache_hit_rate == pytest.approx(20 / 44)


def test_caching_disabled_hashes_registers_and_hits_nothing() -> None:
    h = Harness(make_scheduler(enable_prefix_caching=False))
    a = h.run_one(req("a", range(22), max_tokens=3))
    b = h.run_one(req("b", range(22), max_tokens=3))
    assert a.block_hashes == [] and b.num_cached_tokens == 0
    s = h.sched.stats
    assert s.checkpoints == 0 and s.kv_blocks_cached == 0 and s.checkpoint_writes_planned == 0


def test_reset_prefix_cache() -> None:
    h = Harness(make_scheduler())
    h.run_one(req("a", range(22), max_tokens=1))
    h.add(req("b", range(30), max_tokens=1))
    out = h.sched.schedule()
    assert not h.sched.reset_prefix_cache()  # a step is in flight
    h.sched.update_from_output(out, h.executor.execute(out))
    assert h.sched.reset_prefix_cache()
    h.sched.check_integrity()
    assert h.sched.stats.checkpoints == 0 and h.sched.stats.kv_blocks_cached == 0
    h.run()
    assert h.run_one(req("c", range(22), max_tokens=1)).num_cached_tokens == 0  # a's prefix is forgotten
    assert h.run_one(req("d", range(22), max_tokens=1)).num_cached_tokens == 20  # caching goes on


def test_empty_steps_report_early_finishes() -> None:
    sched = make_scheduler(max_model_len=8)
    sched.add_request(req("x", range(9)))
    assert sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.is_empty
    updates = sched.update_from_output(out, ModelRunnerOutput())
    assert [(u.request_id, u.finished) for u in updates] == [("x", RequestStatus.FINISHED_ERROR)]
    assert not sched.has_unfinished_requests()


def test_fake_executor_forced_then_hashed_tokens() -> None:
    ex = FakeExecutor(4, seed=3)
    ex.force_output("a", [7, 8])
    assert [ex.sample("a", i) for i in range(2)] == [7, 8]
    assert ex.sample("a", 2) == FakeExecutor(4, seed=3).sample("a", 2)
    assert [ex.sample("b", i) for i in range(8)] != [FakeExecutor(4, seed=4).sample("b", i) for i in range(8)]


def test_checkpoint_writes_without_a_slot_are_skipped_and_counted() -> None:
    # 3 slots: one runs the request, two take the first two of its ten boundaries; nothing registered
    # is evictable while the step is in flight, so the other eight are skipped, never waited for.
    h = Harness(make_scheduler(policy="all", num_state_slots=3))
    h.run_one(req("a", range(41), max_tokens=1))
    s = h.sched.stats
    assert (s.checkpoint_writes_planned, s.checkpoint_writes_skipped, s.checkpoints_created) == (2, 8, 2)
