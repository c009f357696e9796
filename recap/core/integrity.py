"""Invariant checks over a Scheduler and its pools (DESIGN section 3). O(pools + requests): for tests."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from recap.core.block_pool import NULL_BLOCK_ID, BlockPool
from recap.core.kv_manager import cdiv
from recap.core.output import PAD_SLOT_ID, SchedulerOutput
from recap.core.request import Request, RequestStatus
from recap.core.state_pool import SlotKind
from recap.core.tier_index import TierKey
from recap.core.tier_promotion import Promotion

if TYPE_CHECKING:
    from recap.core.scheduler import Scheduler


def check_scheduler(sched: Scheduler) -> None:
    """Raise AssertionError, naming the broken invariant, if any bookkeeping disagrees."""
    _check_queues(sched)
    _check_kv(sched)
    _check_window(sched)
    _check_state(sched)
    _check_remote(sched)
    _check_tier(sched)
    if sched.last_output is not None and sched.view.in_flight is sched.last_output:
        _check_plan(sched, sched.last_output)


def _check_queues(sched: Scheduler) -> None:
    view = sched.view
    running_ids = [r.request_id for r in view.running]
    waiting_ids = [r.request_id for r in view.waiting]
    remote_ids = [r.request_id for r in sched.remote.queue] + list(sched.remote.receiving)
    remote_ids += list(sched.tiers.promoting) if sched.tiers is not None else []  # waiting on other I/O
    assert len(set(running_ids)) == len(running_ids), "a request is running twice"
    assert not set(running_ids) & set(waiting_ids), "a request is both running and waiting"
    assert len(set(remote_ids)) == len(remote_ids), "a remote request is queued and receiving"
    assert not set(remote_ids) & (set(running_ids) | set(waiting_ids)), "a remote request is also local"
    queued = set(running_ids) | set(waiting_ids) | set(remote_ids)
    assert queued == set(view.requests), "queues and request map disagree"
    assert set(sched.remote.offers) == set(remote_ids) - set(_promotions(sched)), "remote offers and requests disagree"
    assert not set(sched.remote.held) & queued, "a held request is still queued"
    for r in view.deferred:  # async scheduling: finished while a step that reads its slot and blocks ran
        assert r.is_finished and r.request_id not in queued, f"deferred {r.request_id} is not finished"
        assert view.in_flight is not None, f"deferred {r.request_id} outlives the steps in flight"
    num_seats = len(running_ids) + len(sched.remote.receiving)
    assert num_seats <= sched.config.max_num_seqs, "more running (and receiving) requests than max_num_seqs"
    for r in view.running:
        assert r.status == RequestStatus.RUNNING, f"{r.request_id} in running with status {r.status!r}"
        assert 0 <= r.num_computed_tokens <= r.num_tokens, f"{r.request_id} computed past its tokens"
    for r in view.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), f"{r.request_id} waiting as {r.status!r}"
        assert r.num_computed_tokens == 0, f"waiting {r.request_id} keeps computed tokens"
    if sched.cache.enable_caching:
        for r in view.requests.values():
            assert len(r.block_hashes) == r.num_tokens // sched.cache.block_size, f"{r.request_id} hashes lag"


def _check_kv(sched: Scheduler) -> None:
    kv = sched.cache.kv
    if kv is None:
        return
    pool = kv.pool
    pool.check()
    running = _holders(sched)
    assert set(kv.tables) == set(running), "KV tables held by requests that are not running, receiving or held"
    holders: Counter[int] = Counter()
    for rid, table in kv.tables.items():
        holders.update(table)
        assert NULL_BLOCK_ID not in table and PAD_SLOT_ID not in table, f"{rid} holds the null or a pad block"
        r = running[rid]
        assert len(table) >= cdiv(r.num_computed_tokens, kv.block_size), f"{rid} table too short"
        for i, block_id in enumerate(table):
            block_hash = pool.blocks[block_id].block_hash
            # Salt isolation: a shared block carries this request's own chain hash, salt included.
            assert block_hash is None or block_hash == r.block_hashes[i], f"{rid} block {i} from another chain"
            # A block is hashed only once computed: one past the computed tokens holds a draft's KV at most.
            running_req = r.status == RequestStatus.RUNNING
            assert block_hash is None or not running_req or (i + 1) * kv.block_size <= r.num_computed_tokens, (
                f"{rid} block {i} registered past its {r.num_computed_tokens} computed tokens")
    for promotion in _promotions(sched).values():
        holders.update(promotion.held_blocks)
    _check_refs(pool, holders, "")


def _check_refs(pool: BlockPool, holders: Counter[int], group: str) -> None:
    """Every block's ref count is its number of holders; free + cached + in-use == total."""
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id], f"{group}block {block.block_id} ref {block.ref_cnt} != holders"
    assert pool.num_free + pool.num_in_use == pool.num_usable, f"free + cached + in-use != total {group}blocks"


