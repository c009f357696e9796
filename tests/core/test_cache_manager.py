"""Managers and the coordinator: the longest common hit for attention-only, SSM-only and hybrid models."""

from __future__ import annotations

import pytest

from recap.config import CacheConfig
from recap.core.cache_manager import NO_HIT, CacheHit, CacheManager
from recap.core.output import PAD_SLOT_ID, CheckpointWrite
from recap.core.policy import Position, Source
from recap.core.request import Request
from recap.core.state_manager import StateManager
from recap.core.state_pool import SlotKind, StatePool
from tests.core.helpers import make_layout

BS = 4


def manager(kind: str, policy: str = "recap", caching: bool = True, **kw: object) -> CacheManager:
    cfg = CacheConfig(block_size=BS, checkpoint_policy=policy, enable_prefix_caching=caching)
    return CacheManager(cfg, make_layout(kind, BS, **kw))  # type: ignore[arg-type]


def run_prefill(cm: CacheManager, r: Request) -> CacheHit:
    """Admit r, compute its whole prompt in one chunk with every planned checkpoint written, free it."""
    cm.update_hashes(r)
    hit = cm.find_hit(r)
    n = r.num_tokens - hit.num_tokens
    assert cm.can_admit(hit, n)
    copy = cm.admit(r, hit, n)
    writes = cm.plan_checkpoints(r, hit.num_tokens, r.num_tokens)
    r.num_computed_tokens = r.num_tokens
    cm.commit(r, writes)
    if copy is not None:
        cm.unpin([copy[0]])
    cm.free(r)
    return hit


PROMPT = list(range(100, 122))  # 22 tokens = 5 full blocks + 2; prompt end at 20


@pytest.mark.parametrize(
    ("kind", "shared", "hit_tokens", "kv_ids", "has_slot", "kv_hit"),
    [
        ("attention", 22, 20, (1, 2, 3, 4, 5), False, 20),
        ("ssm", 22, 20, (), True, 20),
        ("hybrid", 22, 20, (1, 2, 3, 4, 5), True, 20),
        # Diverging at token 18: four blocks match, but the only checkpoint is at 20.
        ("attention", 18, 16, (1, 2, 3, 4), False, 16),
        ("ssm", 18, 0, (), False, 16),  # SSM-only: the seen-hash index stands in for the KV prefix
        ("hybrid", 18, 0, (), False, 16),
    ],
)
def test_longest_common_hit(
    kind: str, shared: int, hit_tokens: int, kv_ids: tuple[int, ...], has_slot: bool, kv_hit: int
) -> None:
    cm = manager(kind)
    assert run_prefill(cm, Request("a", PROMPT, 1)) == NO_HIT
    b = Request("b", PROMPT[:shared] + [7, 7, 7, 7, 7, 7], 1)
    cm.update_hashes(b)
    hit = cm.find_hit(b)
    assert hit.num_tokens == hit_tokens and hit.kv_block_ids == kv_ids and hit.kv_hit_tokens == kv_hit
    assert (hit.checkpoint_slot != PAD_SLOT_ID) == has_slot
    assert hit.checkpoint_miss_tokens == kv_hit - hit_tokens
    if has_slot:
        assert cm.state is not None and cm.state.pool.slot_position[hit.checkpoint_slot] == 20


def test_full_prompt_boundary_is_snapshotted() -> None:
    """A prompt that ends on a boundary leaves its whole state: a longer prompt hits all of it."""
    cm = manager("ssm")
    run_prefill(cm, Request("a", PROMPT[:20], 1))
    b = Request("b", PROMPT[:20] + [1, 2], 1)
    cm.update_hashes(b)
    assert cm.find_hit(b).num_tokens == 20


def test_hit_never_covers_the_last_token() -> None:
    cm = manager("attention")
    run_prefill(cm, Request("a", PROMPT, 1))
    same = Request("b", PROMPT[:21], 1)  # 21 tokens: hit 20, the last token is computed
    cm.update_hashes(same)
    assert cm.find_hit(same).num_tokens == 20
    same = Request("c", PROMPT[:20], 1)  # 20 tokens: 5 cached blocks, but the last token must be computed
    cm.update_hashes(same)
    assert cm.find_hit(same).num_tokens == 16


