"""The checkpoint-aware router on scripted stats (exact replica ids), and its stats against the core's hits."""

from __future__ import annotations

import random

import pytest

from recap.cluster.router import CheckpointRouter, RouterConfig, RouteRequest
from recap.cluster.stats import ReplicaStats, StatsLimits, collect_stats, key64
from recap.core.hashing import chain_hashes, root_hash
from tests.core.helpers import KINDS, Harness, make_scheduler, req

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def keys(tokens: list[int], salt: str | None = None) -> list[int]:
    return [key64(h) for h in chain_hashes(root_hash(salt), tokens, BS)]


def stats_for(tokens: list[int], ckpt_blocks: list[int], time: float, salt: str | None = None, kv_blocks: int = -1,
              running: int = 0, waiting: int = 0) -> ReplicaStats:
    """A hybrid replica holding KV for the first `kv_blocks` blocks of `tokens` and checkpoints at `ckpt_blocks`."""
    chain = keys(tokens, salt)
    kv = chain if kv_blocks < 0 else chain[:kv_blocks]
    return ReplicaStats(time=time, block_size=BS, caching=True, has_kv=True, has_state=True, kv_keys=frozenset(kv),
                        checkpoints={chain[k - 1]: k for k in ckpt_blocks}, num_running=running, num_waiting=waiting)


def router(clock: Clock, **kw: object) -> CheckpointRouter:
    return CheckpointRouter(RouterConfig(block_size=BS, **kw), clock)  # type: ignore[arg-type]


PROMPT = list(range(100, 141))  # 41 tokens: 10 full blocks, at most 10 resumable (never the last token)


def test_deepest_resumable_prefix_wins() -> None:
    clock = Clock()
    r = router(clock)
    r.update_stats("a", stats_for(PROMPT, [2], clock.now))
    r.update_stats("b", stats_for(PROMPT, [2, 7], clock.now))
    r.update_stats("c", stats_for(PROMPT, [], clock.now))
    scores = r.score(["a", "b", "c"], RouteRequest(PROMPT))
    assert [(c.replica, c.resumable_tokens) for c in scores] == [("b", 28), ("a", 8), ("c", 0)]
    assert r.rank(["a", "b", "c"], RouteRequest(PROMPT)) == ["b", "a", "c"]


def test_kv_without_checkpoint_is_no_hit() -> None:
    """KV blocks past the best checkpoint do not count (DESIGN: a hit needs every cache group)."""
    clock = Clock()
    r = router(clock)
    r.update_stats("kv-only", stats_for(PROMPT, [1], clock.now))  # KV for all 10 blocks, checkpoint at 1
    r.update_stats("short-kv", stats_for(PROMPT, [9], clock.now, kv_blocks=5))  # checkpoint 9 but KV lost at 5
    r.update_stats("both", stats_for(PROMPT, [3], clock.now))
    assert r.rank(["kv-only", "short-kv", "both"], RouteRequest(PROMPT)) == ["both", "kv-only", "short-kv"]


def test_never_the_last_token() -> None:
    clock = Clock()
    r = router(clock)
    prompt = PROMPT[:40]  # exactly 10 blocks: at most 9 resumable
    r.update_stats("a", stats_for(prompt, [10], clock.now))
    r.update_stats("b", stats_for(prompt, [9], clock.now))
    assert [c.resumable_tokens for c in r.score(["a", "b"], RouteRequest(prompt))] == [36, 0]


def test_load_outweighs_a_shallow_hit() -> None:
    """cost = uncached tokens + queued_request_tokens x load: 8 tokens saved < one queued request of 16."""
    clock = Clock()
    r = router(clock, queued_request_tokens=16)
    r.update_stats("hit", stats_for(PROMPT, [2], clock.now, running=1))
    r.update_stats("idle", stats_for(PROMPT, [], clock.now))
    scores = r.score(["hit", "idle"], RouteRequest(PROMPT))
    assert [(c.replica, c.cost) for c in scores] == [("idle", 41), ("hit", 41 - 8 + 16)]
    # A deep hit (36 tokens) outweighs the same queue.
    r.update_stats("hit", stats_for(PROMPT, [2, 9], clock.now + 1, running=1))
    clock.now += 1
    assert r.rank(["hit", "idle"], RouteRequest(PROMPT))[0] == "hit"
    # ... but not two more queued requests.
    r.update_stats("hit", stats_for(PROMPT, [2, 9], clock.now + 1, running=2, waiting=1))
    clock.now += 1
    assert r.rank(["hit", "idle"], RouteRequest(PROMPT))[0] == "idle"


