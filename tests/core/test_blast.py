"""Seeded random blast: arrivals with shared prefixes and continuations, random budgets, aborts (also
mid-step), engine stops, cache resets and tiny pools, with every invariant checked around every step,
the executor validating every state and KV read, and every request eventually finishing."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from recap.core.request import Request, RequestStatus
from recap.core.scheduler import Scheduler
from tests.core.helpers import KINDS, POLICIES, Harness, make_scheduler

VOCAB = 40


def make_request(rng: random.Random, rid: str, bases: list[list[int]], done: list[Request], max_len: int) -> Request:
    if done and rng.random() < 0.3:  # next turn of an earlier conversation
        prompt = done[rng.randrange(len(done))].all_token_ids + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
    else:
        base = bases[rng.randrange(len(bases))]
        prompt = base[: rng.randint(1, len(base))] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 10))]
    prompt = prompt[: max(1, min(len(prompt), max_len + rng.randint(-4, 2)))]  # now and then too long
    cut = sorted({rng.randint(1, len(prompt)) for _ in range(rng.randint(0, 2))})
    return Request(
        rid,
        prompt,
        max_tokens=rng.randint(1, 12),
        eos_token_ids=frozenset({rng.randrange(VOCAB)}) if rng.random() < 0.3 else frozenset(),
        stop_token_ids=frozenset({rng.randrange(VOCAB)}) if rng.random() < 0.1 else frozenset(),
        min_tokens=rng.randint(0, 2),
        segment_boundaries=tuple(cut),
        cache_salt=rng.choice([None, None, None, "tenant"]),
    )


WINDOW_KINDS = ("hybrid+window", "attention+window", "ssm+window", "window")


@settings(max_examples=45, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    policy=st.sampled_from(POLICIES),
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_kv_blocks=st.integers(2, 40),
    num_state_slots=st.integers(1, 12),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 40),
    max_model_len=st.integers(8, 96),
    caching=st.booleans(),
    interval=st.sampled_from([None, 1, 3]),
    geometric=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_blast(
    kind: str,
    policy: str,
    block_size: int,
    num_kv_blocks: int,
    num_state_slots: int,
    max_num_seqs: int,
    budget: int,
    max_model_len: int,
    caching: bool,
    interval: int | None,
    geometric: bool,
    seed: int,
) -> None:
    sched = make_scheduler(
        kind,
        policy,
        block_size,
        num_kv_blocks,
        num_state_slots,
        max_num_seqs,
        budget,
        max_model_len,
        enable_prefix_caching=caching,
        checkpoint_interval=interval,
        checkpoint_geometric=geometric,
    )
    blast(sched, seed, max_model_len)


@settings(max_examples=30, deadline=None)
@given(
    kind=st.sampled_from(WINDOW_KINDS),
    policy=st.sampled_from(POLICIES),
    block_size=st.sampled_from([1, 2, 4, 8]),
    window=st.integers(1, 20),
    num_kv_blocks=st.integers(2, 40),
    num_window_blocks=st.integers(2, 40),
    num_state_slots=st.integers(1, 12),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 40),
    max_model_len=st.integers(8, 96),
    caching=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_blast_sliding_window(
    kind: str,
    policy: str,
    block_size: int,
    window: int,
    num_kv_blocks: int,
    num_window_blocks: int,
    num_state_slots: int,
    max_num_seqs: int,
    budget: int,
    max_model_len: int,
    caching: bool,
    seed: int,
) -> None:
    """The same blast with a window group: blocks leave the window (and return to the pool) mid-request,
    hits need only the window before them, and the executor checks every window read."""
    sched = make_scheduler(
        kind,
        policy,
        block_size,
        num_kv_blocks,
        num_state_slots,
        max_num_seqs,
        budget,
        max_model_len,
        enable_prefix_caching=caching,
        sliding_window=window,
        num_window_blocks=num_window_blocks,
    )
    blast(sched, seed, max_model_len)
    if caching and sched.cache.window is not None:
        assert sched.cache.window.pool.num_in_use == 0


def blast(sched: Scheduler, seed: int, max_model_len: int) -> None:
    rng = random.Random(seed)
    h = Harness(sched, seed=seed)
    h.executor.vocab_size = VOCAB
    bases = [[rng.randrange(VOCAB) for _ in range(48)] for _ in range(3)]
    added: list[Request] = []
    done: list[Request] = []
    for step in range(260):
        if step < 180 and rng.random() < 0.35:
            for _ in range(rng.randint(1, 2)):
                r = make_request(rng, f"r{len(added)}", bases, done, max_model_len)
                added.append(r)
                h.add(r)
        live = [r for r in added if sched.get_request(r.request_id) is not None]
        if live and rng.random() < 0.04:
            sched.abort_requests([rng.choice(live).request_id])
        if live and rng.random() < 0.02:
            sched.finish_requests([rng.choice(live).request_id], RequestStatus.FINISHED_STOPPED)
        if rng.random() < 0.01:
            assert sched.reset_prefix_cache()
        out = sched.schedule()
        sched.check_integrity()
        result = h.executor.execute(out)
        if out.scheduled and rng.random() < 0.04:  # abort while the step runs
            sched.abort_requests([rng.choice(out.scheduled).request_id])
        sched.update_from_output(out, result)
        sched.check_integrity()
        done = [r for r in added if r.is_finished and r.output_token_ids]
    h.run(max_steps=5000)
    assert all(r.is_finished for r in added), "a request never finished"
    sched.check_integrity()
    stats = sched.stats
    assert stats.num_running == stats.num_waiting == 0
    if sched.cache.kv:
        assert sched.cache.kv.pool.num_in_use == 0
    if sched.cache.state:
        assert sched.cache.state.pool.num_in_use == 0
        assert not any(sched.cache.state.pool.pins)
