"""Where a trace's prefix sharing happens, and how long a checkpoint must wait for its first hit.

Offline, on the trace's own block grid (Mooncake: 512-token hash blocks; token-id traces: --block-size),
requests in arrival order, unlimited memory. Each request's shared prefix (the unlimited-bound hit) is put
in one class, by where it ends on the chain of the last earlier request that passed it (the source):
  source end:     at the source's last full block, i.e. the source's whole prompt minus its partial tail
                  (a next chat turn, or a sibling whose question sits in the last block);
  known branch:   at a block where two continuations had already been seen (a learnt branch point);
  new divergence: at a block inside the source's prompt where nobody had diverged before (only a
                  speculative checkpoint placed there in advance can serve it);
  partial block:  capped by the request's own last token inside a shared block.
Then, for each request's tail (its last full block), the distance in requests to the first later request
that uses it, and the gaps between later uses: how long a speculative checkpoint must survive.

    python benchmarks/trace_sharing.py --trace /work/shared/traces/synthetic_trace.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict

from recap.bench.bounds import chain_keys
from recap.bench.trace import load_trace


def analyse(path: str, block_size: int) -> dict:
    trace = load_trace(path)
    children: defaultdict[object, set[object]] = defaultdict(set)
    last_pass: dict[object, int] = {}
    tokens: Counter[str] = Counter()
    count: Counter[str] = Counter()
    tails: dict[object, list[int]] = {}  # tail key -> [owner, first use, later uses...]
    first_use: list[int] = []
    gaps: list[int] = []
    total = 0
    for j, r in enumerate(trace):
        keys, per_key = chain_keys(r, block_size)
        n = r.num_prompt_tokens
        total += n
        m = 0
        while m < len(keys) and keys[m] in last_pass:
            m += 1
        hit = min(m * per_key, n - 1) // block_size * block_size
        used = None
        if hit > 0:
            k = (hit - 1) // per_key
            src = trace[last_pass[keys[k]]]
            if hit % per_key:
                cls = "partial block"
            elif hit // per_key >= src.num_prompt_tokens // per_key:
                cls = "source end"
            else:
                cls = "known branch" if len(children[keys[k]]) >= 2 else "new divergence"
            tokens[cls] += hit
            count[cls] += 1
            for i in range(min(m, (n - 1) // per_key), 0, -1):  # deepest tail on the shared part
                if keys[i - 1] in tails:
                    used = keys[i - 1]
                    uses = tails[used]
                    (first_use if len(uses) == 1 else gaps).append(j - uses[-1])
                    uses.append(j)
                    break
        t = (n - 1) // per_key
        if t > 0 and keys[t - 1] != used and keys[t - 1] not in tails:
            tails[keys[t - 1]] = [j]
        prev: object = None
        for key in keys:
            children[prev].add(key)
            prev = key
            last_pass[key] = j
        children[prev].add(("end", j))

    def pct(xs: list[int]) -> dict[str, int]:
        xs = sorted(xs)
        return {f"p{q}": xs[min(len(xs) - 1, len(xs) * q // 100)] for q in (25, 50, 75, 90)} if xs else {}

    return {
        "requests": len(trace),
        "prompt_tokens": total,
        "unlimited_hit_rate": sum(tokens.values()) / total,
        "classes": {c: {"requests": count[c], "share_of_prompt_tokens": tokens[c] / total} for c in sorted(count)},
        "tails": len(tails),
        "tails_ever_used": len(first_use),
        "first_use_distance_requests": pct(first_use),
        "gap_between_uses_requests": pct(gaps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args()
    out = analyse(args.trace, args.block_size)
    print(f"unlimited hit rate {100 * out['unlimited_hit_rate']:.1f}% of {out['prompt_tokens']:,} prompt tokens")
    for cls, v in out["classes"].items():
        print(f"  {cls:15s} {v['requests']:5d} requests  {100 * v['share_of_prompt_tokens']:5.1f}% of prompt tokens")
    print(f"tails {out['tails']}, ever used {out['tails_ever_used']}")
    print(f"  first use after (requests) {out['first_use_distance_requests']}")
    print(f"  gap between uses (requests) {out['gap_between_uses_requests']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
