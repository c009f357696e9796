"""A trace through N simulated replicas under each router: token hit rate, mean TTFT, balance.

Each replica is the real Scheduler and cache core with the tensor-free executor and the replay's cost
model (recap.bench.replay), on its own simulated clock; one event loop takes the earliest event: an
arrival (routed at its timestamp) or a step of the replica whose clock is earliest. Replicas publish
routing stats (recap.cluster.stats, bounded as in production) every --stats-period-s of simulated time;
the router is recap.cluster.router with its predictions, as behind Ray Serve. Routers:
  checkpoint:  recap's (deepest resumable prefix against queued work);
  round_robin: cycle through the replicas;
  load:        fewest requests (ties: least recently chosen);
  pow2:        Ray Serve's default: two replicas at random, the one with fewer requests.
Completions reach the router when the step that finishes them is simulated (a step ahead of arrivals at
most): the load it sees is that fresh. Greedy tokens are the executor's, so outputs are not compared here.

    python benchmarks/replica_routing.py --trace /work/shared/traces/synthetic_trace.jsonl --replicas 1 2 4 8 \
        --kv-unbounded --state-checkpoints 512 --limit 1000
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass, field

from recap.bench.replay import _add_arguments, build_setup, make_scheduler
from recap.bench.trace import TokenExpander, load_trace, prompt_token_ids
from recap.bench.variants import parse_policy
from recap.cluster.router import CheckpointRouter, RouterConfig, RouteRequest
from recap.cluster.stats import StatsLimits, collect_stats
from recap.core.fake_executor import FakeExecutor
from recap.core.request import Request

ROUTERS = ("checkpoint", "round_robin", "load", "pow2")


@dataclass
class Replica:
    name: str
    sched: object
    executor: FakeExecutor
    clock: float = 0.0
    published: float = -math.inf
    served: int = 0


@dataclass
class Tally:
    arrival: dict[str, float] = field(default_factory=dict)
    first: dict[str, float] = field(default_factory=dict)
    prompt: dict[str, int] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)


def simulate(trace, setup, policy: str, num_replicas: int, router_name: str, period: float, seed: int,
             queued_request_tokens: int, kv_only_weight: float = 0.0) -> dict:
    spec = parse_policy(policy)
    reps = [Replica(f"r{i}", make_scheduler(spec, setup), FakeExecutor(block_size=setup.block_size))
            for i in range(num_replicas)]
    now = [0.0]
    config = RouterConfig(block_size=setup.block_size, queued_request_tokens=queued_request_tokens,
                          max_stats_age_s=max(30.0, 4 * period), kv_only_weight=kv_only_weight)
    router = CheckpointRouter(config, lambda: now[0])
    rng = random.Random(seed)
    limits, expander, tally = StatsLimits(), TokenExpander(), Tally()
    owner: dict[str, Replica] = {}
    i, n = 0, len(trace)
    t0 = time.perf_counter()
    while True:
        busy = [r for r in reps if r.sched.has_unfinished_requests()]
        next_arrival = trace[i].arrival_s if i < n else math.inf
        if not busy and i >= n:
            break
        first = min(busy, key=lambda r: r.clock) if busy else None
        if first is None or next_arrival <= first.clock:
            now[0] = next_arrival
            for r in reps:  # publish stats every `period` of simulated time
                if next_arrival - r.published >= period:
                    s = r.sched
                    stats = collect_stats(s.cache, s.num_running, s.num_waiting, next_arrival, limits)
                    router.update_stats(r.name, stats)
                    r.published = next_arrival
            tr = trace[i]
            rid = str(tr.index)
            tokens = prompt_token_ids(tr, expander)
            names = [r.name for r in reps]
            if router_name == "pow2":
                pair = rng.sample(names, min(2, len(names)))
                loads = [router.load(x) for x in pair]
                chosen = pair[0] if loads[0] < loads[1] or (loads[0] == loads[1] and rng.random() < 0.5) else pair[-1]
            else:
                chosen = router.rank(names, RouteRequest(tokens, policy=router_name))[0]
            rep = next(r for r in reps if r.name == chosen)
            router.on_routed(chosen, rid, RouteRequest(tokens))
            if not rep.sched.has_unfinished_requests():
                rep.clock = max(rep.clock, tr.arrival_s)
            rep.sched.add_request(Request(rid, tokens, tr.output_length, segment_boundaries=tr.segment_boundaries,
                                          arrival_time=tr.arrival_s))
            rep.served += 1
            owner[rid] = rep
            tally.arrival[rid], tally.prompt[rid] = tr.arrival_s, tr.num_prompt_tokens
            i += 1
            continue
        out = first.sched.schedule()
        result = first.executor.execute(out)
        if out.scheduled:
            first.clock += setup.cost.step_seconds(out)
        updates = first.sched.update_from_output(out, result)
        now[0] = first.clock
        for u in updates:
            if u.new_token_ids and u.request_id not in tally.first:
                tally.first[u.request_id] = first.clock
            if u.finished is not None:
                tally.cached[u.request_id] = u.num_cached_tokens
                router.on_completed(first.name, u.request_id)
        if not out.scheduled and not updates:
            if i >= n:
                raise RuntimeError(f"replica {first.name} stalled: are the budgets too small for one request?")
            first.clock = max(first.clock, next_arrival)
    done = [rid for rid in tally.prompt if rid in tally.first]
    ttft = sorted(tally.first[r] - tally.arrival[r] for r in done)
    return {
        "router": router_name, "replicas": num_replicas, "policy": policy, "requests": len(done),
        "token_hit_rate": sum(tally.cached.get(r, 0) for r in done) / max(1, sum(tally.prompt[r] for r in done)),
        "mean_ttft_s": sum(ttft) / max(1, len(ttft)), "p90_ttft_s": ttft[int(0.9 * (len(ttft) - 1))] if ttft else 0.0,
        "max_share": max(r.served for r in reps) / max(1, sum(r.served for r in reps)),
        "wall_s": time.perf_counter() - t0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    p.add_argument("--stats-period-s", type=float, default=0.5)
    p.add_argument("--queued-request-tokens", type=int, default=256)
    p.add_argument("--kv-only-weight", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    trace = load_trace(args.trace, limit=args.limit)
    setup = build_setup(args, trace)
    policy = args.policy[0] if args.policy else "recap"
    print(f"{'replicas':>8} {'router':>12} {'hit rate':>9} {'mean TTFT':>10} {'p90 TTFT':>9} {'max share':>9}")
    rows = []
    for num in args.replicas:
        for name in args.routers if num > 1 else ["checkpoint"]:
            row = simulate(trace, setup, policy, num, name, args.stats_period_s, args.seed, args.queued_request_tokens,
                           args.kv_only_weight)
            rows.append(row)
            print(f"{num:>8} {name:>12} {row['token_hit_rate']:>8.1%} {row['mean_ttft_s']:>9.2f}s "
                  f"{row['p90_ttft_s']:>8.2f}s {row['max_share']:>8.1%}", flush=True)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"setup": setup.describe(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