def test_stats_load_less_what_finished_since() -> None:
    """Stats taken while a request ran still count it; its completion seen here discounts it."""
    clock = Clock()
    r = router(clock)
    r.update_stats("home", stats_for(PROMPT, [2], clock.now, running=1))
    r.update_stats("other", stats_for(PROMPT, [], clock.now))
    r.on_routed("home", "k", RouteRequest(PROMPT[:9]))
    clock.now += 0.1
    assert r.load("home") == 1
    r.on_completed("home", "k")
    assert r.load("home") == 0
    assert r.rank(["home", "other"], RouteRequest(PROMPT))[0] == "home"
    r.update_stats("home", stats_for(PROMPT, [2], clock.now + 0.1, waiting=2))  # newer stats: two others queued
    assert r.load("home") == 2


def test_a_completion_seen_before_the_first_stats_still_discounts_them() -> None:
    """The replica's first stats, taken while the request ran, arrive after its completion: the request is over,
    so the replica is idle and the session's next turn stays where its checkpoint is."""
    clock = Clock()
    r = router(clock)
    r.on_routed("home", "k", RouteRequest(PROMPT[:21]))
    taken = clock.now + 0.05
    clock.now += 0.1
    r.on_completed("home", "k")
    r.update_stats("home", stats_for(PROMPT[:21], [5], taken, running=1))
    r.update_stats("other", stats_for(PROMPT, [], clock.now))
    assert r.load("home") == 0
    assert r.rank(["home", "other"], RouteRequest(PROMPT))[0] == "home"


def test_a_follow_up_turn_settles_its_predecessor_before_serve_reports_it() -> None:
    """The client read turn 1's answer and sent turn 2 (turn 1's prompt, its answer, a new question) before Serve's
    completion callback reached the router: turn 1 is over, so its replica is idle and turn 2 stays home. The late
    callback then changes nothing; a concurrent request that merely shares a prefix still counts."""
    clock = Clock()
    r = router(clock)
    for rid in ("home", "other"):
        r.update_stats(rid, stats_for([], [], clock.now))
    r.on_routed("home", "t1", RouteRequest(PROMPT[:21]))
    assert r.load("home") == 1
    assert r.rank(["home", "other"], RouteRequest(PROMPT))[0] == "home"  # turn 2: extends t1 past its end
    assert r.load("home") == 0
    r.on_completed("home", "t1")  # the late callback
    assert r.load("home") == 0 and r.load("other") == 0
    r.on_routed("other", "y", RouteRequest(PROMPT[:21]))
    r.score(["home", "other"], RouteRequest(PROMPT[:21]))  # the same prompt again: not past its end, not settled
    assert r.load("other") == 1


def test_a_completion_serve_never_reports_stops_counting_once_the_stats_show_the_replica_idle() -> None:
    """A request whose completion callback never reaches the router (Serve loses it; calls fanned out under one
    request id) would keep its replica loaded forever, and every new session would go elsewhere. The replica's
    stats, taken `arrival_s` after the request was routed, count it if it still runs: idle stats settle it, busy
    ones keep it; a request routed since still counts until stats taken after it arrive."""
    clock = Clock()
    r = router(clock, arrival_s=2.0)
    for rid in ("a", "b"):
        r.update_stats(rid, stats_for([], [], clock.now))
    r.on_routed("a", "lost", RouteRequest(PROMPT[:9]))
    r.on_routed("b", "running", RouteRequest(PROMPT[:13]))
    assert (r.load("a"), r.load("b")) == (1, 1)
    clock.now += 1.0
    r.update_stats("a", stats_for([], [], clock.now))  # taken before it could have arrived: it still counts
    assert r.load("a") == 1
    clock.now += 2.0
    r.on_routed("a", "new", RouteRequest(PROMPT[:5]))
    r.update_stats("a", stats_for([], [], clock.now - 0.5))  # idle, taken 2.5 s after "lost", before "new"
    r.update_stats("b", stats_for([], [], clock.now - 0.5, running=1))
    assert (r.load("a"), r.load("b")) == (1, 1)  # "new" only; b's own stats count "running"
    clock.now += 3.0
    r.update_stats("a", stats_for([], [], clock.now))
    assert r.load("a") == 0
    assert r.rank(["a", "b"], RouteRequest([9] * 9))[0] == "a"
    r.on_completed("a", "lost")  # arriving after all: changes nothing
    assert r.load("a") == 0


