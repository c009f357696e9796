"""Disaggregation in the cache core: holding on the prefill side, receive plans and registration on the
decode side (exact block ids and slots), hit-rate parity with a single instance, failures and aborts.

The "transfer" copies the prefill executor's simulated memory (KV per position, state per slot) into the
decode executor's, exactly where the plans say; the validating FakeExecutor then asserts every read.
"""

from __future__ import annotations

import random

import pytest

from recap.core.output import CheckpointWrite
from recap.core.request import Request, RequestStatus
from recap.core.state_pool import SlotKind
from recap.core.transfer import HeldRequest, ReceivePlan, RemoteOffer, select_checkpoints
from tests.core.helpers import KINDS, Harness, make_scheduler, req


def prefill(h: Harness, request: Request) -> HeldRequest:
    """Compute the prompt and the first token; the request is held afterwards."""
    h.add(request)
    h.sched.hold_on_finish(request.request_id)
    h.run()
    held = h.sched.held(request.request_id)
    assert held is not None
    return held


def transfer(pre: Harness, held: HeldRequest, dec: Harness, plan: ReceivePlan) -> list[CheckpointWrite]:
    """Copy simulated blocks and states as the worker halves would; returns the written reports."""
    bs = pre.sched.cache.block_size
    src_kv, dst_kv = pre.executor._kv, dec.executor._kv
    for index, dst in zip(plan.block_indices, plan.block_ids):
        src = held.block_ids[index]
        for off in range(bs):
            if src * bs + off in src_kv:
                dst_kv[dst * bs + off] = src_kv[src * bs + off]
    states = pre.executor._slot_state
    if plan.state_slot >= 0:
        dec.executor._slot_state[plan.state_slot] = states[held.state_slot]
    written = []
    offers = select_checkpoints(held, [c.write.position for c in plan.checkpoints])
    for c, offer in zip(plan.checkpoints, offers):
        dec.executor._slot_state[c.write.slot] = states[offer.slot]
        written.append(CheckpointWrite(states[offer.slot][0], c.write.slot))
    return written


def receive(dec: Harness, request: Request, held: HeldRequest) -> ReceivePlan:
    dec.requests[request.request_id] = request
    dec.sched.add_remote_request(request, held.offer())
    plans = dec.sched.start_receives()
    dec.sched.check_integrity()
    assert [p.request_id for p in plans] == [request.request_id]
    return plans[0]


def disaggregated(pre: Harness, dec: Harness, rid: str, prompt: list[int], max_tokens: int) -> Request:
    held = prefill(pre, req(rid, prompt, max_tokens=1))
    request = req(rid, prompt, max_tokens=max_tokens)
    plan = receive(dec, request, held)
    written = transfer(pre, held, dec, plan)
    assert dec.sched.finish_receive(rid, written)
    assert pre.sched.release_held(rid)
    pre.sched.check_integrity()
    dec.run()
    return request


def in_use(h: Harness) -> tuple[int, int]:
    cache = h.sched.cache
    kv = cache.kv.pool.num_in_use if cache.kv else 0
    return kv, cache.state.pool.num_in_use if cache.state else 0


def test_prefill_holds_blocks_slot_and_pinned_checkpoints_until_released() -> None:
    pre = Harness(make_scheduler())
    held = prefill(pre, req("a", range(10), max_tokens=1))
    assert held.block_ids == (1, 2, 3) and held.state_slot == 0 and held.num_prompt_tokens == 10
    # recap policy: prompt end (10 - 1) // 4 * 4 = 8 was checkpointed into slot 1; it is offered and pinned.
    assert [(c.position, c.slot) for c in held.checkpoints] == [(8, 1)]
    pool = pre.sched.cache.state.pool
    assert pool.pins[1] == 1 and in_use(pre) == (3, 1)
    assert held.offer() == RemoteOffer(10, held.first_token_id, (8,), held.offer().prompt_digest)
    pre.sched.check_integrity()
    assert pre.sched.release_held("a") and not pre.sched.release_held("a")
    pre.sched.check_integrity()
    assert pool.pins[1] == 0 and in_use(pre) == (0, 0)
    assert pool.kind[1] == SlotKind.CHECKPOINT and pre.sched.cache.kv.pool.num_cached == 2  # still findable


