"""Disaggregation with a sliding-window group in the cache core: the prefill side holds the window blocks the
next token and the offered checkpoints read, the decode side receives them into a valid window table (a null
run, then live blocks), registers them by hash, and hits on them afterwards as a single instance would.

The "transfer" copies the prefill executor's simulated memory (KV, window KV and states) where the plans say;
the validating FakeExecutor asserts every window read, so a block missing or misplaced fails the decode.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recap.core.block_pool import NULL_BLOCK_ID
from recap.core.output import CheckpointWrite
from recap.core.transfer import HeldRequest, ReceivePlan, RemoteOffer
from tests.core.helpers import Harness, make_scheduler, req
from tests.core.test_disagg_core import prefill, receive
from tests.core.test_disagg_core import transfer as transfer_kv_and_states

WINDOW_KINDS = ("hybrid+window", "attention+window", "ssm+window", "window")


def transfer(pre: Harness, held: HeldRequest, dec: Harness, plan: ReceivePlan) -> list[CheckpointWrite]:
    """KV blocks and states as in test_disagg_core, plus the window blocks the plan asks for."""
    written = transfer_kv_and_states(pre, held, dec, plan)
    bs = pre.sched.cache.block_size
    src_kv, dst_kv = pre.executor._window_kv, dec.executor._window_kv
    assert held.window is not None
    for index, dst in zip(plan.window.indices, plan.window.block_ids):
        src = held.window.block_ids[index]
        assert src != NULL_BLOCK_ID, f"asked for window block {index}, which the prefill side does not hold"
        for off in range(bs):
            if src * bs + off in src_kv:
                dst_kv[dst * bs + off] = src_kv[src * bs + off]
    return written


def in_use(h: Harness) -> tuple[int, int, int]:
    cache = h.sched.cache
    kv = cache.kv.pool.num_in_use if cache.kv else 0
    window = cache.window.pool.num_in_use if cache.window else 0
    return kv, window, cache.state.pool.num_in_use if cache.state else 0


def disaggregated(pre: Harness, dec: Harness, rid: str, prompt: list[int], max_tokens: int) -> ReceivePlan:
    held = prefill(pre, req(rid, prompt, max_tokens=1))
    request = req(rid, prompt, max_tokens=max_tokens)
    plan = receive(dec, request, held)
    assert dec.sched.finish_receive(rid, transfer(pre, held, dec, plan))
    dec.sched.check_integrity()
    assert pre.sched.release_held(rid)
    pre.sched.check_integrity()
    dec.run()
    return plan


def test_prefill_holds_the_window_run_its_checkpoints_need() -> None:
    """22 tokens in chunks of 8, window 6, block 4 (span 2). The last chunk starts at 16, whose window reads
    11..16: blocks 0 and 1 left the request's table. The prompt-end checkpoint at 20 needs blocks 3 and 4, the
    next token (22) blocks 4 and 5: the held run is the live table, from block 2."""
    pre = Harness(make_scheduler("hybrid+window", max_num_batched_tokens=8))
    held = prefill(pre, req("a", range(22), max_tokens=1))
    window = pre.sched.cache.window
    assert window is not None and held.window is not None
    assert window.num_null("a") == 2 and [c.position for c in held.checkpoints] == [20]
    assert held.window.start == 2 and held.window.extra == ()
    assert held.offer().window_start == 2
    pre.sched.check_integrity()
    # Policy all: the checkpoint at 4 needs block 0: the held run goes back to it through the cached blocks.
    pre2 = Harness(make_scheduler("hybrid+window", policy="all", max_num_batched_tokens=8))
    held2 = prefill(pre2, req("a", range(22), max_tokens=1))
    assert held2.window is not None and held2.window.start == 0 and len(held2.window.extra) == 2
    assert pre2.sched.cache.window.pool.num_in_use == 6  # 4 live table blocks + 2 touched
    pre2.sched.check_integrity()
    assert pre2.sched.release_held("a") and in_use(pre2) == (0, 0, 0)
    pre2.sched.check_integrity()


@pytest.mark.parametrize("kind", WINDOW_KINDS)
def test_decode_side_resumes_and_hits_like_a_single_instance(kind: str) -> None:
    prompt = list(range(100, 122))  # 22 tokens: blocks 0..4 full, block 5 partial
    single = Harness(make_scheduler(kind))
    expected_a = single.run_one(req("a", prompt, max_tokens=6)).output_token_ids
    pre, dec = Harness(make_scheduler(kind)), Harness(make_scheduler(kind))
    plan = disaggregated(pre, dec, "a", prompt, max_tokens=6)
    assert dec.requests["a"].output_token_ids == expected_a
    # The next token (22) reads 17..21: blocks 4 and 5; a later hit at 20 (the prompt-end checkpoint with a state
    # group, the deepest full block without one) needs blocks 3 and 4 (positions 15..19).
    assert plan.window.indices == (3, 4, 5)
    assert dec.sched.cache.window.pool.num_in_use == 0 and in_use(dec) == (0, 0, 0)
    window = dec.sched.cache.window
    hashes = dec.requests["a"].block_hashes
    for index in plan.window.indices[:-1]:  # the full blocks are findable by their hashes
        assert window.pool.lookup(hashes[index]) is not None
    # A second request sharing the prompt hits on the decode side: its own hit, as a single instance's.
    longer = prompt + [7] * 9
    b_single = single.run_one(req("b", longer, max_tokens=3))
    b = dec.run_one(req("b", longer, max_tokens=3))
    assert b.output_token_ids == b_single.output_token_ids
    assert dec.finished["b"].num_cached_tokens == single.finished["b"].num_cached_tokens > 0
    assert in_use(dec) == (0, 0, 0) and in_use(pre) == (0, 0, 0)


def test_window_blocks_held_locally_are_shared_not_received() -> None:
    pre, dec = Harness(make_scheduler("hybrid+window")), Harness(make_scheduler("hybrid+window"))
    prompt = list(range(22))
    disaggregated(pre, dec, "a", prompt, max_tokens=2)
    held = prefill(pre, req("b", prompt, max_tokens=1))
    plan = receive(dec, req("b", prompt, max_tokens=2), held)
    # The decode side caches blocks 3 and 4 of the window now: only the partial block 5 travels.
    assert plan.window.indices == (5,) and plan.num_local_blocks == 5 and plan.checkpoints == ()
    assert dec.sched.finish_receive("b", transfer(pre, held, dec, plan))
    assert pre.sched.release_held("b")
    dec.run()
    assert in_use(dec) == (0, 0, 0)


def test_offers_that_cannot_resume_are_refused() -> None:
    pre = Harness(make_scheduler("hybrid+window"))
    held = prefill(pre, req("a", range(22), max_tokens=1))
    offer = held.offer()
    assert offer.window_start is not None
    windowless = Harness(make_scheduler("hybrid"))
    with pytest.raises(ValueError, match="sliding-window layers, this side does not"):
        windowless.sched.add_remote_request(req("a", range(22)), offer)
    dec = Harness(make_scheduler("hybrid+window"))
    no_window = RemoteOffer(22, offer.first_token_id, offer.checkpoint_positions, offer.prompt_digest, None)
    with pytest.raises(ValueError, match="sent none"):
        dec.sched.add_remote_request(req("a", range(22)), no_window)
    late = RemoteOffer(22, offer.first_token_id, offer.checkpoint_positions, offer.prompt_digest, 5)
    with pytest.raises(ValueError, match="next token reads block 4"):
        dec.sched.add_remote_request(req("a", range(22)), late)
    assert not dec.sched.has_unfinished_requests()
    assert pre.sched.release_held("a") and in_use(pre) == (0, 0, 0)


def test_failed_or_aborted_receive_frees_the_window_blocks() -> None:
    pre, dec = Harness(make_scheduler("hybrid+window")), Harness(make_scheduler("hybrid+window"))
    prompt = list(range(22))
    held = prefill(pre, req("a", prompt, max_tokens=1))
    receive(dec, req("a", prompt, max_tokens=3), held)
    assert dec.sched.cache.window.pool.num_in_use == 3
    assert dec.sched.fail_receive("a", fallback=False)
    dec.sched.check_integrity()
    assert in_use(dec) == (0, 0, 0)
    receive(dec, request := req("b", prompt, max_tokens=3), held)
    assert dec.sched.fail_receive("b", fallback=True)
    dec.run()  # local prefill: the validating executor checks its window reads
    assert request.output_token_ids == [dec.executor.sample("b", j) for j in range(3)]
    receive(dec, req("c", prompt, max_tokens=3), held)
    dec.sched.abort_requests(["c"])
    dec.sched.check_integrity()
    assert in_use(dec) == (0, 0, 0)
    assert pre.sched.release_held("a") and in_use(pre) == (0, 0, 0)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(WINDOW_KINDS),
    policy=st.sampled_from(("recap", "all", "align")),
    block_size=st.integers(1, 5),
    window=st.integers(1, 14),
    prompt_len=st.integers(1, 40),
    extra_len=st.integers(1, 12),
    chunk=st.integers(1, 24),
    max_tokens=st.integers(1, 6),
)
def test_random_transfers_keep_accounting_tables_and_hits(
    kind: str, policy: str, block_size: int, window: int, prompt_len: int, extra_len: int, chunk: int,
    max_tokens: int,
) -> None:
    """Any prompt, window and block size: the decode side's tables are valid (integrity after every step),
    registered window blocks are findable, a request sharing the prompt hits on the decode side at least as deep
    as on a single instance, and every pool returns to empty on both sides."""

    def make() -> Harness:
        return Harness(make_scheduler(kind, policy, block_size=block_size, sliding_window=window,
                                      max_num_batched_tokens=max(chunk, block_size)))

    prompt = list(range(500, 500 + prompt_len))
    single, pre, dec = make(), make(), make()
    single.run_one(req("a", prompt, max_tokens=max_tokens))
    plan = disaggregated(pre, dec, "a", prompt, max_tokens)
    assert dec.requests["a"].output_token_ids == single.requests["a"].output_token_ids
    pool, hashes = dec.sched.cache.window.pool, dec.requests["a"].block_hashes
    for index in plan.window.indices:
        if index < prompt_len // block_size:
            assert pool.lookup(hashes[index]) is not None, f"received window block {index} not findable"
    # The prefill side may hold a checkpoint a single instance never took (its decode end after one token), so
    # the decode side hits at least as deep, never less; the validating executor checks what the hit reads.
    longer = prompt + list(range(900, 900 + extra_len))
    dec.run_one(req("b", longer, max_tokens=2))
    single.run_one(req("b", longer, max_tokens=2))
    assert dec.finished["b"].num_cached_tokens >= single.finished["b"].num_cached_tokens
    assert in_use(pre) == (0, 0, 0) and in_use(dec) == (0, 0, 0)
