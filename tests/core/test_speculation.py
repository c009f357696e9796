"""Speculation in the cache core: drafts' caps, the n-gram drafter against its reference, and random schedules
(hits, preemption, aborts, every policy and group kind) whose verify steps accept random numbers of drafts, run
against the validating FakeExecutor: a rejected draft's KV read before it is overwritten, a running slot not rolled
back to the accepted tokens, or a checkpoint or block hash that depends on a draft fails there or in the integrity
check around every step."""

from __future__ import annotations

import math
import random

import pytest

from recap.config import SpeculativeConfig
from recap.core.drafter import NgramDrafter, ngram_propose_ref
from recap.core.fake_executor import FakeExecutor
from recap.core.request import Request
from recap.core.speculation import FIRST_DRAFTS, Speculator, backoff_steps
from tests.core.helpers import Harness, make_scheduler, req


class MixedDrafter:
    """Proposes the executor's own next samples, each kept with probability `p_good` (else a wrong token)."""

    def __init__(self, executor: FakeExecutor, rng: random.Random, p_good: float) -> None:
        self.executor, self.rng, self.p_good = executor, rng, p_good

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        done = len(request.output_token_ids)
        out = []
        for j in range(self.rng.randint(0, max_tokens)):
            right = self.executor.sample(request.request_id, done + j)
            out.append(right if self.rng.random() < self.p_good else (right + 1) % self.executor.vocab_size)
        return out

    def forget(self, request_id: str) -> None:
        pass


def _speculating(kind: str, policy: str, k: int, max_rows: int = 16, **kw: object) -> Harness:
    sched = make_scheduler(kind, policy, **kw)  # type: ignore[arg-type]
    h = Harness(sched)
    sched.speculator = Speculator(SpeculativeConfig(num_speculative_tokens=k), sched.cache.block_size,
                                  sched.config.max_model_len, max_rows=max_rows)  # fmt: skip
    return h


def _workload(h: Harness, rng: random.Random, n: int, speculate: bool) -> None:
    """Requests sharing prefixes (hits, decode-region continuations), a few aborted mid-flight."""
    base = [rng.randrange(3, 200) for _ in range(40)]
    step = 0
    for i in range(n):
        cut = rng.randint(1, 40)
        prompt = base[:cut] + [rng.randrange(3, 200) for _ in range(rng.randint(1, 9))]
        h.add(req(f"r{i}", prompt, max_tokens=rng.randint(1, 20), speculate=speculate))
        for _ in range(rng.randint(0, 4)):
            if h.sched.has_unfinished_requests():
                h.step()
                step += 1
                if step % 11 == 0 and h.sched.view.running:
                    h.sched.abort_requests([h.sched.view.running[-1].request_id])
    h.run()


@pytest.mark.parametrize("kind", ["hybrid", "ssm", "attention", "hybrid+window"])
@pytest.mark.parametrize("policy", ["recap", "all"])
def test_random_schedules_with_speculation(kind: str, policy: str) -> None:
    for seed, (k, p_good) in enumerate([(2, 0.0), (3, 0.6), (5, 0.85), (7, 1.0)]):
        rng = random.Random(seed)
        # A small KV pool and a small budget: preemption and chunked prefill happen alongside verify steps.
        h = _speculating(kind, policy, k=k, max_rows=1 + seed, block_size=8, num_kv_blocks=14,
                         max_num_batched_tokens=12)  # fmt: skip
        assert h.sched.speculator is not None
        h.sched.speculator.drafter = MixedDrafter(h.executor, rng, p_good=p_good)
        _workload(h, rng, 14, speculate=True)
        c = h.sched.speculator.counters
        assert c.num_drafts > 0, "no verify step ran"
        assert sum(c.accepted_per_position) == c.num_accepted_tokens <= c.num_draft_tokens
        assert h.sched.stats.checkpoints_refused == 0


def test_outputs_equal_the_plain_schedule() -> None:
    """The fake samples a function of (request, index): with drafts, every request still gets exactly those."""
    outputs = []
    for speculate in (False, True):
        rng = random.Random(7)
        h = _speculating("hybrid", "recap", k=4)
        assert h.sched.speculator is not None
        h.sched.speculator.drafter = MixedDrafter(h.executor, random.Random(1), p_good=0.7)
        requests = [h.add(req(f"q{i}", [rng.randrange(3, 200) for _ in range(rng.randint(2, 30))], max_tokens=17,
                              speculate=speculate)) for i in range(6)]  # fmt: skip
        h.run()
        outputs.append([r.output_token_ids for r in requests])
        assert (h.sched.speculator.counters.num_drafts > 0) == speculate
    assert outputs[0] == outputs[1]