def test_ties_spread_then_fall_to_lower_id() -> None:
    clock = Clock()
    r = router(clock)
    new = [RouteRequest([i] * 9) for i in range(4)]
    assert r.rank(["b", "a"], new[0]) == ["a", "b"]  # all equal, never chosen: the lower id
    assert r.rank(["a", "b"], new[1])[0] == "b"  # then the one chosen least recently
    assert r.rank(["a", "b"], new[2])[0] == "a"
    r.on_routed("a", "x", RouteRequest([7] * 3))  # in flight on a: load decides before recency
    assert r.rank(["a", "b"], new[3])[0] == "b"


def test_a_replica_passed_over_by_serve_is_chosen_next() -> None:
    """Serve may send a request to a later rank (the first one's queue probe missed its deadline): the replica
    it actually went to counts as chosen, so the one passed over leads the next tie instead of being starved."""
    clock = Clock()
    r = router(clock)
    new = [RouteRequest([i] * 9) for i in range(4)]
    assert r.rank(["a", "b"], new[0])[0] == "a"
    r.on_routed("a", "0", new[0])
    r.on_completed("a", "0")
    assert r.rank(["a", "b"], new[1])[0] == "b"
    r.on_routed("a", "1", new[1])  # Serve passed b over
    r.on_completed("a", "1")
    assert r.rank(["a", "b"], new[2])[0] == "b"
    r.on_routed("b", "2", new[2])
    r.on_completed("b", "2")
    assert r.rank(["a", "b"], new[3])[0] == "a"
    r.on_routed("b", "p", RouteRequest([5] * 9, pin="b"))  # a pinned debug call: load, not recency
    r.on_completed("b", "p")
    assert r.rank(["a", "b"], RouteRequest([9] * 9))[0] == "b"


def test_kv_prefix_breaks_ties() -> None:
    """Equal hits: the replica holding the longer KV prefix wins (it learns the branch point there)."""
    clock = Clock()
    r = router(clock)
    r.update_stats("a", stats_for(PROMPT, [], clock.now, kv_blocks=3))
    r.update_stats("b", stats_for(PROMPT, [], clock.now, kv_blocks=7))
    r.update_stats("c", stats_for(PROMPT, [], clock.now, kv_blocks=0))
    scores = r.score(["a", "b", "c"], RouteRequest(PROMPT))
    assert [(c.replica, c.resumable_tokens, c.kv_tokens) for c in scores] == [("b", 0, 28), ("a", 0, 12), ("c", 0, 0)]
    r.on_routed("b", "x", RouteRequest([5] * 9))  # but load comes first
    assert r.rank(["a", "b", "c"], RouteRequest(PROMPT))[0] == "a"


def test_partial_prediction_is_kv_only() -> None:
    """A routed prompt predicts a checkpoint at its end only: a prompt sharing part of it gets KV, no hit."""
    clock = Clock()
    r = router(clock)
    r.on_routed("a", "doc", RouteRequest(PROMPT[:33]))  # 8 blocks
    branch = PROMPT[:20] + [9] * 21  # shares 5 blocks, then diverges
    (a,) = r.score(["a"], RouteRequest(branch))
    assert (a.resumable_tokens, a.kv_tokens) == (0, 20)
    (a,) = r.score(["a"], RouteRequest(PROMPT))  # extends the routed prompt whole
    assert (a.resumable_tokens, a.kv_tokens) == (32, 32)


