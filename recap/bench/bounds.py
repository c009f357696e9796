"""Offline bounds on a trace's prefix-cache hit rate, with no scheduler: what any policy could reach.

Definitions (hits on the block grid, requests served one at a time in arrival order)
- shared prefix of a request: the longest prefix (in whole trace blocks: 512-token hash blocks, or
  `block_size` tokens for token-id traces) that an earlier request also had, capped below the
  prompt's last token and rounded down to `block_size`.
- unlimited bound: shared prefix tokens / prompt tokens, with unlimited memory.
- reuse interval: a hit at depth d needs a checkpoint at d from the last earlier request that
  passed d until this one; its length is counted in requests.
- oracle at K checkpoints: a foresighted placement that holds only the checkpoints a later request
  will hit, for exactly their reuse intervals (one checkpoint serves every interval of its prefix),
  choosing greedily by tokens per request held, with at most K held at once. It shows what placement
  plus eviction can reach at K checkpoints (greedy, so a lower estimate of the true optimum).
- KV bounds at a byte budget (attention only: every block hit counts, no checkpoint needed), on the
  trace's block grid: LRU (a request's blocks refreshed deepest first, so a chain loses its tail
  first), and Belady (evict the block whose next request is furthest; with foresight, what any KV
  eviction could reach). A hybrid hit also needs a KV block for every token before it, so the KV
  bound of its KV bytes caps it.

Usage: python -m recap.bench.bounds --trace FILE [--checkpoints 512 2048] [--kv-bytes 72GB 80GB]
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from recap.bench.shapes import get_shape
from recap.bench.trace import TraceRequest, add_trace_arguments, load_trace
from recap.core.hashing import chain_hashes, root_hash
from recap.units import parse_bytes


@dataclass(frozen=True)
class ReuseInterval:
    start: int  # index (arrival order) of the last earlier request through the hit position
    end: int  # index of the request that hits
    tokens: int
    key: object  # the checkpoint's identity (its prefix); one checkpoint can serve several intervals


def chain_keys(r: TraceRequest, block_size: int) -> tuple[list[object], int]:
    """Keys of the request's blocks (each names its whole prefix) and the tokens per key."""
    if r.hash_ids is not None:
        return list(r.hash_ids), r.hash_block_tokens
    assert r.token_ids is not None
    return list(chain_hashes(root_hash(None), r.token_ids, block_size)), block_size