def _check_window(sched: Scheduler) -> None:
    """The window group: as the KV group, plus null entries exactly where blocks left the window."""
    window = sched.cache.window
    if window is None:
        return
    pool = window.pool
    pool.check()
    running = _holders(sched)
    assert set(window.tables) == set(running), "window tables held by requests that are not running"
    holders: Counter[int] = Counter()
    for held in sched.remote.held.values():  # cached blocks before the table, touched for the decode side
        holders.update(held.window.extra if held.window is not None else ())
    for rid, table in window.tables.items():
        r = running[rid]
        num_null = window.num_null(rid)
        receiving = sched.remote.receiving.get(rid)  # its table covers the prompt it has not computed here
        computed = r.num_computed_tokens if receiving is None else receiving.num_prompt_tokens
        assert all(b == NULL_BLOCK_ID for b in table[:num_null]), f"{rid} holds a block out of its window"
        live = table[num_null:]
        holders.update(live)
        assert NULL_BLOCK_ID not in live and PAD_SLOT_ID not in live, f"{rid} reads a null or pad window block"
        assert num_null <= window.num_out_of_window(computed), f"{rid} freed a block still in its window"
        assert len(table) >= cdiv(computed, window.block_size), f"{rid} window table too short"
        for i, block_id in enumerate(live, num_null):
            block_hash = pool.blocks[block_id].block_hash
            assert block_hash is None or block_hash == r.block_hashes[i], f"{rid} window block {i} from another chain"
    for promotion in _promotions(sched).values():
        holders.update(promotion.held_window)
    _check_refs(pool, holders, "window ")
    _check_window_transfers(sched)


def _check_window_transfers(sched: Scheduler) -> None:
    """A held request's window run is its table from `start`, the touched blocks before it cached under its own
    chain; a receiving request's window blocks land in its table, at the indices planned."""
    window = sched.cache.window
    assert window is not None
    for rid, held in sched.remote.held.items():
        hold = held.window
        assert hold is not None, f"held {rid} keeps no window blocks"
        table, num_null = window.tables[rid], window.num_null(rid)
        assert hold.start + len(hold.extra) == num_null, f"held {rid} window run has a gap"
        assert list(hold.block_ids) == [NULL_BLOCK_ID] * hold.start + list(hold.extra) + table[num_null:]
        for i, block_id in enumerate(hold.extra, hold.start):
            block_hash = window.pool.blocks[block_id].block_hash
            assert block_hash == held.request.block_hashes[i], f"held {rid} window block {i} from another chain"
    for rid, plan in sched.remote.receiving.items():
        table = window.tables[rid]
        assert [table[i] for i in plan.window.indices] == list(plan.window.block_ids), f"{rid} receives elsewhere"
        assert NULL_BLOCK_ID not in plan.window.block_ids, f"{rid} receives a window block into the null block"


def _check_state(sched: Scheduler) -> None:
    state = sched.cache.state
    if state is None:
        return
    pool = state.pool
    pool.check()
    running_ids = set(_holders(sched))
    assert set(state.running) == running_ids, "running slots held by requests that are not running, receiving or held"
    slots = list(state.running.values())
    assert len(set(slots)) == len(slots), "two requests share a running slot"
    assert all(pool.kind[s] == SlotKind.RUNNING for s in slots), "a running slot is not RUNNING"
    pending = [p.write.slot for plans in state.pending.values() for p in plans]
    pending += [p.load.checkpoint[1] for p in _promotions(sched).values() if p.load.checkpoint is not None]
    assert len(set(pending)) == len(pending), "a checkpoint slot planned twice"
    assert all(pool.kind[s] == SlotKind.PENDING for s in pending), "a planned slot was registered early"
    # A receiving request's checkpoint slots stay PENDING until its data arrives; others live one step.
    stepping = [rid for rid in state.pending if rid not in sched.remote.receiving]
    view = sched.view
    assert view.in_flight is not None or not stepping, "planned checkpoints outlive their step"
    assert pool.num_in_use == len(slots) + len(pending), "free + checkpoints + in-use != total slots"
    pins = Counter(view.pins) + Counter(sched.remote.held_pins())
    for slot in range(pool.num_slots):
        assert pool.pins[slot] == pins[slot], f"slot {slot} pinned {pool.pins[slot]} times, copies {pins[slot]}"
        if pins[slot]:
            assert pool.kind[slot] == SlotKind.CHECKPOINT, f"pinned checkpoint {slot} was evicted"


