"""Prefix-cache hits of multi-turn conversations whose history lives in the host and disk tiers, as the disk falls
behind on its writes (docs/tiers.md: a pending entry is readable in the store's order).

    python benchmarks/tier_write_lag.py [--delays-ms 0 10 50] [--json-out F]

The real engine (LLM, CPU, torch threads 1) on a tiny random Bamba checkpoint (recap.model.testing); read pools of
14 KV blocks and 4 state slots, a host tier of 3 blocks + 1 checkpoint, a disk tier below it: four conversations
of three turns, one turn of each in turn, so each turn's history has left the read pools for the tiers. Each
disk write is delayed by the given time (a slow or busy disk), in the store's own I/O thread. Prints, per delay,
the prompt tokens served from the cache and the tier entries the hits loaded from each tier, and one JSON line.
Hits that depend on the disk's speed mean the core waited for write reports before reading.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from recap import LLM, SamplingParams
from recap.model.default_model import save_tokenizer
from recap.model.testing import make_tiny_checkpoint
from recap.runner.disk_tier import DiskTier

CONVERSATIONS, TURNS = 4, 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def tokens(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, 500) for _ in range(n)]


def run(model: Path, cache_dir: Path, delay: float) -> dict[str, object]:
    write = DiskTier._write

    def slow(self: DiskTier, *args: object) -> None:
        time.sleep(delay)
        write(self, *args)  # type: ignore[arg-type]

    DiskTier._write = slow  # type: ignore[method-assign]
    try:
        probe = LLM(str(model), enable_prefix_caching=False, block_size=16, max_model_len=128).engine.runner
        kv, state = probe.kv_bytes_per_token * 16, probe.state_bytes_per_slot
        llm = LLM(str(model), enable_prefix_caching=True, checkpoint_policy="recap", block_size=16, max_model_len=128,
                  max_num_seqs=2, seed=0, kv_cache_bytes=14 * kv, state_cache_bytes=4 * state,
                  cache_host_bytes=3 * kv + state, cache_dir=str(cache_dir))  # fmt: skip
        hist = [tokens(100 + c, 40) for c in range(CONVERSATIONS)]
        hit = total = 0
        for turn in range(TURNS):
            for c in range(CONVERSATIONS):
                out = llm.generate([hist[c]], GREEDY)[0]
                hit, total = hit + out.num_cached_tokens, total + len(out.prompt_token_ids)
                hist[c] = hist[c] + out.outputs[0].token_ids + tokens(1000 * turn + c, 9)
        tiers = llm.engine.scheduler.tiers
        assert tiers is not None
        promoted = {t.name: t.counters.promotions for t in tiers.indexes}
        llm.close()
    finally:
        DiskTier._write = write  # type: ignore[method-assign]
    return {"delay_ms": delay * 1000, "hit_tokens": hit, "prompt_tokens": total, "promotions": promoted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delays-ms", type=float, nargs="+", default=[0.0, 10.0, 50.0])
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="tier-lag-"))
    model = make_tiny_checkpoint("bamba", root / "bamba")
    save_tokenizer(model, vocab_size=512)
    rows = [run(model, root / f"disk-{i}", ms / 1000) for i, ms in enumerate(args.delays_ms)]
    print(f"{'write delay':>12} {'hit tokens':>16} {'host loads':>11} {'disk loads':>11}")
    for r in rows:
        p = r["promotions"]
        print(f"{r['delay_ms']:>10.0f}ms {r['hit_tokens']:>7}/{r['prompt_tokens']:<8} {p.get('host', 0):>11} "  # type: ignore[union-attr]
              f"{p.get('disk', 0):>11}")  # type: ignore[union-attr]
    print(json.dumps({"tier_write_lag": rows}))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