def test_hybrid_hit_needs_both_groups() -> None:
    cm = manager("hybrid")
    run_prefill(cm, Request("a", PROMPT, 1))
    assert cm.kv is not None
    cm.kv.pool.reset()  # KV gone, checkpoint still there: no hit
    b = Request("b", PROMPT + [1], 1)
    cm.update_hashes(b)
    assert cm.find_hit(b) == NO_HIT


def test_policy_none_never_hits_the_state_group() -> None:
    for kind in ("hybrid", "ssm"):
        cm = manager(kind, policy="none")
        run_prefill(cm, Request("a", PROMPT, 1))
        b = Request("b", PROMPT + [1], 1)
        cm.update_hashes(b)
        assert cm.find_hit(b).num_tokens == 0
    cm = manager("attention", policy="none")
    run_prefill(cm, Request("a", PROMPT, 1))
    b = Request("b", PROMPT + [1], 1)
    cm.update_hashes(b)
    assert cm.find_hit(b).num_tokens == 20  # the policy is about states; KV caching is unaffected


def test_caching_off_hashes_and_hits_nothing() -> None:
    cm = manager("hybrid", caching=False)
    a = Request("a", PROMPT, 1)
    run_prefill(cm, a)
    assert a.block_hashes == []
    assert cm.kv is not None and cm.kv.pool.num_cached == 0
    assert cm.state is not None and cm.state.pool.num_checkpoints == 0


def test_admit_shares_blocks_pins_and_copies() -> None:
    cm = manager("hybrid", num_kv_blocks=9, num_state_slots=3)
    run_prefill(cm, Request("a", PROMPT, 1))
    assert cm.kv is not None and cm.state is not None
    b = Request("b", PROMPT + [1, 2, 3, 4], 1)
    cm.update_hashes(b)
    hit = cm.find_hit(b)
    assert hit.num_tokens == 20 and hit.kv_block_ids == (1, 2, 3, 4, 5)
    src = hit.checkpoint_slot
    copy = cm.admit(b, hit, b.num_tokens - 20)
    assert copy is not None and copy[0] == src and copy[1] != src
    assert cm.state.pool.pins[src] == 1 and cm.state.pool.kind[copy[1]] == SlotKind.RUNNING
    # 26 tokens: 7 blocks = 5 shared + 2 new ones: the never-used 7 and 8 come before a's freed block 6.
    assert cm.block_ids("b") == [1, 2, 3, 4, 5, 7, 8]
    assert all(cm.kv.pool.blocks[i].ref_cnt == 1 for i in cm.block_ids("b"))
    cm.unpin([src])
    cm.free(b)
    cm.kv.pool.check()
    cm.state.pool.check()


def test_admission_refused_when_only_the_hit_checkpoint_could_be_evicted() -> None:
    cm = manager("ssm", num_state_slots=2)
    run_prefill(cm, Request("a", PROMPT, 1))
    assert cm.state is not None
    assert cm.state.pool.num_checkpoints == 1
    other = cm.state.pool.allocate_running()  # somebody else runs in the only other slot
    b = Request("b", PROMPT + [1], 1)
    cm.update_hashes(b)
    hit = cm.find_hit(b)
    assert hit.num_tokens == 20
    assert not cm.can_admit(hit, 3)  # its running slot would have to evict its own checkpoint
    assert cm.can_admit(NO_HIT, 23)
    assert other is not None


def test_provisional_snapshot_superseded_by_the_next() -> None:
    cm = manager("ssm")
    assert cm.state is not None
    r = Request("r", list(range(6)), 10)
    cm.update_hashes(r)
    cm.admit(r, NO_HIT, 6)
    r.num_computed_tokens = 6
    cm.commit(r, cm.plan_checkpoints(r, 0, 6))
    for tok in range(50, 60):  # decode 10 tokens, reaching boundaries 8, 12, 16
        r.output_token_ids.append(tok)
        cm.update_hashes(r)
        start = r.num_computed_tokens
        writes = cm.plan_checkpoints(r, start, start + 1)
        r.num_computed_tokens += 1
        cm.commit(r, writes)
    positions = sorted(
        cm.state.pool.slot_position[s]
        for s in range(cm.state.pool.num_slots)
        if cm.state.pool.kind[s] == SlotKind.CHECKPOINT
    )
    assert positions == [4, 16]  # prompt end 4, and only the last decode snapshot
    cm.free(r)
    assert cm.state.pool.num_checkpoints == 2  # finishing keeps the last snapshot