def _holders(sched: Scheduler) -> dict[str, Request]:
    """Requests that may hold KV blocks and a running slot: running, receiving, held and deferred ones."""
    view = sched.view
    out = {r.request_id: r for r in view.running}
    out.update((rid, view.requests[rid]) for rid in sched.remote.receiving)
    out.update((rid, h.request) for rid, h in sched.remote.held.items())
    out.update((r.request_id, r) for r in view.deferred)  # async scheduling: freed after the step in flight
    return out


def _promotions(sched: Scheduler) -> dict[str, Promotion]:
    return sched.tiers.promoting if sched.tiers is not None else {}


def _check_tier(sched: Scheduler) -> None:
    """Each tier's own accounting; an entry in one tier at most; a promoting request holds exactly its load's
    blocks, slot and tier pins; save orders name entries pending in their tier."""
    tiers = sched.tiers
    if tiers is None:
        return
    held: Counter[TierKey] = Counter()
    for index in tiers.indexes:
        index.check()
        held.update(index.iter_keys())
    assert all(n == 1 for n in held.values()), "an entry is in two tiers"
    pins: Counter[tuple[int, TierKey]] = Counter()
    for rid, p in tiers.promoting.items():
        r = sched.view.requests[rid]
        assert r.status == RequestStatus.WAITING_FOR_TIER and r.num_computed_tokens == 0, f"promoting {rid}"
        assert rid in tiers.tried, f"promoting {rid} not marked as tried"
        pins.update((level, key) for key, _, level in p.load.entries())
        dest = [b for _, b in p.load.kv]
        assert tuple(p.held_blocks[len(p.held_blocks) - len(dest):]) == tuple(dest), f"{rid} holds other blocks"
        if sched.cache.kv is not None:
            for i, block_id in enumerate(p.held_blocks):
                block_hash = sched.cache.kv.pool.blocks[block_id].block_hash
                assert block_hash is None or block_hash == r.block_hashes[i], f"promoting {rid} block {i} off-chain"
        _check_window_promotion(sched, r, p)
    for level, index in enumerate(tiers.indexes):
        for key in index.iter_keys():
            assert index.is_pinned(key) == (pins[level, key] > 0), f"tier pin of {key} disagrees with the loads"
    for level, key in pins:
        assert tiers.indexes[level].has(key), f"a load reads {key}, which its tier does not hold"
    saved = [(s.level, s.key) for s in tiers.saves]
    assert len(set(saved)) == len(saved), "a save ordered twice"
    for level, key in saved:
        assert tiers.indexes[level].has(key) and not tiers.indexes[level].is_ready(key), f"save of {key} not pending"


def _check_window_promotion(sched: Scheduler, r: Request, p: Promotion) -> None:
    """A promoting request holds the window blocks before its target in chain order: cached ones of its chain, and
    unhashed destinations its load fills with the entries of those very positions."""
    window, rid = sched.cache.window, r.request_id
    if window is None or not window.span:
        assert not p.held_window and not p.load.window, f"promoting {rid} holds window blocks without a window group"
        return
    assert len(p.held_window) == min(p.target, window.span), f"promoting {rid} holds another window than its target's"
    dest = {b: key for key, b in p.load.window}
    assert len(dest) == len(p.load.window) and set(dest) <= set(p.held_window), f"promoting {rid} loads elsewhere"
    first = p.target - len(p.held_window)
    for i, block_id in enumerate(p.held_window, first):
        block_hash = window.pool.blocks[block_id].block_hash
        key = dest.get(block_id)
        got = block_hash if key is None else key.block_hash
        assert got == r.block_hashes[i] and (key is None or block_hash is None), f"promoting {rid} window block {i}"