def test_abort_and_error_finishes_are_never_held() -> None:
    pre = Harness(make_scheduler())
    pre.add(req("a", range(10), max_tokens=1))
    pre.sched.hold_on_finish("a")
    pre.sched.abort_requests(["a"])
    assert pre.sched.held("a") is None and in_use(pre) == (0, 0)
    with pytest.raises(KeyError):
        pre.sched.hold_on_finish("nobody")


@pytest.mark.parametrize("kind", KINDS)
def test_decode_matches_single_instance(kind: str) -> None:
    prompt = list(range(100, 110))
    single = Harness(make_scheduler(kind))
    expected = single.run_one(req("a", prompt, max_tokens=6)).output_token_ids
    pre, dec = Harness(make_scheduler(kind)), Harness(make_scheduler(kind))
    held = prefill(pre, req("a", prompt, max_tokens=1))
    request = req("a", prompt, max_tokens=6)
    plan = receive(dec, request, held)
    if kind != "ssm":
        assert (plan.block_indices, plan.block_ids) == ((0, 1, 2), (1, 2, 3))
    if kind == "hybrid":
        assert plan.state_slot == 0 and [(c.write.position, c.write.slot) for c in plan.checkpoints] == [(8, 1)]
    written = transfer(pre, held, dec, plan)
    assert dec.sched.finish_receive("a", written)
    dec.run()
    assert request.output_token_ids == expected and dec.finished["a"].finished == RequestStatus.FINISHED_LENGTH
    assert dec.finished["a"].num_cached_tokens == 0
    assert in_use(dec) == (0, 0)
    assert pre.sched.release_held("a") and in_use(pre) == (0, 0)


def test_second_request_receives_only_missing_blocks_and_checkpoints() -> None:
    pre, dec = Harness(make_scheduler()), Harness(make_scheduler())
    disaggregated(pre, dec, "a", list(range(10)), max_tokens=2)
    # The decode side registered blocks 0-1 (hashes of tokens 0..7) and the checkpoint at 8.
    assert dec.sched.cache.kv.pool.num_cached >= 2 and dec.sched.cache.state.pool.num_checkpoints >= 1
    prompt = list(range(8)) + [50, 51, 52, 53, 54, 55]  # shares 8 tokens, 14 long: prompt end 12
    held = prefill(pre, req("b", prompt, max_tokens=1))
    assert [c.position for c in held.checkpoints] == [8, 12]
    request = req("b", prompt, max_tokens=3)
    plan = receive(dec, request, held)
    assert (plan.num_local_blocks, plan.local_checkpoint, plan.hit_tokens) == (2, 8, 8)
    assert plan.block_indices == (2, 3) and [c.write.position for c in plan.checkpoints] == [12]
    written = transfer(pre, held, dec, plan)
    assert dec.sched.finish_receive("b", written)
    dec.run()
    single = Harness(make_scheduler())
    single.run_one(req("a", list(range(10)), max_tokens=2))
    expected = single.run_one(req("b", prompt, max_tokens=3))
    assert request.output_token_ids == expected.output_token_ids
    assert dec.finished["b"].num_cached_tokens == single.finished["b"].num_cached_tokens == 8


def test_multi_turn_hit_rate_equals_single_instance() -> None:
    single = Harness(make_scheduler())
    pre, dec = Harness(make_scheduler()), Harness(make_scheduler())
    history_single, history_disagg = list(range(1000, 1022)), list(range(1000, 1022))
    for turn in range(4):
        rid = f"t{turn}"
        a = single.run_one(req(rid, history_single, max_tokens=9))
        b = disaggregated(pre, dec, rid, history_disagg, max_tokens=9)
        assert a.output_token_ids == b.output_token_ids
        assert dec.finished[rid].num_cached_tokens == single.finished[rid].num_cached_tokens
        new = list(range(2000 + 10 * turn, 2007 + 10 * turn))
        history_single = history_single + a.output_token_ids + new
        history_disagg = history_disagg + b.output_token_ids + new
    s, d = single.sched.stats, dec.sched.stats
    assert (d.prefix_cache_queries, d.prefix_cache_hits) == (s.prefix_cache_queries, s.prefix_cache_hits)
    assert s.prefix_cache_hits > 0