def test_drafts_never_reach_a_block_boundary_past_the_committed_tokens() -> None:
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=8), block_size=16, max_model_len=100)
    r = Request("a", list(range(20)), max_tokens=50)
    assert spec.max_drafts(r, budget=64) == 8  # N = 20: the next boundary 32 leaves 11
    r.output_token_ids = [1] * 7  # N = 27: boundary 32 -> positions up to 31 may hold drafts' states
    assert spec.max_drafts(r, budget=64) == 4
    r.output_token_ids = [1] * 11  # N = 31: the next token completes a block
    assert spec.max_drafts(r, budget=64) == 0
    r.output_token_ids = [1] * 12  # N = 32: the boundary is the committed token's
    assert spec.max_drafts(r, budget=3) == 2  # the budget counts the decode token
    r.output_token_ids = [1] * 47  # max_tokens 50: 3 more tokens, so 2 drafts and the verifier's
    assert spec.max_drafts(r, budget=64) == 2
    r2 = Request("b", list(range(97)), max_tokens=50)
    assert spec.max_drafts(r2, budget=64) == 2  # max_model_len 100


class Always:
    def propose(self, request: Request, max_tokens: int) -> list[int]:
        return [0] * max_tokens

    def forget(self, request_id: str) -> None:
        pass


def test_backoff_after_verify_steps_that_accept_nothing() -> None:
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=2, max_draft_backoff=5), 16, 1000, Always())
    r = Request("a", [1, 2, 3], max_tokens=500, speculate=True)
    pattern = []
    for _ in range(30):
        drafts = spec.draft(r, budget=64)
        pattern.append(len(drafts))
        if drafts:
            spec.accept(r, drafts, [7] if len(pattern) < 20 else [0, 7], len(drafts))  # misses, then one accepted draft
    # misses skip 1, then 5 (7 capped by max_draft_backoff) steps, and halve the drafts (2 -> 1); an accepted
    # draft resets both
    assert pattern == [2, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2]
    spec.forget("a")
    assert spec.draft(r, budget=64) == [0, 0]
    assert Speculator(SpeculativeConfig(max_draft_backoff=0), 16, 1000, Always()).draft(r, 64) == [0] * 4


def test_cap_starts_short_and_doubles_while_every_draft_is_accepted() -> None:
    """k = 15: the first step carries FIRST_DRAFTS (4), each step accepting all it carried doubles the cap up to
    k, a partial acceptance keeps it, a miss halves it (and backs off), an acceptance after that restores at
    least the first cap."""
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=15, max_draft_backoff=1), 1000, 10_000, Always())
    r = Request("a", [1, 2, 3], max_tokens=5000, speculate=True)
    sizes = []

    def step(accepted: int | None) -> None:
        drafts = spec.draft(r, budget=64)
        sizes.append(len(drafts))
        if drafts:
            a = len(drafts) if accepted is None else accepted
            spec.accept(r, drafts, [*drafts[:a], 9], len(drafts))

    for accepted in (None, None, None, None, 3, 0, None, 1, None):
        step(accepted)
    # 4 -> 8 -> 15 (k) -> 15; a partial acceptance (3 of 15) keeps 15; a miss: one skipped step, then 7; 1 of 7
    # accepted keeps 7; all 7 accepted: 14, then all 14: 15
    assert sizes == [FIRST_DRAFTS, 8, 15, 15, 15, 15, 0, 7, 7]
    step(None)
    assert sizes[-1] == 14 and spec.cap("a") == 15
    small = Speculator(SpeculativeConfig(num_speculative_tokens=2), 1000, 10_000, Always())
    assert small.draft(r, budget=64) == [0, 0]  # k below FIRST_DRAFTS: k from the first step, as before


def _verify_steps(bound: int, n: int, right_from: int | None = None) -> list[tuple[int, int]]:
    """(step, drafts) of each verify step in a request's first n decode steps (k = 15, no block boundary in
    reach): the drafter always proposes 0; the target emits 7 until step `right_from`, 0 from there on."""
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=15, max_draft_backoff=bound), 1 << 20, 1 << 22, Always())
    r = Request("a", [1, 2, 3], max_tokens=n + 100, speculate=True)
    out = []
    for step in range(n):
        right = right_from is not None and step >= right_from
        spec.begin_step(decode_rows=1)
        drafts = spec.draft(r, budget=64)
        emitted = [*drafts, 0] if right else [7]
        if drafts:
            out.append((step, len(drafts)))
            spec.accept(r, drafts, emitted, len(drafts))
        r.output_token_ids += emitted if drafts else emitted[-1:]
    return out