def reuse_intervals(trace: Sequence[TraceRequest], block_size: int = 16) -> list[ReuseInterval]:
    last_pass: dict[object, int] = {}
    out: list[ReuseInterval] = []
    for j, r in enumerate(trace):
        keys, per_key = chain_keys(r, block_size)
        m = 0
        while m < len(keys) and keys[m] in last_pass:
            m += 1
        hit = min(m * per_key, r.num_prompt_tokens - 1) // block_size * block_size
        if hit > 0:
            key = (keys[(hit - 1) // per_key], hit)
            out.append(ReuseInterval(last_pass[keys[(hit - 1) // per_key]], j, hit, key))
        for k in keys:
            last_pass[k] = j
    return out


def oracle_hits(intervals: Sequence[ReuseInterval], num_requests: int, capacity: int) -> int:
    """Tokens a foresighted greedy placement serves holding at most `capacity` checkpoints at once."""
    held = [0] * (num_requests + 1)
    covered: dict[object, set[int]] = {}  # per checkpoint, the request indices it is already held over
    served = 0
    for iv in sorted(intervals, key=lambda iv: -iv.tokens / max(1, iv.end - iv.start)):
        have = covered.setdefault(iv.key, set())
        new = [i for i in range(iv.start, iv.end + 1) if i not in have]
        if all(held[i] < capacity for i in new):
            for i in new:
                held[i] += 1
            have.update(new)
            served += iv.tokens
    return served


def _hit(num_keys: int, per_key: int, prompt_len: int, block_size: int) -> int:
    return min(num_keys * per_key, prompt_len - 1) // block_size * block_size


def kv_lru_hits(trace: Sequence[TraceRequest], capacity_tokens: int, block_size: int = 16) -> int:
    """Prompt tokens an attention-only LRU prefix cache of `capacity_tokens` serves, requests one at a time."""
    cache: OrderedDict[object, int] = OrderedDict()  # key -> tokens, least recently used first
    held = served = 0
    for r in trace:
        keys, per_key = chain_keys(r, block_size)
        m = 0
        while m < len(keys) and keys[m] in cache:
            m += 1
        served += _hit(m, per_key, r.num_prompt_tokens, block_size)
        for k in range(len(keys) - 1, -1, -1):  # deepest first: the chain's tail is the older
            size = min(per_key, r.num_prompt_tokens - k * per_key)
            held += size - cache.pop(keys[k], 0)
            cache[keys[k]] = size
        while held > capacity_tokens:
            held -= cache.popitem(last=False)[1]
    return served


def kv_belady_hits(trace: Sequence[TraceRequest], capacity_tokens: int, block_size: int = 16) -> int:
    """Prompt tokens a foresighted KV cache serves: it evicts the block whose next request is furthest."""
    chains = [chain_keys(r, block_size) for r in trace]
    uses: defaultdict[object, list[int]] = defaultdict(list)
    for j, (keys, _) in enumerate(chains):
        for key in keys:
            uses[key].append(j)
    cursor: dict[object, int] = defaultdict(int)
    never = len(trace)
    cache: dict[object, tuple[int, int]] = {}  # key -> (next use, tokens)
    heap: list[tuple[int, int, object]] = []  # (-next use, -depth, key); stale entries are skipped
    held = served = 0
    for j, ((keys, per_key), r) in enumerate(zip(chains, trace, strict=True)):
        m = 0
        while m < len(keys) and keys[m] in cache:
            m += 1
        served += _hit(m, per_key, r.num_prompt_tokens, block_size)
        for k, key in enumerate(keys):
            at, seen = cursor[key], uses[key]
            while at < len(seen) and seen[at] <= j:
                at += 1
            cursor[key] = at
            nxt = seen[at] if at < len(seen) else never
            size = min(per_key, r.num_prompt_tokens - k * per_key)
            held += size - cache.get(key, (0, 0))[1]
            cache[key] = (nxt, size)
            heapq.heappush(heap, (-nxt, -k, key))  # furthest next use first; then the deeper block
        while held > capacity_tokens:
            neg, _, key = heapq.heappop(heap)
            entry = cache.get(key)
            if entry is not None and entry[0] == -neg:
                held -= entry[1]
                del cache[key]
    return served


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recap.bench.bounds", description=__doc__)
    add_trace_arguments(p)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--checkpoints", type=int, nargs="*", default=[512, 2048])
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--kv-bytes", nargs="*", default=[], help="KV budgets for the KV bounds, e.g. 72GB 80GB")
    p.add_argument("--model-shape", default="hybrid-7b", help="gives the KV bytes per token")
    args = p.parse_args(argv)
    trace = load_trace(args.trace, args.limit, args.trace_block_tokens, args.trace_time_unit)
    total = sum(r.num_prompt_tokens for r in trace)
    ivs = reuse_intervals(trace, args.block_size)
    lengths = sorted(iv.end - iv.start for iv in ivs)
    summary = {
        "requests": len(trace),
        "requests_with_hits": len(ivs),
        "unlimited_hit_rate": sum(iv.tokens for iv in ivs) / total,
        "reuse_interval_median": lengths[len(lengths) // 2] if lengths else 0,
        "reuse_interval_p90": lengths[int(0.9 * len(lengths))] if lengths else 0,
        "mean_checkpoints_needed": sum(lengths) / max(1, len(trace)),
        "oracle_hit_rate": {str(k): oracle_hits(ivs, len(trace), k) / total for k in args.checkpoints},
    }
    per_token = get_shape(args.model_shape).kv_bytes_per_token
    for text in args.kv_bytes:
        tokens = parse_bytes(text) // per_token
        summary[f"kv_lru_hit_rate@{text}"] = kv_lru_hits(trace, tokens, args.block_size) / total
        summary[f"kv_belady_hit_rate@{text}"] = kv_belady_hits(trace, tokens, args.block_size) / total
    for key, value in summary.items():
        print(f"{key}: {value}")
    print(json.dumps(summary, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
