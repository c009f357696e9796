"""Trace replay: the real Scheduler and cache manager, a tensor-free executor, a simulated clock.

Requests are admitted when the simulated clock reaches their timestamp; every step is scheduled,
executed by `FakeExecutor` (every planned checkpoint written, deterministic tokens, never EOS) and
applied with `update_from_output`; the clock then advances by the cost model's step time. When
nothing runs, the clock jumps to the next arrival. A request finishes after `output_length` tokens.

Budgets (DESIGN section 4): `--kv-cache-bytes` / `--state-cache-bytes` become
`num_kv_blocks = bytes / (kv_bytes_per_token * block_size) + 1` (null block) and
`num_state_slots = bytes / state_bytes_per_slot` (running slots and checkpoints share them);
`--state-checkpoints K` gives `K + max_num_seqs` slots (running requests never eat the checkpoint
budget); `--kv-unbounded` gives enough blocks that no cached KV block is ever evicted.

Usage: python -m recap.bench.replay --trace FILE --policy none align all recap --model-shape hybrid-7b
           --kv-unbounded --state-checkpoints 512
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from recap.bench.cost import DEFAULT_FLOPS_PER_SECOND, DEFAULT_STEP_OVERHEAD_S, CostModel
from recap.bench.replay_pool import ReplayStatePool
from recap.bench.replay_tiers import (
    ReplayTierRunner,
    TierSpec,
    add_tier_arguments,
    attach_tiers,
    format_tiers,
    tier_specs,
)
from recap.bench.report import ReplayResult, format_table, summary_json
from recap.bench.shapes import (
    ModelShape,
    format_bytes,
    get_shape,
    kv_blocks_for_bytes,
    state_slots_for_bytes,
)
from recap.bench.trace import TokenExpander, TraceRequest, add_trace_arguments, load_trace, prompt_token_ids
from recap.bench.variants import PolicySpec, apply_variant, parse_policy
from recap.config import SchedulerConfig
from recap.core.fake_executor import FakeExecutor
from recap.core.request import Request
from recap.core.scheduler import Scheduler
from recap.units import parse_bytes


@dataclass(frozen=True)
class ReplaySetup:
    """Everything but the policy: model shape, pool sizes, scheduler limits, cost model."""

    shape: ModelShape
    block_size: int
    num_kv_blocks: int
    num_state_slots: int
    scheduler: SchedulerConfig
    cost: CostModel
    kv_cache_bytes: int | None = None
    state_cache_bytes: int | None = None
    tiers: tuple[TierSpec, ...] = ()  # below the read pools, fastest first (replay_tiers.py)

    def describe(self) -> dict:
        s = self.shape
        return {
            "tiers": [{"name": t.name, "budget_bytes": t.budget_bytes, "bandwidth": t.bandwidth} for t in self.tiers],
            "model_shape": s.name,
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
            "kv_bytes": (self.num_kv_blocks - 1) * self.block_size * s.kv_bytes_per_token,
            "num_state_slots": self.num_state_slots,
            "state_bytes": self.num_state_slots * s.state_bytes_per_slot,
            "state_bytes_per_slot": s.state_bytes_per_slot,
            "kv_bytes_per_token": s.kv_bytes_per_token,
            "max_num_seqs": self.scheduler.max_num_seqs,
            "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
            "flops_per_second": self.cost.flops_per_second,
            "step_overhead_s": self.cost.step_overhead_s,
        }


def unbounded_kv_blocks(trace: Sequence[TraceRequest], block_size: int, max_num_seqs: int) -> int:
    """KV blocks that never force an eviction: every distinct cacheable block, plus running copies.

    Distinct full blocks are bounded per Mooncake id (its 512 tokens) or per request (token-id
    traces); outputs are never shared; duplicates of cached blocks exist only in running requests,
    at most the `max_num_seqs` largest requests at once.
    """
    seen: set[int] = set()
    distinct = 0
    per_request: list[int] = []
    for r in trace:
        total = r.num_prompt_tokens + r.output_length
        per_request.append(-(-total // block_size))
        distinct += -(-(r.output_length + block_size) // block_size)
        if r.hash_ids is None:
            distinct += -(-r.num_prompt_tokens // block_size)
            continue
        for j, h in enumerate(r.hash_ids):
            if h not in seen:
                seen.add(h)
                length = min(r.hash_block_tokens, r.num_prompt_tokens - j * r.hash_block_tokens)
                distinct += -(-length // block_size)
    return distinct + sum(heapq.nlargest(max_num_seqs, per_request)) + 1


def make_scheduler(spec: PolicySpec, setup: ReplaySetup) -> Scheduler:
    cache_config = spec.cache_config(
        setup.block_size, kv_cache_bytes=setup.kv_cache_bytes, state_cache_bytes=setup.state_cache_bytes
    )
    layout = setup.shape.layout(setup.block_size, setup.num_kv_blocks, setup.num_state_slots)
    sched = Scheduler(setup.scheduler, cache_config, layout)
    if sched.cache.state is not None:
        ReplayStatePool.adopt(sched.cache.state.pool)  # the allocation loop inlined: same slots, faster
    apply_variant(sched, spec)
    return sched


@dataclass
class _Tally:
    """Per-request and per-run figures gathered during one replay."""

    arrival: dict[str, float] = field(default_factory=dict)
    first_token: dict[str, float] = field(default_factory=dict)
    prompt_len: dict[str, int] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    clock: float = 0.0
    peak_checkpoints: int = 0
    peak_kv_blocks: int = 0


def _add_arrivals(
    sched: Scheduler,
    trace: Sequence[TraceRequest],
    i: int,
    tally: _Tally,
    expander: TokenExpander | None,
) -> int:
    """Add every request that has arrived by the clock; returns the next trace index."""
    while i < len(trace) and trace[i].arrival_s <= tally.clock:
        r = trace[i]
        rid = str(r.index)
        tally.arrival[rid], tally.prompt_len[rid] = r.arrival_s, r.num_prompt_tokens
        request = Request(
            request_id=rid,
            prompt_token_ids=prompt_token_ids(r, expander),
            max_tokens=r.output_length,
            segment_boundaries=r.segment_boundaries,
            arrival_time=r.arrival_s,
        )
        sched.add_request(request)
        i += 1
    return i


def replay(
    trace: Sequence[TraceRequest],
    policy: str | PolicySpec,
    setup: ReplaySetup,
    expander: TokenExpander | None = None,
    check_integrity: bool = False,
) -> ReplayResult:
    """Replay `trace` (sorted by timestamp) under one policy; see the module docstring."""
    spec = parse_policy(policy) if isinstance(policy, str) else policy
    sched = make_scheduler(spec, setup)
    executor = FakeExecutor(block_size=setup.block_size)
    t = _Tally()
    tiers = None
    if any(s.budget_bytes > 0 for s in setup.tiers):  # the core's tiers; the runner side is the cost model
        attach_tiers(sched, setup.tiers, setup.shape, setup.block_size)
        tiers = executor.tier = ReplayTierRunner(sched, setup.tiers, lambda: t.clock)  # type: ignore[assignment]
    step_seconds = setup.cost.step_seconds
    state_pool = sched.cache.state.pool if sched.cache.state else None
    kv_pool = sched.cache.kv.pool if sched.cache.kv else None
    i, n = 0, len(trace)
    t0, c0 = time.perf_counter(), time.process_time()
    while i < n or sched.has_unfinished_requests() or (tiers is not None and tiers.num_loading):
        i = _add_arrivals(sched, trace, i, t, expander)
        out = sched.schedule()
        result = executor.execute(out)
        if out.scheduled:
            t.clock += step_seconds(out)
            t.steps += 1
        updates = sched.update_from_output(out, result)
        for u in updates:
            if u.new_token_ids and u.request_id not in t.first_token:
                t.first_token[u.request_id] = t.clock
            if u.finished is not None:
                t.cached[u.request_id] = u.num_cached_tokens
                if tiers is not None:
                    tiers.note_cached(u.request_id, u.num_cached_tokens)
        if check_integrity:
            sched.check_integrity()
        if state_pool is not None and state_pool.num_checkpoints > t.peak_checkpoints:
            t.peak_checkpoints = state_pool.num_checkpoints
        if kv_pool is not None:
            t.peak_kv_blocks = max(t.peak_kv_blocks, kv_pool.num_in_use + kv_pool.num_cached_free)
        if not out.scheduled and not updates and not result.tier_loaded:  # a finished load: its request runs next
            t.clock = max(t.clock, _next_event(sched, trace, i, tiers))
    res = _result(spec, setup, sched, t, time.perf_counter() - t0, time.process_time() - c0)
    res.tiers = tiers.summary() if tiers is not None else None
    return res


def _next_event(sched: Scheduler, trace: Sequence[TraceRequest], i: int, tiers: ReplayTierRunner | None) -> float:
    """When nothing runs: the next arrival or the end of the next copy from a lower tier."""
    at = min(trace[i].arrival_s if i < len(trace) else math.inf, tiers.next_ready() if tiers else math.inf)
    if at == math.inf:
        raise RuntimeError(
            f"replay stalled with {sched.num_waiting} waiting request(s) and nothing to run: "
            "are the KV / state budgets too small for one request?"
        )
    return at


def _result(spec: PolicySpec, setup: ReplaySetup, sched: Scheduler, t: _Tally, wall: float, cpu: float) -> ReplayResult:
    stats, shape = sched.stats, setup.shape
    done = [rid for rid in t.prompt_len if rid in t.first_token]
    ttft = [t.first_token[rid] - t.arrival[rid] for rid in done]
    return ReplayResult(
        policy=spec.text,
        requests=len(done),
        rejected=len(t.prompt_len) - len(done),
        prompt_tokens=sum(t.prompt_len[rid] for rid in done),
        cached_tokens=sum(t.cached.get(rid, 0) for rid in done),
        checkpoints_created=stats.checkpoints_created,
        checkpoints_evicted=stats.checkpoints_evicted,
        checkpoints_stranded=stats.checkpoints_stranded,
        checkpoint_peak=t.peak_checkpoints,
        checkpoint_peak_bytes=t.peak_checkpoints * shape.state_bytes_per_slot,
        kv_peak_bytes=t.peak_kv_blocks * setup.block_size * shape.kv_bytes_per_token,
        prefill_flops=sum(shape.prefill_flops(0, t.prompt_len[rid]) for rid in done),
        prefill_flops_saved=sum(shape.prefill_flops(0, t.cached.get(rid, 0)) for rid in done),
        preemptions=stats.preemptions,
        steps=t.steps,
        sim_seconds=t.clock,
        mean_ttft_s=sum(ttft) / len(ttft) if ttft else 0.0,
        wall_seconds=wall,
        cpu_seconds=cpu,
    )


# -- command line -----------------------------------------------------------------------------------


def build_setup(args: argparse.Namespace, trace: Sequence[TraceRequest]) -> ReplaySetup:
    """Pool sizes and limits from the parsed flags (see the module docstring for the rules)."""
    shape = get_shape(args.model_shape)
    bs = args.block_size
    max_len = max([r.num_prompt_tokens + r.output_length for r in trace] + [1])
    sched_cfg = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_len,
    )
    kv_bytes = None
    if not shape.num_attention_layers:
        num_kv_blocks = 2  # unused: the model has no KV group
    elif args.kv_unbounded:
        num_kv_blocks = unbounded_kv_blocks(trace, bs, args.max_num_seqs)
    else:
        kv_bytes = parse_bytes(args.kv_cache_bytes)
        num_kv_blocks = kv_blocks_for_bytes(shape, kv_bytes, bs)
    if not shape.num_ssm_layers:
        num_slots, state_bytes = 1, None
    elif args.state_checkpoints is not None:
        num_slots = args.state_checkpoints + args.max_num_seqs
        state_bytes = num_slots * shape.state_bytes_per_slot
    else:
        state_bytes = parse_bytes(args.state_cache_bytes)
        num_slots = state_slots_for_bytes(shape, state_bytes)
        if num_slots < 1:
            raise ValueError(
                f"--state-cache-bytes {args.state_cache_bytes} holds no state slot "
                f"({format_bytes(shape.state_bytes_per_slot)} each)"
            )
    cost = CostModel(shape, args.flops_per_second, args.step_overhead_ms / 1000.0)
    return ReplaySetup(shape, bs, num_kv_blocks, num_slots, sched_cfg, cost, kv_bytes, state_bytes, tier_specs(args))


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_trace_arguments(p)
    p.add_argument(
        "--policy",
        nargs="+",
        default=["none", "align", "all", "recap"],
        help="checkpoint policies to compare, NAME[:OPT,...] (e.g. recap:interval=32,no-branch)",
    )
    p.add_argument("--model-shape", default="hybrid-7b", help="named model shape (hybrid-7b, default)")
    kv = p.add_mutually_exclusive_group(required=True)
    kv.add_argument("--kv-cache-bytes", help="KV cache budget, e.g. 72GB or 64GiB")
    kv.add_argument("--kv-unbounded", action="store_true", help="enough KV blocks that none is ever evicted")
    st = p.add_mutually_exclusive_group(required=True)
    st.add_argument("--state-cache-bytes", help="state pool budget (running slots + checkpoints), e.g. 8GB")
    st.add_argument("--state-checkpoints", type=int, help="K checkpoints' worth, plus max-num-seqs running slots")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests of the file")
    p.add_argument(
        "--flops-per-second",
        type=float,
        default=DEFAULT_FLOPS_PER_SECOND,
        help="cost model: sustained FLOP/s of the simulated accelerator",
    )
    p.add_argument(
        "--step-overhead-ms",
        type=float,
        default=DEFAULT_STEP_OVERHEAD_S * 1000.0,
        help="cost model: fixed time per step (weights read once per step)",
    )
    add_tier_arguments(p)
    p.add_argument("--json-out", type=Path, default=None, help="also write the JSON summary here")
    p.add_argument("--check-integrity", action="store_true", help="assert every invariant after each step (slow)")


def add_bench_replay_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `replay` under a `bench` subcommand's subparsers; dispatch with `run_replay`."""
    p = subparsers.add_parser(
        "replay",
        help="replay a request trace through the real scheduler (no tensors)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(p)
    p.set_defaults(func=run_replay)
    return p


def run_replay(args: argparse.Namespace) -> int:
    """Replay the trace under each policy; print a table and, last, one line of JSON. Returns 0."""
    specs = [parse_policy(text) for text in args.policy]  # fail on a typo before any work
    if args.state_checkpoints is not None and args.state_checkpoints < 0:
        raise ValueError("--state-checkpoints must be >= 0")
    trace = load_trace(args.trace, args.limit, args.trace_block_tokens, args.trace_time_unit)
    if not trace:
        raise ValueError(f"{args.trace}: no requests")
    setup = build_setup(args, trace)
    info = setup.describe()
    print(f"trace {args.trace}: {len(trace)} requests, {sum(r.num_prompt_tokens for r in trace):,} prompt tokens")
    print(
        f"shape {setup.shape.name}: {setup.shape.description}; state slot "
        f"{format_bytes(info['state_bytes_per_slot'])}, KV {info['kv_bytes_per_token'] // 1024} KiB/token"
    )
    print(
        f"pools: {setup.num_kv_blocks:,} KV blocks ({format_bytes(info['kv_bytes'])}), "
        f"{setup.num_state_slots:,} state slots ({format_bytes(info['state_bytes'])})",
        flush=True,
    )
    results = []
    for spec in specs:
        res = replay(trace, spec, setup, check_integrity=args.check_integrity)
        print(
            f"  {spec.text}: hit rate {100 * res.hit_rate:.1f}% "
            f"in {res.wall_seconds:.1f} s ({res.cpu_seconds:.1f} s CPU)",
            file=sys.stderr,
            flush=True,
        )
        if res.tiers is not None:
            print(f"  {spec.text}: {format_tiers(res.tiers)}", file=sys.stderr, flush=True)
        if res.rejected:
            print(f"  {spec.text}: {res.rejected} request(s) rejected (do they fit the KV pool?)", file=sys.stderr)
        results.append(res)
    print(format_table(results))
    line = summary_json(results, {"trace": str(args.trace), "requests": len(trace), "setup": info})
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(json.loads(line), indent=2) + "\n")
    print(line, flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recap.bench.replay", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_replay(args)
    except (ValueError, RuntimeError) as e:
        parser.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
