"""Checkpoint policies: exact positions per chunk."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from recap.config import CacheConfig
from recap.core.policy import YIELD_MIN_SAMPLES, CheckpointPolicy, Source
from recap.core.request import Request

BS = 4


def policy(name: str, **kw: object) -> CheckpointPolicy:
    return CheckpointPolicy(CacheConfig(block_size=BS, checkpoint_policy=name, **kw), has_state=True)  # type: ignore[arg-type]


def positions(p: CheckpointPolicy, r: Request, start: int, end: int) -> list[tuple[int, bool]]:
    """(position, provisional) pairs; `proven` is checked by its own tests."""
    return [(site.position, site.provisional) for site in p.positions(r, start, end)]


R = Request("r", list(range(30)), 20, segment_boundaries=(10, 21))  # prompt end 28; segments 8, 20


def test_none_and_no_state_write_nothing() -> None:
    p = policy("none")
    p.admit(R, 0, 0)
    assert positions(p, R, 0, 30) == []
    q = CheckpointPolicy(CacheConfig(block_size=BS), has_state=False)
    assert not q.enabled and q.positions(R, 0, 30) == []
    off = CheckpointPolicy(CacheConfig(block_size=BS, enable_prefix_caching=False), has_state=True)
    assert off.positions(R, 0, 30) == []


def test_align_prompt_end_only() -> None:
    p = policy("align")
    p.admit(R, 0, 0)
    assert positions(p, R, 0, 30) == [(28, False)]
    assert positions(p, R, 0, 27) == []  # a chunk that stops short does not reach it
    assert positions(p, R, 27, 28) == [(28, False)]
    assert positions(p, R, 30, 32) == []  # no decode snapshots


def test_all_every_boundary() -> None:
    p = policy("all")
    assert positions(p, R, 0, 30) == [(p_, False) for p_ in range(4, 29, 4)]
    assert positions(p, R, 3, 5) == [(4, False)]
    assert positions(p, R, 31, 32) == [(32, False)]


def test_recap_segments_prompt_end_and_decode_snapshots() -> None:
    p = policy("recap")
    p.admit(R, 0, 0)
    assert positions(p, R, 0, 30) == [(8, False), (20, False), (28, False)]
    assert positions(p, R, 30, 31) == []
    assert positions(p, R, 31, 32) == [(32, True)]  # decode end snapshot, provisional
    # A resumed request recomputing outputs in one chunk snapshots only the last boundary.
    assert positions(p, R, 28, 41) == [(40, True)]


def test_recap_learns_branch_point_from_kv_hit_past_checkpoint() -> None:
    p = policy("recap")
    p.admit(R, 8, 16)
    assert positions(p, R, 8, 30) == [(16, False), (20, False), (28, False)]
    assert p.num_branch_points == 1


def test_recap_interval_and_geometric() -> None:
    p = policy("recap", checkpoint_interval=3)
    r = Request("r", list(range(60)), 20)  # prompt end 56
    p.admit(r, 0, 0)
    # 60 is an interval point too (and the boundary at the prompt length).
    assert positions(p, r, 0, 60) == [(12, False), (24, False), (36, False), (48, False), (56, False), (60, False)]
    g = policy("recap", checkpoint_geometric=True)
    r = Request("r", list(range(60)), 20, segment_boundaries=(22,))  # segment 20
    g.admit(r, 0, 0)
    # From 0: 4 8 16 32; from 20: 24 28 36 52; segment 20, prompt end 56, decode end 60.
    got = [p_ for p_, _ in positions(g, r, 0, 60)]
    assert got == [4, 8, 16, 20, 24, 28, 32, 36, 52, 56, 60]


def test_recap_marks_shared_positions_proven() -> None:
    p = policy("recap")
    p.admit(R, 8, 16)  # branch point at 16, segments 8 and 20, prompt end 28
    proven = {site.position: site.proven for site in p.positions(R, 8, 32)}
    assert proven == {16: True, 20: True, 28: False, 32: False}
    a = policy("align")
    a.admit(R, 0, 0)
    assert [site.proven for site in a.positions(R, 0, 30)] == [False]


def _hashed(rid: str, tokens: list[int]) -> Request:
    r = Request(rid, tokens, 4)
    r.block_hashes = [hash(tuple(tokens[: (i + 1) * BS])) for i in range(len(tokens) // BS)]
    return r


def test_recap_learns_the_tail_distance_from_where_requests_diverge() -> None:
    p = policy("recap")
    assert p.tail_distance(96) == 0
    shared = list(range(64))
    a = _hashed("a", shared + list(range(1000, 1034)))  # 98 tokens: prompt end 96
    p.admit(a, 0, 0)
    assert [site.position for site in p.positions(a, 0, 98)] == [96]  # no sharing seen yet: tail = end
    b = _hashed("b", shared + list(range(2000, 2034)))  # diverges from a at 64, 32 tokens before a's end
    p.admit(b, 0, 64)
    assert p.tail_distance(96) == 32
    # b: branch point 64 (proven), its tail 96 - 32 = 64 (the same boundary), prompt end 96.
    assert [(s.position, s.proven, s.source) for s in p.positions(b, 0, 98)] == [
        (64, True, Source.BRANCH),
        (96, False, Source.PROMPT_END),
    ]
    c = _hashed("c", list(range(3000, 3100)))  # unrelated, 100 tokens: prompt end 96, tail 64
    p.admit(c, 0, 0)
    assert [site.position for site in p.positions(c, 0, 99)] == [64, 96]
    # d shares a's first 80 tokens (16 before a's end): distances {16, 32}; at prompt end 96,
    # F(16) * 80 = 40 < F(32) * 64 = 64, so the tail is 64, before d's branch point 80: not written.
    d = _hashed("d", a.prompt_token_ids[:80] + list(range(4000, 4018)))
    p.admit(d, 0, 80)
    assert p.tail_distance(96) == 32
    assert [(s.position, s.source) for s in p.positions(d, 0, 98)] == [(80, Source.BRANCH), (96, Source.PROMPT_END)]


def test_a_prefix_recomputed_after_kv_eviction_is_a_branch_point_that_leaves_the_tail() -> None:
    p = policy("recap")
    for d in [32] * 4:
        p.observe_divergence(d)
    r = _hashed("r", list(range(98)))  # prompt end 96, tail 64
    p.admit(r, 0, 8, 80)  # KV kept 8 tokens of a prefix earlier requests computed for 80
    assert [(s.position, s.proven, s.source) for s in p.positions(r, 0, 98)] == [
        (8, True, Source.BRANCH),
        (64, False, Source.TAIL),  # a KV branch point at 80 would have ruled the tail out
        (80, True, Source.BRANCH),
        (96, False, Source.PROMPT_END),
    ]
    assert p.num_branch_points == 2  # the KV hit's end (8) and the recalled prefix's end (80)
    q = _hashed("q", list(range(98)))
    p.admit(q, 0, 80, 80)  # nothing recalled past the KV hit: one branch point, the tail ruled out
    assert [(s.position, s.source) for s in p.positions(q, 0, 98)] == [(80, Source.BRANCH), (96, Source.PROMPT_END)]


def test_the_tail_reaches_further_back_on_longer_prompts() -> None:
    p = policy("recap")
    for d in [0, 0, 0, 40, 40, 40, 40, 40]:
        p.observe_divergence(d)
    # E = 48: F(0) * 48 = 18 > F(40) * 8 = 8; E = 400: F(0) * 400 = 150 < F(40) * 360 = 360.
    assert p.tail_distance(48) == 0 and p.tail_distance(400) == 40
    assert p.tail_distance(40) == 0  # a distance that reaches the start is never chosen


def test_a_speculative_source_that_never_pays_is_only_sampled() -> None:
    p = policy("recap")
    for _ in range(YIELD_MIN_SAMPLES):
        p.record_outcome(Source.PROMPT_END, hit=False)
        p.record_outcome(Source.TAIL, hit=False)  # with no divergence seen, the tail is the prompt end
        p.record_outcome(Source.BRANCH, hit=False)
    written = 0
    for i in range(32):
        r = Request(f"r{i}", list(range(30)), 4, segment_boundaries=(10,))
        p.admit(r, 0, 0)
        sites = p.positions(r, 0, 30)
        assert (8, Source.SEGMENT) in [(s.position, s.source) for s in sites]  # proven sources always
        written += any(s.position == 28 for s in sites)
    assert written == 2  # one request in EXPLORE_EVERY (16)
    for _ in range(8):
        p.record_outcome(Source.PROMPT_END, hit=True)  # hits again: 8 / 72 pays
        p.record_outcome(Source.TAIL, hit=True)
    r = Request("again", list(range(30)), 4)
    p.admit(r, 0, 0)
    assert [s.position for s in p.positions(r, 0, 30)] == [28]


def test_tail_distances_are_learned_per_cache_salt() -> None:
    p = policy("recap")
    shared = list(range(64))
    a = _hashed("a", shared + list(range(1000, 1034)))
    p.admit(a, 0, 0)
    b = _hashed("b", shared + list(range(2000, 2034)))
    p.admit(b, 0, 64)
    assert p.tail_distance(96) == 32 and p.tail_distance(96, "tenant-2") == 0


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 24), prompts=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 12)), max_size=40))
def test_the_extent_map_is_bounded_and_agrees_with_an_unbounded_one_on_what_it_keeps(
    capacity: int, prompts: list[tuple[int, int]]
) -> None:
    """Over any run the tail learner remembers at most `extent_capacity` hashes (it grew without bound
    before), and while the hash a request's KV hit ends at is still remembered it learns the same
    divergence as an unbounded learner. Prompts share prefixes of a few token families."""
    bounded, unbounded = policy("recap"), policy("recap")
    bounded.extent_capacity = capacity
    for i, (family, blocks) in enumerate(prompts):
        tokens = [family * 1000 + t for t in range(blocks * BS)] + [10**6 + i]  # a unique last token
        r = _hashed(f"r{i}", tokens)
        kv_hit = min(blocks, 3) * BS if i % 2 else 0  # every other request hits a shared prefix
        remembered = kv_hit == 0 or r.block_hashes[kv_hit // BS - 1] in bounded._extent
        before = list(bounded._distances.get(None, ())), list(unbounded._distances.get(None, ()))
        bounded.admit(r, 0, kv_hit)
        unbounded.admit(r, 0, kv_hit)
        assert bounded.num_extents <= capacity
        if remembered:  # the same observation, if any, on both sides
            new_b = list(bounded._distances.get(None, ()))[len(before[0]) :]
            new_u = list(unbounded._distances.get(None, ()))[len(before[1]) :]
            assert new_b == new_u


def test_a_sweep_keeps_a_hot_prefix_that_a_count_bound_forgot() -> None:
    """Issue 33's regression: a shared system prompt enters the map once (its first request writes it) and
    is hit ever after. Other requests' new blocks pushed it out of a count-bounded LRU although KV still
    held it, so its next sharer learned no divergence. Sweeping only what the cache dropped keeps it."""
    system = list(range(64))  # 16 blocks
    held: set[int] = set()
    cfg = CacheConfig(block_size=BS, checkpoint_policy="recap")
    swept = CheckpointPolicy(cfg, True, extent_capacity=40, holds=held.__contains__)
    counted = CheckpointPolicy(cfg, True, extent_capacity=40)  # the count bound: LRU by write
    first = _hashed("first", system + list(range(1000, 1034)))  # prompt end 96
    held.update(first.block_hashes[:16])  # KV keeps the hot system prompt, evicts the rest
    others = [_hashed(f"o{i}", [10_000 * (i + 1) + t for t in range(41)]) for i in range(10)]  # 10 blocks each
    for p in (swept, counted):
        for r in (first, *others):
            p.admit(r, 0, 0)
            p.forget(r.request_id)
    assert swept.num_extent_sweeps > 0 and swept.num_extents <= 40 and counted.num_extents <= 40
    sharer = _hashed("sharer", system + list(range(5000, 5034)))
    for p in (swept, counted):
        p.admit(sharer, 0, 64)
    assert list(swept._distances[None]) == [96 - 64]
    assert None not in counted._distances  # forgotten: the count bound learned nothing


def test_a_sweep_keeps_what_running_requests_wrote_before_the_cache_holds_it() -> None:
    held: set[int] = set()
    p = CheckpointPolicy(CacheConfig(block_size=BS, checkpoint_policy="recap"), True, 16, held.__contains__)
    running = _hashed("running", list(range(41)))  # 10 blocks, none computed (so none held) yet
    p.admit(running, 0, 0)
    for i in range(3):
        p.admit(_hashed(f"done{i}", [1000 * (i + 1) + t for t in range(21)]), 0, 0)
        p.forget(f"done{i}")
    assert p.num_extent_sweeps > 0
    assert set(running.block_hashes) <= p._extent.keys()
    p.forget("running")
    p.admit(_hashed("next", [9000 + t for t in range(21)]), 0, 0)  # 5 more: over 16, swept again
    assert not set(running.block_hashes) & p._extent.keys()


def test_the_extent_map_stays_within_twice_the_kv_pool_over_a_long_run() -> None:
    """Memory bound through the real scheduler: 60 distinct prompts through a 17-block KV pool. The map
    never exceeds its capacity (2x the pool), is swept (the bound is exercised), and what a sweep keeps
    once everything finished is only what the pool still holds."""
    from tests.core.helpers import Harness, make_scheduler, req

    sched = make_scheduler(num_kv_blocks=17, num_state_slots=8, max_num_seqs=2)
    cache, h = sched.cache, Harness(sched)
    p = cache.policy
    assert p.extent_capacity == 2 * 17
    for i in range(60):
        h.add(req(f"r{i}", [i * 1000 + t for t in range(21 + i % 7)], max_tokens=2))
        while sched.has_unfinished_requests():
            h.step()
            assert p.num_extents <= p.extent_capacity
    assert p.num_extent_sweeps > 0
    p._bound_extent()  # nothing runs: a sweep keeps only hashes the KV pool holds
    assert p.num_extents <= cache.kv.pool.num_cached and all(cache.indexes(x) for x in p._extent)
    ssm_only = make_scheduler("ssm", num_state_slots=8).cache
    assert ssm_only.seen is not None and ssm_only.policy.extent_capacity == 2 * ssm_only.seen.capacity
    ssm_only.seen.add([5])
    assert ssm_only.indexes(5) and not ssm_only.indexes(6)