def _check_remote(sched: Scheduler) -> None:
    """Queued remote requests hold nothing; receiving ones hold exactly their plan; held ones their offer."""
    cache, book, requests = sched.cache, sched.remote, sched.view.requests
    bs = cache.block_size
    for r in book.queue:
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KV and r.num_computed_tokens == 0, f"{r.request_id}"
        holds_kv = cache.kv is not None and r.request_id in cache.kv.tables
        holds_slot = cache.state is not None and r.request_id in cache.state.running
        assert not (holds_kv or holds_slot), f"queued remote request {r.request_id} holds cache resources"
    for rid, plan in book.receiving.items():
        r = requests[rid]
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KV and r.num_computed_tokens == 0, f"{rid} receiving"
        if cache.kv is not None:
            table = cache.kv.tables[rid]
            assert len(table) == cdiv(plan.num_prompt_tokens, bs), f"{rid} table does not cover its prompt"
            assert tuple(table[i] for i in plan.block_indices) == plan.block_ids, f"{rid} plan and table disagree"
            assert plan.block_indices == tuple(range(plan.num_local_blocks, len(table))), f"{rid} block indices"
        if cache.state is not None:
            assert cache.state.running[rid] == plan.state_slot, f"{rid} plan and running slot disagree"
            planned = [p.write for p in cache.state.pending.get(rid, ())]
            assert planned == [c.write for c in plan.checkpoints], f"{rid} plan and pending checkpoints disagree"
    for rid, held in book.held.items():
        assert held.request.is_finished, f"held {rid} is not finished"
        if cache.kv is not None:
            assert tuple(cache.kv.tables[rid]) == held.block_ids, f"held {rid} table changed"
        if cache.state is not None:
            pool = cache.state.pool
            assert cache.state.running[rid] == held.state_slot, f"held {rid} running slot changed"
            for c in held.checkpoints:
                assert pool.kind[c.slot] == SlotKind.CHECKPOINT and pool.slot_hash[c.slot] == c.block_hash, (
                    f"held {rid} checkpoint {c} was evicted or replaced")


def _check_plan(sched: Scheduler, out: SchedulerOutput) -> None:
    bs = sched.cache.block_size
    has_kv, has_state = sched.cache.kv is not None, sched.cache.state is not None
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens, "step over the token budget"
    assert len(out.scheduled) <= sched.config.max_num_seqs, "step over max_num_seqs"
    spec = sched.speculator
    drafting = [sr.num_draft_tokens + sr.num_runner_drafts for sr in out.scheduled
                if sr.num_draft_tokens or sr.num_runner_drafts]  # fmt: skip
    assert spec is not None or not drafting, "drafts without a speculator"
    if spec is not None:
        assert len(drafting) <= spec.max_rows, "more drafting rows than the runner has scratch slots for"
        assert all(k <= spec.config.num_speculative_tokens for k in drafting), "more drafts than num_speculative_tokens"
    for src, dst in out.state_copies:
        assert src != PAD_SLOT_ID and dst != PAD_SLOT_ID and src != dst, f"bad state copy {src}->{dst}"
    for sr in out.scheduled:
        start, end = sr.num_computed_tokens, sr.num_computed_tokens + sr.num_new_tokens
        assert sr.num_new_tokens > 0, f"{sr.request_id} scheduled with no tokens"
        if has_kv:
            assert len(sr.block_ids) >= cdiv(end, bs), f"{sr.request_id} block table too short for its chunk"
            assert NULL_BLOCK_ID not in sr.block_ids and PAD_SLOT_ID not in sr.block_ids, "null/pad block in plan"
        assert (sr.state_slot != PAD_SLOT_ID) == has_state, f"{sr.request_id} state slot {sr.state_slot}"
        window = sched.cache.window
        if window is not None:  # running requests free what left the window before they step again
            table = sr.window_block_ids
            assert len(table) >= cdiv(end, bs), f"{sr.request_id} window table too short for its chunk"
            num_null = window.num_out_of_window(start)
            assert all(b != NULL_BLOCK_ID for b in table[num_null:]), f"{sr.request_id} window reads the null block"
            # Async scheduling: a row scheduled ahead frees only what left the window of the tokens on the host.
            tidy = not sched.config.async_scheduling
            out_of_window = table[:num_null] if tidy else []
            assert all(b == NULL_BLOCK_ID for b in out_of_window), f"{sr.request_id} holds blocks out of its window"
        if sr.num_draft_tokens:  # speculation: drafts follow one decode token; no checkpoint inside them
            assert 0 < sr.num_draft_tokens < sr.num_new_tokens and sr.sample, f"{sr.request_id} drafts without a decode"
            known = end - sr.num_draft_tokens
            assert all(c.position <= known for c in sr.checkpoints), f"{sr.request_id} checkpoint inside drafts"
            assert known // bs == end // bs, f"{sr.request_id} drafts reach a block boundary"
        if sr.num_runner_drafts:  # the runner's drafts follow the decode token, in its block
            assert not sr.num_draft_tokens and sr.num_new_tokens == 1 and sr.sample, f"{sr.request_id} runner drafts"
            assert end // bs == (end + sr.num_runner_drafts) // bs, f"{sr.request_id} drafts reach a block boundary"
        positions = [c.position for c in sr.checkpoints]
        assert positions == sorted(set(positions)), f"{sr.request_id} checkpoint positions not sorted/unique"
        for c in sr.checkpoints:
            assert c.slot != PAD_SLOT_ID, f"{sr.request_id} checkpoint into the pad slot"
            assert c.position % bs == 0 and start < c.position <= end, f"{sr.request_id} checkpoint {c} off-chunk"