def test_failed_receive_frees_everything_or_falls_back_to_local_prefill() -> None:
    prompt = list(range(10))
    pre, dec = Harness(make_scheduler()), Harness(make_scheduler())
    held = prefill(pre, req("a", prompt, max_tokens=1))
    receive(dec, req("a", prompt, max_tokens=4), held)
    assert in_use(dec) == (3, 2)  # three blocks, the running slot and one checkpoint slot
    assert dec.sched.fail_receive("a", fallback=False) and not dec.sched.fail_receive("a", fallback=False)
    dec.sched.check_integrity()
    assert in_use(dec) == (0, 0) and not dec.sched.has_unfinished_requests()
    assert not dec.sched.finish_receive("a", [])
    # Fallback: the request prefills locally and gives the single-instance tokens.
    request = req("b", prompt, max_tokens=4)
    receive(dec, request, held)
    assert dec.sched.fail_receive("b", fallback=True)
    dec.sched.check_integrity()
    dec.run()
    single = Harness(make_scheduler())
    assert request.output_token_ids == single.run_one(req("b", prompt, max_tokens=4)).output_token_ids
    assert in_use(dec) == (0, 0)


def test_abort_while_receiving_or_queued_frees_everything() -> None:
    pre, dec = Harness(make_scheduler(num_kv_blocks=5)), Harness(make_scheduler(num_kv_blocks=5))
    held = prefill(pre, req("a", range(10), max_tokens=1))
    receive(dec, req("a", range(10), max_tokens=4), held)
    dec.sched.add_remote_request(req("b", range(10), max_tokens=4), held.offer())
    assert dec.sched.start_receives() == [] and dec.sched.num_remote_queued == 1  # 4 usable blocks: b waits
    dec.sched.abort_requests(["a", "b"])
    dec.sched.check_integrity()
    assert in_use(dec) == (0, 0) and dec.sched.num_receiving == dec.sched.num_remote_queued == 0
    assert not dec.sched.finish_receive("a", [])


def test_receiving_requests_take_seats() -> None:
    pre, dec = Harness(make_scheduler()), Harness(make_scheduler(max_num_seqs=1))
    held = prefill(pre, req("a", range(10), max_tokens=1))
    receive(dec, req("a", range(10), max_tokens=4), held)
    dec.add(req("local", range(50, 60), max_tokens=2))
    assert dec.sched.schedule().is_empty  # the only seat is taken by the receiving request
    dec.sched.check_integrity()


def test_a_received_checkpoint_with_the_wrong_position_is_refused() -> None:
    pre, dec = Harness(make_scheduler()), Harness(make_scheduler())
    held = prefill(pre, req("a", range(10), max_tokens=1))
    plan = receive(dec, req("a", range(10), max_tokens=2), held)
    transfer(pre, held, dec, plan)
    pool = dec.sched.cache.state.pool
    assert dec.sched.finish_receive("a", [CheckpointWrite(4, plan.checkpoints[0].write.slot)])
    assert pool.num_refused == 1 and pool.lookup(plan.checkpoints[0].block_hash) is None
    dec.sched.check_integrity()


def test_an_offer_for_another_prompt_is_rejected() -> None:
    pre, dec = Harness(make_scheduler()), Harness(make_scheduler())
    held = prefill(pre, req("a", range(10), max_tokens=1))
    with pytest.raises(ValueError, match="different prompt"):
        dec.sched.add_remote_request(req("a", range(1, 11)), held.offer())
    with pytest.raises(ValueError, match="prompt tokens"):
        dec.sched.add_remote_request(req("a", range(11)), held.offer())
    salted = req("a", range(10), salt="tenant")
    with pytest.raises(ValueError, match="different prompt"):
        dec.sched.add_remote_request(salted, held.offer())
    assert not dec.sched.has_unfinished_requests()


