"""How long a restarted engine takes to answer a returning conversation from its disk tier, against
recomputing it (docs/tiers.md, issue 33's live benchmark).

Per repeat: an engine with a disk tier serves one turn of a conversation of `--history` tokens and closes
(its read pools are flushed to disk); a new engine on the same directory (the restart) answers the next
turn, and an engine with prefix caching off answers the same prompt (the recompute). The start-up of each
engine (model load, the disk scan) is timed apart from the request. Reports medians and the ratio.

    PYTHONPATH=. python benchmarks/bench_tier_restart.py --history 1536 --repeats 5 --threads 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from recap import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def make(cache_dir: Path | None, caching: bool, threads: int) -> tuple[LLM, float]:
    t0 = time.perf_counter()
    llm = LLM(None, enable_prefix_caching=caching, cache_dir=str(cache_dir) if cache_dir else None,
              max_num_seqs=2, max_model_len=8192, num_threads=threads, seed=0)  # fmt: skip
    return llm, time.perf_counter() - t0


def turn(llm: LLM, prompt: list[int]) -> tuple[float, int, list[int]]:
    """(TTFT seconds, cached tokens, output ids) of one request."""
    out = llm.generate([prompt], GREEDY)[0]
    return float(out.metrics.ttft), out.num_cached_tokens, list(out.outputs[0].token_ids)


def one_repeat(seed: int, history: int, threads: int) -> dict[str, float]:
    rng = random.Random(seed)
    first = [rng.randrange(16, 4000) for _ in range(history)]
    with tempfile.TemporaryDirectory() as d:
        llm, _ = make(Path(d), True, threads)
        _, _, answer = turn(llm, first)
        llm.close()
        del llm
        follow = first + answer + [rng.randrange(16, 4000) for _ in range(32)]
        restarted, start_s = make(Path(d), True, threads)
        ttft, cached, tokens = turn(restarted, follow)
        restarted.close()
        del restarted
    cold, cold_start_s = make(None, False, threads)
    cold_ttft, _, cold_tokens = turn(cold, follow)
    del cold
    assert tokens == cold_tokens, "the restarted engine's tokens differ from recomputing"
    return {"restart_ttft": ttft, "cached": cached, "prompt": len(follow), "restart_start": start_s,
            "recompute_ttft": cold_ttft, "recompute_start": cold_start_s}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--history", type=int, default=1536, help="tokens of the conversation before it returns")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    runs = [one_repeat(seed, args.history, args.threads) for seed in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"prompt {med['prompt']:.0f} tokens, cached after restart {med['cached']:.0f} (median of {args.repeats})")
    print(f"restarted engine: TTFT {med['restart_ttft'] * 1000:.0f} ms (start {med['restart_start']:.2f} s)")
    print(f"recompute:        TTFT {med['recompute_ttft'] * 1000:.0f} ms (start {med['recompute_start']:.2f} s)")
    ratios = [r["restart_ttft"] / r["recompute_ttft"] for r in runs]
    per = ", ".join(f"{x:.3f}" for x in ratios)
    print(f"TTFT restart / recompute: median {statistics.median(ratios):.3f} (per repeat {per})")


if __name__ == "__main__":
    main()