def test_unwritten_and_mismatched_writes_are_not_registered() -> None:
    cm = manager("hybrid", policy="all")
    assert cm.state is not None
    r = Request("r", list(range(13)), 1)
    cm.update_hashes(r)
    cm.admit(r, NO_HIT, 13)
    writes = cm.plan_checkpoints(r, 0, 13)
    assert [w.position for w in writes] == [4, 8, 12]
    r.num_computed_tokens = 13
    reported = [writes[0], CheckpointWrite(9, writes[1].slot)]  # 8 misreported, 12 not written
    assert cm.commit(r, reported) == 1
    assert cm.state.pool.num_checkpoints == 1 and cm.state.pool.num_refused == 1
    assert cm.state.pool.num_in_use == 1  # only the running slot
    cm.free(r)


def test_evicting_the_kv_block_a_checkpoint_ends_on_drops_the_checkpoint() -> None:
    cm = manager("hybrid", num_kv_blocks=7)  # 6 usable blocks: one 22-token prompt fills them
    assert cm.kv is not None and cm.state is not None
    a = Request("a", PROMPT, 1)
    run_prefill(cm, a)
    end_hash = a.block_hashes[4]  # the checkpoint after 20 tokens is keyed by block 5's hash
    assert cm.state.pool.lookup(end_hash) is not None
    run_prefill(cm, Request("b", list(range(500, 522)), 1))  # unrelated: evicts all of a's blocks
    assert cm.kv.pool.lookup(end_hash) is None
    assert cm.state.pool.lookup(end_hash) is None and cm.state.pool.num_stranded >= 1
    cm.state.pool.check()


def test_plan_every_block_is_plan_of_a_position_per_boundary() -> None:
    """Policy `all` plans from a range: the same writes, plans, bases and pool as one Position each."""
    chains = {"a": list(range(1000, 1016)), "b": list(range(1000, 1008)) + list(range(2000, 2008))}
    chains["c"] = chains["d"] = list(range(3000, 3016))
    steps = [  # (request, block index of its hit or None, base forced past its first boundary or None, chunks)
        ("a", None, None, [(0, 13), (13, 30), (30, 31), (31, 64)]),
        ("b", 7, None, [(32, 48), (48, 64)]),  # hits a's checkpoint after 32 tokens
        ("c", None, 40, [(0, 20), (20, 64)]),
        ("d", None, None, [(20, 44)]),  # c's checkpoints again: registered already
    ]

    def run(every_block: bool) -> list[object]:
        pool = StatePool(6, BS, bytes_per_slot=1, flops_per_token=1.0)  # fewer slots than writes: evictions
        sm = StateManager(pool, BS, enable_caching=True)
        seen: list[object] = []
        for rid, hit, forced_base, chunks in steps:
            hit_slot = pool.lookup(chains[rid][hit]) if hit is not None else None
            sm.admit(rid, PAD_SLOT_ID if hit_slot is None else hit_slot)
            if forced_base is not None:
                sm._base[rid] = forced_base
            for start, end in chunks:
                boundaries = range((start // BS + 1) * BS, end + 1, BS)
                if every_block:
                    writes = sm.plan_every_block(rid, chains[rid], boundaries)
                else:
                    positions = [Position(p, False, False, Source.EVERY_BLOCK) for p in boundaries]
                    writes = sm.plan(rid, chains[rid], positions)
                seen += [writes, list(sm.pending.get(rid, ())), dict(sm._base)]
                r = Request(rid, list(range(end)), 1)
                r.block_hashes = chains[rid]
                sm.commit(r, writes)
                seen += [list(pool.kind), dict(pool._by_hash), [pool.priority(s) for s in pool._by_hash.values()]]
            if hit_slot is not None:
                pool.unpin(hit_slot)
            sm.free(rid)
            pool.check()
        seen += [pool.num_created, pool.num_evicted, pool.num_declined, pool.num_already_registered, sm.num_planned]
        return seen

    assert run(every_block=True) == run(every_block=False)