def test_probes_of_a_drafter_that_is_never_right_thin_out_geometrically() -> None:
    """Nothing ever accepted: verify steps after skips of 1, 7, 31, 127, ... steps (backoff_steps), the first
    carrying FIRST_DRAFTS, the second half as many, the rest 1 draft. Unbounded, their number in the first N
    steps is at most 1 + log4(1.5 N + 1): O(log N); with the bound B, once the skips reach it, one per B + 1."""
    steps = _verify_steps(bound=1 << 30, n=20_000)
    assert [s for s, _ in steps] == [0, 2, 10, 42, 170, 682, 2730, 10922]
    assert [d for _, d in steps] == [FIRST_DRAFTS, FIRST_DRAFTS // 2, 1, 1, 1, 1, 1, 1]
    for n in (1, 3, 10, 128, 1000, 20_000):
        assert sum(s < n for s, _ in steps) <= 1 + math.log(1.5 * n + 1, 4)
    bounded = [s for s, _ in _verify_steps(bound=64, n=1000)]
    assert bounded[:6] == [0, 2, 10, 42, 107, 172]  # 5 verify steps in 128 (the backoff before: 6)
    assert len(bounded) == 4 + (1000 - 1 - 42) // 65
    assert [backoff_steps(m, 64) for m in range(1, 6)] == [1, 7, 31, 64, 64]
    assert [backoff_steps(m, 0) for m in range(1, 4)] == [0, 0, 0]


def test_drafts_grow_back_once_a_request_that_kept_missing_is_right_again() -> None:
    """Four misses (probes down to 1 draft, the skips grown to 31 steps), then the drafter's token is committed
    at step 100: the skipped step's noted proposal ends the backoff at step 101, not at the next probe (107),
    and the cap doubles back to k while every draft is accepted."""
    steps = _verify_steps(bound=64, n=110, right_from=100)
    assert steps[:4] == [(0, FIRST_DRAFTS), (2, 2), (10, 1), (42, 1)]
    assert steps[4][0] == 101
    assert [d for _, d in steps[4:8]] == [1, FIRST_DRAFTS, 8, 15]


class Echo:
    """Proposes `token` max_tokens times."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        return [self.token] * max_tokens

    def forget(self, request_id: str) -> None:
        pass


def _after_two_misses(committed: int) -> list[int]:
    """Drafts at the step after a skipped one that committed `committed`, two misses into a backoff (which skips
    7 steps after the second miss); the drafter always proposes 7, the target emits 5 where it misses."""
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=2, max_draft_backoff=64), 16, 10_000, Echo(7))
    r = Request("a", [1, 2, 3], max_tokens=500, speculate=True)
    assert spec.draft(r, budget=64) == [7, 7]
    spec.accept(r, [7, 7], [5], 2)  # miss: skip 1 step, cap 1
    r.output_token_ids.append(5)
    assert spec.draft(r, budget=64) == []  # skipped: the drafter's 7 noted, 5 committed
    r.output_token_ids.append(5)
    assert spec.draft(r, budget=64) == [7]
    spec.accept(r, [7], [5], 1)  # second miss: skip 7 steps
    r.output_token_ids.append(5)
    assert spec.draft(r, budget=64) == []  # skipped: 7 noted
    r.output_token_ids.append(committed)
    return spec.draft(r, budget=64)


def test_a_backoff_ends_when_the_skipped_steps_proposal_comes_true() -> None:
    """While backing off, the drafter's next token is noted at each skipped step and checked against the token
    that step commits: a right one ends the skip (the next step drafts again); a wrong one does not."""
    assert _after_two_misses(committed=7) == [7]
    assert _after_two_misses(committed=5) == []


def test_ngram_drafter_matches_reference() -> None:
    rng = random.Random(0)
    for trial in range(200):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        drafter = NgramDrafter(lo, hi)
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 6))]
        r = Request(f"t{trial}", tokens[:], max_tokens=100)
        for _ in range(rng.randint(1, 25)):  # the index grows with the committed tokens
            k = rng.randint(1, 6)
            assert drafter.propose(r, k) == ngram_propose_ref(r.all_token_ids, lo, hi, k)
            r.output_token_ids.extend(rng.randrange(4) for _ in range(rng.randint(1, 3)))
        drafter.forget(r.request_id)
        assert not drafter._indexes


def test_ngram_drafter_prefers_the_longest_latest_match() -> None:
    drafter = NgramDrafter(1, 3)
    r = Request("x", [1, 2, 3, 9, 2, 3, 7, 1, 2, 3], max_tokens=10)
    assert drafter.propose(r, 2) == [9, 2]  # "1 2 3" occurred at 0..2 (the longest n); "2 3" later is shorter
    assert NgramDrafter(1, 2).propose(Request("y", r.prompt_token_ids, max_tokens=10), 3) == [7, 1, 2]
    # A match near the end continues its own pattern: a run proposes more of the run, a cycle more of the cycle.
    assert NgramDrafter(1, 3).propose(Request("z", [5, 8, 8, 8], max_tokens=10), 4) == [8, 8, 8, 8]
    assert NgramDrafter(2, 2).propose(Request("w", [4, 1, 2, 1, 2], max_tokens=10), 5) == [1, 2, 1, 2, 1]


@pytest.mark.parametrize("bad, match", [
    ("{", "not valid JSON"), ("[1]", "JSON object"), ('{"method": "eagle"}', "not supported"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', ">= 1"), ('{"num_speculative_tokens": 2}', "needs a 'method'"),
    ('{"method": "ngram", "k": 2}', "unknown keys"),
    ('{"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "exceeds"),
    ('{"method": "ngram", "max_draft_backoff": -1}', "max_draft_backoff"),
])  # fmt: skip
def test_speculative_config_errors(bad: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(bad)


def test_speculative_config_parses_vllm_json() -> None:
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert cfg == SpeculativeConfig("ngram", 5, 1, 3)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse({"method": "ngram"}) == SpeculativeConfig()


def test_a_steps_drafts_share_the_room_max_step_tokens_leaves() -> None:
    """max_step_tokens 16 (the CPU verify graph's): with 8 decode rows the step's drafts total at most 8, shared
    evenly (what a row leaves goes to the rows after it), each row's own cap still holding; one row may take 15;
    None keeps every row's own cap."""
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=15), 1000, 10_000, Always(), max_step_tokens=16)
    rows = [Request(f"r{i}", [1, 2, 3], max_tokens=500, speculate=True) for i in range(8)]
    spec.begin_step(decode_rows=8)
    assert [len(spec.draft(r, budget=64)) for r in rows] == [1] * 8
    spec.begin_step(decode_rows=4)  # 12 left for 4 rows: 3 each
    assert [spec.runner_drafts(r, budget=64) for r in rows[:4]] == [3] * 4
    spec.begin_step(decode_rows=8)
    plain = Request("p", [1, 2, 3], max_tokens=50, speculate=False)  # asked first, drafts nothing: its share
    assert [spec.runner_drafts(r, budget=64) for r in (plain, *rows[1:8])] == [0, 2, 1, 1, 1, 1, 1, 1]
    spec.begin_step(decode_rows=2)  # 14 for 2 rows: each row's own cap (4) is the bound
    assert spec.draft(rows[0], budget=64) == [0] * FIRST_DRAFTS and len(spec.draft(rows[1], budget=64)) == 4
    for want in (FIRST_DRAFTS, 8, 15):  # r0 alone, every draft accepted: its cap grows to k, the room holds it
        spec.begin_step(decode_rows=1)
        drafts = spec.draft(rows[0], budget=64)
        assert len(drafts) == want
        spec.accept(rows[0], drafts, [*drafts, 9], len(drafts))
    spec.begin_step(decode_rows=20)  # more rows than the limit: no drafts at all
    assert spec.draft(rows[0], budget=64) == []
    free = Speculator(SpeculativeConfig(num_speculative_tokens=15), 1000, 10_000, Always())
    free.begin_step(decode_rows=8)
    assert [len(free.draft(r, budget=64)) for r in rows] == [FIRST_DRAFTS] * 8


