"""What a prefix-cache hit costs on the host: time to first token of a cached P-token prefix + 64 new tokens against a
cold 64-token prompt, split by engine part (docs/gpu.md "Not yet fast", TTFT on a cached 8k prefix).

    nice -n 5 python benchmarks/bench_prefix_hit.py --shape tiny hybrid-130m --prefix 1024 8192 32768 [--json-out F]

The real engine (LLMEngine, CPU backend, torch threads 1, fp32, greedy, max_tokens=1) on a tiny random Nemotron-H-like
checkpoint (hidden 64, vocab 512, recap.model.testing) and on `hybrid-130m` (benchmarks/checkpoints.py: a Bamba-style
~130M hybrid, 8 Mamba2 + 2 attention layers). For each prefix length P: one request of the prefix + 1 token primes the
cache (its prompt-end checkpoint lands at P); then, `--repeats` times each, alternating:

- cold: a fresh random 64-token prompt (nothing to hit);
- hit: the prefix + 64 fresh random tokens (a hit of exactly P tokens, asserted), as token ids;
- hit-text: the same through a text prompt (the tiny byte-level tokenizer: one token per byte), which adds the
  tokenizer's encode of all P + 64 tokens.

TTFT is the time from add_request to the step that returns the token, as the engine thread's CPU time
(time.thread_time: on a shared box, time spent descheduled by other processes is not counted; the table's `ttft`) and
as wall time (`wall`, in the JSON too). The CPU time is split, by wrapping the engine's own methods (each part's time
excludes the parts nested inside it), into: prepare (validation of the prompt ids),
tokenize (the text prompt's encode), add (the output processor's and the scheduler's add_request but hashing), hash
(the block hashes of the prompt), lookup (CacheManager.find_hit), admit (CacheManager.admit), schedule (the rest of
Scheduler.schedule: the step's rows, tables, checkpoint plans), copy (the checkpoint's copy into the running slot),
batch (ModelRunner.build_batch), forward (the model), sample (head + sampler), update (Scheduler.update_from_output:
registration of blocks and checkpoints, the request's release), output (the output processor: detokenizing, the
RequestOutput), other (the rest of add_request, LLMEngine.step and ModelRunner.execute).
Prints a table of medians (ms) and one JSON line; the 1-minute load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.checkpoints import build_checkpoint  # noqa: E402
from recap.config import CacheConfig, SchedulerConfig  # noqa: E402
from recap.engine.config import EngineConfig  # noqa: E402
from recap.engine.llm_engine import LLMEngine  # noqa: E402
from recap.model.default_model import save_tokenizer  # noqa: E402
from recap.model.testing import make_tiny_checkpoint  # noqa: E402
from recap.sampling_params import SamplingParams  # noqa: E402

PARTS = ("prepare", "tokenize", "add", "hash", "lookup", "admit", "schedule", "copy", "batch", "forward", "sample",
         "update", "output", "other")  # fmt: skip
NEW_TOKENS = 64


class PartTimer:
    """Exclusive wall time per named part: methods wrapped on their instances, nested parts' time taken out of their
    callers' (as benchmarks/host_step.py)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self._stack: list[float] = []

    def wrap(self, obj: object, method: str, part: str) -> None:
        inner: Callable[..., Any] = getattr(obj, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(0.0)
            t0 = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                dt = time.thread_time() - t0
                nested = self._stack.pop()
                self.totals[part] += dt - nested
                if self._stack:
                    self._stack[-1] += dt

        object.__setattr__(obj, method, timed)

    def reset(self) -> None:
        self.totals = dict.fromkeys(PARTS, 0.0)


def build_model(shape: str, root: Path) -> Path:
    if shape == "tiny":
        path = make_tiny_checkpoint("nemotron_h", root / "nemotron_h")
    else:
        path = build_checkpoint(shape, root / shape)
    save_tokenizer(path, vocab_size=512 if shape == "tiny" else 32000)
    return path


def make_engine(path: Path, max_len: int) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(path), device="cpu", kernels="torch", dtype="float32", seed=0, generation_config="vllm",
        num_threads=1, cache=CacheConfig(block_size=16, kv_cache_bytes=2 << 30, state_cache_bytes=1 << 30),
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=max_len, max_num_batched_tokens=4096),
    ))  # fmt: skip


def instrument(engine: LLMEngine) -> PartTimer:
    timer = PartTimer()
    runner, sched, cache = engine.runner, engine.scheduler, engine.scheduler.cache
    timer.wrap(engine.processor, "prepare", "prepare")
    timer.wrap(engine.processor.tokenizer, "encode", "tokenize")
    timer.wrap(engine, "add_prepared", "add")
    timer.wrap(cache, "update_hashes", "hash")
    timer.wrap(cache.hasher, "update", "hash")
    timer.wrap(cache, "find_hit", "lookup")
    timer.wrap(cache, "admit", "admit")
    timer.wrap(sched, "schedule", "schedule")
    timer.wrap(runner.caches, "copy_state", "copy")
    timer.wrap(runner, "build_batch", "batch")
    timer.wrap(runner.backend, "forward", "forward")
    if hasattr(runner.backend, "forward_greedy"):
        timer.wrap(runner.backend, "forward_greedy", "forward")
    timer.wrap(runner.model, "compute_logits", "sample")
    timer.wrap(runner, "_sample_row", "sample")
    timer.wrap(runner, "sampler", "sample")
    timer.wrap(sched, "update_from_output", "update")
    for m in ("on_tokens", "on_finished", "collect"):
        timer.wrap(engine.outputs, m, "output")
    return timer


