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

Usage: python -m recap.bench.bounds --trace FILE [--checkpoints 512 2048]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from recap.bench.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest, load_trace
from recap.core.hashing import chain_hashes, root_hash


@dataclass(frozen=True)
class ReuseInterval:
    start: int  # index (arrival order) of the last earlier request through the hit position
    end: int  # index of the request that hits
    tokens: int
    key: object  # the checkpoint's identity (its prefix); one checkpoint can serve several intervals


def _chain(r: TraceRequest, block_size: int) -> tuple[list[object], int]:
    """Keys of the request's blocks (each names its whole prefix) and the tokens per key."""
    if r.hash_ids is not None:
        return list(r.hash_ids), MOONCAKE_BLOCK_TOKENS
    assert r.token_ids is not None
    return list(chain_hashes(root_hash(None), r.token_ids, block_size)), block_size


def reuse_intervals(trace: Sequence[TraceRequest], block_size: int = 16) -> list[ReuseInterval]:
    last_pass: dict[object, int] = {}
    out: list[ReuseInterval] = []
    for j, r in enumerate(trace):
        keys, per_key = _chain(r, block_size)
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


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recap.bench.bounds", description=__doc__)
    p.add_argument("--trace", required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--checkpoints", type=int, nargs="*", default=[512, 2048])
    p.add_argument("--limit", type=int, default=None)
    args = p.parse_args(argv)
    trace = load_trace(args.trace, args.limit)
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
    for key, value in summary.items():
        print(f"{key}: {value}")
    print(json.dumps(summary, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