def test_remote_first_token_can_finish_the_request() -> None:
    pre, dec = Harness(make_scheduler()), Harness(make_scheduler())
    held = prefill(pre, req("a", range(10), max_tokens=1))
    plan = receive(dec, req("a", range(10), max_tokens=1), held)
    dec.sched.finish_receive("a", transfer(pre, held, dec, plan))
    updates = dec.step()
    assert [(u.request_id, u.new_token_ids, u.finished) for u in updates] == [
        ("a", [held.first_token_id], RequestStatus.FINISHED_LENGTH)]
    assert in_use(dec) == (0, 0) and dec.sched.cache.kv.pool.num_cached == 2


def test_seeded_blast_of_transfers_failures_and_aborts_between_local_work() -> None:
    """Remote and local requests over shared prefixes on a small decode pool (preemptions, evictions);
    transfers complete, fail (with or without fallback), are aborted or stay in flight for a while.
    The validating executors check every read; integrity holds after every action; nothing leaks."""
    rng = random.Random(7)
    pre = Harness(make_scheduler(num_kv_blocks=129, num_state_slots=64))
    dec = Harness(make_scheduler(num_kv_blocks=20, num_state_slots=8, max_num_seqs=4, max_num_batched_tokens=16))
    prefixes = [list(range(100 * k, 100 * k + rng.randint(3, 18))) for k in range(3)]
    held: dict[str, HeldRequest] = {}
    inflight: dict[str, ReceivePlan] = {}
    aborted: set[str] = set()

    def settle(rid: str) -> None:
        inflight.pop(rid, None)
        assert pre.sched.release_held(rid)

    for i in range(60):
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(1, 9))]
        max_tokens = rng.randint(1, 14)
        if rng.random() < 0.3:
            dec.add(req(f"l{i}", prompt, max_tokens=max_tokens))
        else:
            rid = f"r{i}"
            held[rid] = prefill(pre, req(rid, prompt, max_tokens=1))
            request = req(rid, prompt, max_tokens=max_tokens)
            dec.requests[rid] = request
            dec.sched.add_remote_request(request, held[rid].offer())
        for _ in range(rng.randint(0, 3)):
            inflight.update((p.request_id, p) for p in dec.sched.start_receives())
            for rid, plan in list(inflight.items()):
                action = rng.random()
                if action < 0.5:
                    assert dec.sched.finish_receive(rid, transfer(pre, held[rid], dec, plan))
                    settle(rid)
                elif action < 0.6:
                    assert dec.sched.fail_receive(rid, fallback=rng.random() < 0.5)
                    settle(rid)
                elif action < 0.65:
                    dec.sched.abort_requests([rid])
                    aborted.add(rid)
                    settle(rid)
                dec.sched.check_integrity()
            dec.step()
    for _ in range(1000):  # drain: complete every transfer
        inflight.update((p.request_id, p) for p in dec.sched.start_receives())
        for rid, plan in list(inflight.items()):
            assert dec.sched.finish_receive(rid, transfer(pre, held[rid], dec, plan))
            settle(rid)
        if not dec.sched.has_unfinished_requests():
            break
        dec.step()
    for rid in [r for r in held if pre.sched.held(r) is not None]:  # queued remote requests that were aborted
        assert pre.sched.release_held(rid)
    pre.sched.check_integrity()
    dec.sched.check_integrity()
    assert in_use(pre) == (0, 0) and in_use(dec) == (0, 0) and not dec.sched.has_unfinished_requests()
    finished = {rid: u for rid, u in dec.finished.items() if rid not in aborted}
    assert len(finished) > 30 and dec.sched.stats.preemptions > 0
    for rid, update in finished.items():
        request = dec.requests[rid]
        assert update.finished == RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == [dec.executor.sample(rid, j) for j in range(request.max_tokens)]