def test_stale_stats_count_for_nothing() -> None:
    clock = Clock()
    r = router(clock, max_stats_age_s=5.0)
    r.update_stats("a", stats_for(PROMPT, [9], clock.now))
    r.update_stats("b", stats_for(PROMPT, [], clock.now))
    assert r.rank(["a", "b"], RouteRequest(PROMPT))[0] == "a"
    clock.now += 6
    assert [c.resumable_tokens for c in r.score(["a", "b"], RouteRequest(PROMPT))] == [0, 0]
    # An older record never replaces a newer one.
    r.update_stats("a", stats_for(PROMPT, [9], clock.now + 1))
    r.update_stats("a", stats_for(PROMPT, [], clock.now - 10))
    assert r.score(["a"], RouteRequest(PROMPT))[0].resumable_tokens == 36


def test_dead_replica_is_never_chosen() -> None:
    clock = Clock()
    r = router(clock)
    r.update_stats("a", stats_for(PROMPT, [9], clock.now))
    r.update_stats("b", stats_for(PROMPT, [], clock.now))
    r.forget("a")  # it died: Serve stops listing it as a candidate
    assert r.rank(["b"], RouteRequest(PROMPT)) == ["b"]
    assert r.score(["a", "b"], RouteRequest(PROMPT))[0].resumable_tokens == 0  # its stats went with it
    assert r.rank([], RouteRequest(PROMPT)) == []


def test_dead_replica_listed_by_stale_candidates_falls_back_to_load() -> None:
    """Serve's candidate list lags a death: a session affine (or a call pinned) to the dead replica goes to
    the least loaded live one, and the dead one's later stats or completions do not bring it back."""
    clock = Clock()
    r = router(clock)
    r.update_stats("a", stats_for(PROMPT, [9], clock.now))  # the session's home
    r.update_stats("b", stats_for(PROMPT, [], clock.now, running=2))
    r.update_stats("c", stats_for(PROMPT, [], clock.now, running=1))
    assert r.rank(["a", "b", "c"], RouteRequest(PROMPT)) == ["a", "c", "b"]
    r.on_routed("a", "k1", RouteRequest(PROMPT))
    r.forget("a")
    assert r.rank(["a", "b", "c"], RouteRequest(PROMPT)) == ["c", "b"]
    assert r.rank(["a", "b", "c"], RouteRequest(PROMPT, pin="a")) == ["c", "b"]
    assert r.rank(["a", "b", "c"], RouteRequest(PROMPT, pin="b")) == ["b"]
    assert r.rank(["b", "c"], RouteRequest(PROMPT, pin="gone")) == ["c", "b"]
    clock.now += 1
    r.update_stats("a", stats_for(PROMPT, [9], clock.now))  # a late record from the dead replica
    r.on_completed("a", "k1")
    r.on_routed("a", "k2", RouteRequest(PROMPT))
    assert r.rank(["a", "b", "c"], RouteRequest(PROMPT)) == ["c", "b"]
    assert r.rank(["a"], RouteRequest(PROMPT)) == []  # only dead ones: wait for Serve's new replicas
    assert r.rank(["a", "b", "c"], RouteRequest(PROMPT, policy="round_robin")) in (["b", "c"], ["c", "b"])


def test_salt_isolation() -> None:
    clock = Clock()
    r = router(clock)
    r.update_stats("a", stats_for(PROMPT, [9], clock.now, salt="tenant-1"))
    r.update_stats("b", stats_for(PROMPT, [4], clock.now, salt="tenant-2"))
    assert r.rank(["a", "b"], RouteRequest(PROMPT, cache_salt="tenant-2"))[0] == "b"
    assert r.rank(["a", "b"], RouteRequest(PROMPT, cache_salt="tenant-1"))[0] == "a"
    assert [c.resumable_tokens for c in r.score(["a", "b"], RouteRequest(PROMPT))] == [0, 0]


