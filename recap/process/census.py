"""A census of the engine's live records, for leak hunting (/debug/memory, the soak, the steady-memory test).

Two kinds of record:
  per request: entries that exist while a request is in flight (scheduler queues, block tables,
               checkpoint plans, output states, streams); all zero on an idle engine, whatever ran before;
  next step:   the ids the last step finished, which the scheduler hands to the runner with the next
               step, and the runner's per-request state (seeded generators, grammar matchers) that it
               frees then: on an idle engine each runner count is at most the finished ids held;
  bounded:     indexes that outlive requests but stop at a capacity (cached blocks, remembered hashes,
               checkpoints); reported as (count, capacity) so a reader can check count <= capacity.
A record kind that grows with the number of requests served, in neither list, is a leak. Reads the
engine's structures directly: call it on the engine thread (AsyncEngine.call) or with the engine idle.
"""

from __future__ import annotations

from typing import Any


def per_request_records(engine: Any) -> dict[str, int]:
    """Counts that must all be 0 when nothing runs (`engine`: an LLMEngine)."""
    sched = engine.scheduler
    view = sched.view
    cache = sched.cache
    policy = cache.policy
    out = {
        "scheduler_requests": len(view.requests),
        "scheduler_waiting": len(view.waiting),
        "scheduler_running": len(view.running),
        "output_parents": len(engine.outputs.parents),
        "output_children": len(engine.outputs.child_to_parent),
        "policy_plans": len(policy._static),
        "policy_decode_flags": len(policy._decode),
        "cache_seen_upto": len(cache._seen_upto),
    }
    remote = sched.remote  # disaggregation: empty on a single instance
    out.update(remote_queue=len(remote.queue), remote_offers=len(remote.offers), remote_receiving=len(remote.receiving),
               remote_hold_ids=len(remote.hold_ids), remote_held=len(remote.held))
    for name in ("_handles", "_prefill_ids", "_unannounced"):  # DisaggLLMEngine's own (recap.disagg.engine)
        if hasattr(engine, name):
            out[f"disagg{name}"] = len(getattr(engine, name))
    if cache.kv is not None:
        out.update(kv_tables=len(cache.kv.tables), kv_hashed_counts=len(cache.kv._num_hashed))
    if cache.state is not None:
        st = cache.state
        out.update(state_running=len(st.running), state_pending=len(st.pending),
                   state_provisional=len(st._provisional), state_base=len(st._base))
    if cache.window is not None:
        out.update(window_tables=len(cache.window.tables), window_null_counts=len(cache.window._num_null))
    return out


def next_step_records(engine: Any) -> dict[str, int]:
    """Finished ids awaiting the next step, and the runner state they will free (`engine`: an LLMEngine)."""
    runner = engine.runner
    grammar = runner.grammar
    return {"finished_ids": len(engine.scheduler._finished_ids),
            "grammar_matchers": len(grammar._matchers) if grammar is not None else 0}


def bounded_records(engine: Any) -> dict[str, tuple[int, int]]:
    """(count, capacity) of the indexes that outlive requests (`engine`: an LLMEngine)."""
    cache = engine.scheduler.cache
    policy = cache.policy
    out = {
        "policy_extents": (policy.num_extents, policy.extent_capacity),
        "token_text_cache": (len(engine.outputs._token_text), max(len(engine.tokenizer), 1)),
    }
    if cache.kv is not None:
        pool = cache.kv.pool
        out["kv_cached_blocks"] = (pool.num_cached, pool.num_usable)
        out["kv_block_objects"] = (len(pool.blocks), pool.num_blocks)  # created on first use
        out["kv_ghost_hashes"] = (len(pool._ghosts) + len(pool._old_ghosts), 2 * pool._ghost_generation)
    if cache.state is not None:
        pool = cache.state.pool
        out["state_checkpoints"] = (pool.num_checkpoints, pool.num_slots)
    if cache.seen is not None:
        out["seen_hashes"] = (len(cache.seen), cache.seen.capacity)
    return out


def census(engine: Any) -> dict[str, Any]:
    """Both kinds together, as /debug/memory reports them."""
    bounded = bounded_records(engine)
    return {"per_request": per_request_records(engine), "next_step": next_step_records(engine),
            "bounded": {name: {"count": n, "capacity": cap} for name, (n, cap) in bounded.items()}}