def test_scheduled_verify_steps_stay_within_max_step_tokens() -> None:
    """Eight requests whose drafts are always right (caps growing to k = 15): every step with drafts whose rows
    are all decodes holds at most max_step_tokens tokens, drafts still run, and the outputs are the plain ones."""
    outputs = []
    for limit in (None, 16):
        h = _speculating("hybrid", "recap", k=15, block_size=64, num_kv_blocks=40, max_num_batched_tokens=256)
        spec = h.sched.speculator
        assert spec is not None
        spec.max_step_tokens = limit
        spec.drafter = MixedDrafter(h.executor, random.Random(3), p_good=1.0)
        rng = random.Random(5)
        requests = [h.add(req(f"q{i}", [rng.randrange(3, 200) for _ in range(6)], max_tokens=60, speculate=True))
                    for i in range(8)]  # fmt: skip
        widest = 0
        while h.sched.has_unfinished_requests():
            h.step()
            out = h.sched.last_output
            drafts = sum(sr.num_draft_tokens for sr in out.scheduled)
            if drafts and all(len(sr.token_ids) - sr.num_draft_tokens == 1 for sr in out.scheduled):
                tokens = sum(len(sr.token_ids) for sr in out.scheduled)
                widest = max(widest, tokens)
                assert limit is None or tokens <= limit
        assert spec.counters.num_accepted_tokens > 0
        assert widest > 16 if limit is None else 8 < widest <= 16
        outputs.append([r.output_token_ids for r in requests])
    assert outputs[0] == outputs[1]