def test_predicted_until_published() -> None:
    """A routed prompt counts as cached on its replica until stats taken after it completed arrive."""
    clock = Clock()
    r = router(clock)
    turn1 = PROMPT[:21]
    r.update_stats("a", stats_for([], [], clock.now))
    r.update_stats("b", stats_for([], [], clock.now))
    r.on_routed("b", "t1", RouteRequest(turn1))
    r.on_completed("b", "t1")
    assert [(c.replica, c.resumable_tokens) for c in r.score(["a", "b"], RouteRequest(PROMPT))] == [("b", 20), ("a", 0)]
    clock.now += 1
    r.update_stats("b", stats_for(turn1, [3], clock.now))  # what b really kept: a checkpoint at block 3
    assert r.score(["a", "b"], RouteRequest(PROMPT))[0].resumable_tokens == 12
    r.on_routed("a", "t2", RouteRequest(PROMPT))
    clock.now += 61  # past prediction_ttl_s, and b's stats are stale
    assert [c.resumable_tokens for c in r.score(["a", "b"], RouteRequest(PROMPT))] == [0, 0]


def test_pin_and_round_robin() -> None:
    clock = Clock()
    r = router(clock)
    r.update_stats("a", stats_for(PROMPT, [9], clock.now))
    assert r.rank(["a", "b"], RouteRequest(PROMPT, pin="b")) == ["b"]
    assert r.rank(["a"], RouteRequest(PROMPT, pin="b")) == ["a"]  # b is not there: by load
    rr = [r.rank(["b", "a", "c"], RouteRequest(PROMPT, policy="round_robin"))[0] for _ in range(4)]
    assert rr == ["a", "b", "c", "a"]
    with pytest.raises(ValueError, match="routing policy"):
        RouteRequest(PROMPT, policy="random")


def test_wire_form_round_trips_and_rejects_junk() -> None:
    s = stats_for(PROMPT, [2, 7], 5.0, running=3, waiting=1)
    back = ReplicaStats.from_dict(s.to_dict())
    assert back == s
    r = router(Clock())
    r.update_stats("a", {"v": 99})  # foreign version: ignored, routed by load alone
    r.update_stats("b", {})
    assert r.rank(["a", "b"], RouteRequest(PROMPT)) == ["a", "b"]
    with pytest.raises(ValueError, match="malformed"):
        ReplicaStats.from_dict({"v": 1, "time": 1.0})


@pytest.mark.parametrize("kind", KINDS)
def test_published_depth_equals_the_core_hit(kind: str) -> None:
    """Run random multi-turn sessions through a real cache core; for fresh prompts the router's resumable
    depth from the published stats must equal the scheduler's own find_hit."""
    rng = random.Random(7)
    sched = make_scheduler(kind, "recap", block_size=BS, num_kv_blocks=40, num_state_slots=12)
    h = Harness(sched)
    sessions = [[rng.randrange(1000) for _ in range(rng.randrange(5, 14))] for _ in range(5)]
    n = 0
    for _ in range(3):
        for i, prompt in enumerate(sessions):
            salt = "s" if i % 2 else None
            r = h.run_one(req(f"r{n}", prompt, max_tokens=rng.randrange(2, 6), salt=salt))
            sessions[i] = r.all_token_ids + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
            n += 1
    stats = collect_stats(sched.cache, 0, 0, 1.0, StatsLimits())
    probe = CheckpointRouter(RouterConfig(block_size=BS), lambda: 1.0)
    probe.update_stats("x", stats)
    checked = 0
    for i, prompt in enumerate(sessions):
        salt = "s" if i % 2 else None
        for cut in (len(prompt), len(prompt) - 3, 9):
            tokens = prompt[:cut]
            fresh = req(f"probe{checked}", tokens, salt=salt)
            sched.cache.update_hashes(fresh)
            expected = sched.cache.find_hit(fresh).num_tokens
            got = probe.score(["x"], RouteRequest(tokens, cache_salt=salt))[0].resumable_tokens
            assert got == expected, (kind, i, cut)
            checked += 1
    assert any(probe.score(["x"], RouteRequest(p, cache_salt="s" if i % 2 else None))[0].resumable_tokens
               for i, p in enumerate(sessions)), "no session resumable at all: the test shows nothing"