def run_one(engine: LLMEngine, prompt: str | list[int]) -> tuple[float, float, int]:
    """(TTFT as the thread's CPU time and as wall time in s, cached tokens) of one request run alone to its token."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.thread_time()
    engine.add_request(prompt, params)
    while True:
        outs = engine.step()
        if outs and outs[0].outputs[0].token_ids:
            cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
            assert outs[0].finished and not engine.has_unfinished_requests()
            return cpu, wall, outs[0].num_cached_tokens
        assert engine.has_unfinished_requests(), "the request ended without a token"


def text_of(ids: list[int]) -> str:
    """Words of random letters (3-8 each), one per 4 ids."""
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = ["".join(letters[t % 26] for t in ids[i : i + 3 + ids[i] % 6]) for i in range(0, len(ids) - 8, 4)]
    return " ".join(words)


def text_prompt(tok: Any, rand: Callable[[int], list[int]], num_tokens: int) -> tuple[str, int]:
    """(text, its token count): random words of about `num_tokens` tokens, ending with a newline (the byte-level
    pre-tokenizer splits there, so text after it does not change these tokens)."""
    sample = text_of(rand(4096))
    per_token = len(sample) / len(tok.encode(sample, add_special_tokens=False))
    num_chars = int(num_tokens * per_token)
    text = text_of(rand(num_chars))[:num_chars].rstrip() + "\n"  # ~1.6 characters per id: enough
    return text, len(tok.encode(text, add_special_tokens=False))


def measure(engine: LLMEngine, timer: PartTimer, prefix_len: int, repeats: int, vocab: int,
            seed: int) -> dict[str, Any]:  # fmt: skip
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    prefix = rand(prefix_len)
    text_prefix, text_len = text_prompt(engine.processor.tokenizer, rand, prefix_len)
    t_prime = time.perf_counter()
    run_one(engine, prefix + rand(1))  # its prompt-end checkpoint: after P tokens
    run_one(engine, text_prefix + "x")  # after the text prefix's last block boundary
    prime_s = time.perf_counter() - t_prime
    cases = ("cold", "hit", "hit-text")
    cpus: dict[str, list[float]] = {c: [] for c in cases}
    walls: dict[str, list[float]] = {c: [] for c in cases}
    parts: dict[str, dict[str, list[float]]] = {c: {p: [] for p in PARTS} for c in cases}
    for _ in range(repeats + 1):  # the first round warms up
        for case in cases:
            if case == "cold":
                prompt: str | list[int] = rand(NEW_TOKENS)
            elif case == "hit":
                prompt = prefix + rand(NEW_TOKENS)
            else:  # about NEW_TOKENS tokens of words
                prompt = text_prefix + text_of(rand(3 * NEW_TOKENS))[: 2 * NEW_TOKENS]
            timer.reset()
            cpu, wall, cached = run_one(engine, prompt)
            want = {"cold": 0, "hit": prefix_len, "hit-text": text_len // 16 * 16}[case]
            assert cached == want, f"{case}: {cached} cached tokens, expected {want}"
            timer.totals["other"] = cpu - sum(v for k, v in timer.totals.items() if k != "other")
            cpus[case].append(cpu)
            walls[case].append(wall)
            for p in PARTS:
                parts[case][p].append(timer.totals[p])
    row: dict[str, Any] = {"prefix": prefix_len, "text_prefix_tokens": text_len, "prime_s": prime_s}
    for case in cases:
        row[case] = {
            "ttft_ms": statistics.median(cpus[case][1:]) * 1e3,
            "wall_ms": statistics.median(walls[case][1:]) * 1e3,
            "parts_ms": {p: statistics.median(v[1:]) * 1e3 for p, v in parts[case].items()},
        }
    return row


def table(results: list[dict[str, Any]]) -> str:
    head = f"{'shape':>12} {'P':>6} {'case':>8} {'wall':>8} {'ttft':>8} " + " ".join(f"{p[:8]:>8}" for p in PARTS)
    lines = [head, "-" * len(head)]
    for res in results:
        for r in res["rows"]:
            for case in ("cold", "hit", "hit-text"):
                c = r[case]
                lines.append(f"{res['shape']:>12} {r['prefix']:>6} {case:>8} {c['wall_ms']:>8.2f} {c['ttft_ms']:>8.2f} "
                             + " ".join(f"{c['parts_ms'][p]:>8.2f}" for p in PARTS))  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs="+", default=["tiny", "hybrid-130m"], help="tiny, or benchmarks/checkpoints.py")
    ap.add_argument("--prefix", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--models", type=Path, help="where to keep the built checkpoints (default: a temporary folder)")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.models or Path(tmp)
        results = []
        for shape in args.shape:
            path = build_model(shape, root)
            engine = make_engine(path, max(args.prefix) + 2 * NEW_TOKENS + 16)
            vocab = engine.runner.config.vocab_size
            timer = instrument(engine)
            rows = [measure(engine, timer, p, args.repeats, vocab, seed=i) for i, p in enumerate(args.prefix)]
            results.append({"shape": shape, "rows": rows})
            del engine
    load = os.getloadavg()[0]
    print(f"CPU backend, torch threads 1, medians of {args.repeats} in ms per request, CPU time but `wall` "
          f"(load average {load:.2f})")  # fmt: skip
    print(table(results))
    out = {"bench": "prefix_hit", "new_tokens": NEW_TOKENS, "repeats": args.repeats, "load_avg_1m": load,
           "results": results}  # fmt: skip
    print(json.dumps(out))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
