"""How long a restarted engine takes to answer a returning conversation from its disk tier, against
recomputing it (docs/tiers.md, issue 33's live benchmark).

Per repeat: an engine with a disk tier serves one turn of a conversation of `--history` tokens and closes
(its read pools are flushed to disk); a new engine on the same directory (the restart) answers the next
turn, and an engine with prefix caching off answers the same prompt (the recompute). The start-up of each
engine (model load, the disk scan) is timed apart from the request. Reports medians and the ratio.

    PYTHONPATH=. python benchmarks/bench_tier_restart.py --history 1536 --repeats 5 --threads 1
    PYTHONPATH=. python benchmarks/bench_tier_restart.py --arch lfm3 --hidden 512 --layers 8 --window 512

Without --arch it runs the embedded default model; with it, a random-weight checkpoint of that family
(recap.model.testing, its tiny config with the given width and depth; the default model's tokenizer).
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


def make(model: str | None, cache_dir: Path | None, caching: bool, threads: int) -> tuple[LLM, float]:
    t0 = time.perf_counter()
    llm = LLM(model, enable_prefix_caching=caching, cache_dir=str(cache_dir) if cache_dir else None,
              max_num_seqs=2, max_model_len=8192, num_threads=threads, seed=0)  # fmt: skip
    return llm, time.perf_counter() - t0


def random_checkpoint(arch: str, hidden: int, layers: int, window: int | None, root: Path) -> str:
    """The family's tiny config at this width and depth (its layer pattern repeated), `window`: its sliding window."""
    from recap.model.default_model import VOCAB_SIZE, save_tokenizer
    from recap.model.testing import make_tiny_checkpoint, tiny_hf_config

    over: dict[str, object] = {"vocab_size": VOCAB_SIZE, "hidden_size": hidden, "num_hidden_layers": layers}
    pattern = getattr(tiny_hf_config(arch), "layer_types", None)
    if pattern:
        over["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    if window is not None:
        over["sliding_window"] = window
    path = make_tiny_checkpoint(arch, root / arch, **over)
    save_tokenizer(path, vocab_size=VOCAB_SIZE)
    return str(path)


def turn(llm: LLM, prompt: list[int]) -> tuple[float, int, list[int]]:
    """(TTFT seconds, cached tokens, output ids) of one request."""
    out = llm.generate([prompt], GREEDY)[0]
    return float(out.metrics.ttft), out.num_cached_tokens, list(out.outputs[0].token_ids)


def one_repeat(model: str | None, seed: int, history: int, threads: int) -> dict[str, float]:
    rng = random.Random(seed)
    first = [rng.randrange(16, 4000) for _ in range(history)]
    with tempfile.TemporaryDirectory() as d:
        llm, _ = make(model, Path(d), True, threads)
        _, _, answer = turn(llm, first)
        llm.close()
        del llm
        follow = first + answer + [rng.randrange(16, 4000) for _ in range(32)]
        restarted, start_s = make(model, Path(d), True, threads)
        ttft, cached, tokens = turn(restarted, follow)
        restarted.close()
        del restarted
    cold, cold_start_s = make(model, None, False, threads)
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
    p.add_argument("--arch", default=None, help="a family's short name (recap.model.families), e.g. lfm3")
    p.add_argument("--hidden", type=int, default=512, help="--arch's hidden size")
    p.add_argument("--layers", type=int, default=8, help="--arch's layers")
    p.add_argument("--window", type=int, default=None, help="--arch's sliding window (its config's sliding_window)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        model = None if args.arch is None else random_checkpoint(args.arch, args.hidden, args.layers, args.window,
                                                                 Path(root))
        runs = [one_repeat(model, seed, args.history, args.threads) for seed in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"prompt {med['prompt']:.0f} tokens, cached after restart {med['cached']:.0f} (median of {args.repeats})")
    print(f"restarted engine: TTFT {med['restart_ttft'] * 1000:.0f} ms (start {med['restart_start']:.2f} s)")
    print(f"recompute:        TTFT {med['recompute_ttft'] * 1000:.0f} ms (start {med['recompute_start']:.2f} s)")
    ratios = [r["restart_ttft"] / r["recompute_ttft"] for r in runs]
    per = ", ".join(f"{x:.3f}" for x in ratios)
    print(f"TTFT restart / recompute: median {statistics.median(ratios):.3f} (per repeat {per})")


if __name__ == "__main__":
    main()
