"""Speculative decoding on CPU: decode tokens/s and mean accepted length with and without speculation, at batch 1
and 8, on a "rewrite a document" workload (the prompt holds a text that the answer repeats), side by side.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_speculative.py [--quick] [--k 4] [--temperature 0.8]
                                                                   [--out bench_out/spec.json]

Model: the random-weight hybrid of model/default_model.py (Bamba-style: 14 layers, Mamba2 except attention at 4 and
10, d_model 512, vocab 4096), fp32, 1 thread. Random weights never repeat the document, so besides the n-gram
drafter (its real acceptance on this model, about 0: what proposing costs) two test drafters bound it:
- oracle: proposes the target's own continuation (from the plain run): every draft accepted (the bound a
  perfect drafter reaches on the rewrite workload);
- garbage: proposes tokens that are never the target's: nothing accepted. With the default backoff (a request that
  keeps missing drafts less often) this is what a useless drafter costs; `garbage-every-step` turns the backoff off
  (max_draft_backoff 0): k drafts verified at every step, the worst-case overhead of a verify step.
Decode tokens/s counts the tokens generated after each request's first one over the time of the steps after the
last prefill. Configurations alternate inside each round; medians over rounds.
With --temperature > 0 the requests are sampled (top_p 0.95, a seed each): verification is rejection sampling, and
a seeded request's output with speculation equals the plain run's (docs/speculative.md), which the benchmark
asserts as for greedy; the oracle proposes that seeded output.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from recap.config import SpeculativeConfig
from recap.core.request import Request
from recap.engine.config import EngineConfig
from recap.engine.llm_engine import LLMEngine
from recap.model.default_model import ensure_random_model
from recap.sampling_params import SamplingParams

MODES = ("off", "ngram", "oracle", "garbage", "garbage-every-step")


class OracleDrafter:
    """The target's own continuation (from the plain run), looked up by prompt: acceptance 1."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]]) -> None:
        self.reference = reference

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        ref = self.reference[tuple(request.prompt_token_ids)]
        done = len(request.output_token_ids)
        return ref[done : done + max_tokens]

    def forget(self, request_id: str) -> None:
        pass


class GarbageDrafter(OracleDrafter):
    """Never the target's token: acceptance 0, every step verifies max_tokens drafts."""

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        ref = self.reference[tuple(request.prompt_token_ids)]
        done = len(request.output_token_ids)
        nxt = ref[done] if done < len(ref) else 0
        return [(nxt + 1 + j) % 4096 for j in range(max_tokens)]


def documents(batch: int, doc_len: int, workload: str = "rewrite") -> list[list[int]]:
    """Per request: "rewrite": a document, then its first 16 tokens again (the rewrite has begun); "chat": a
    32-token question (nothing to copy from)."""
    out = []
    for i in range(batch):
        rng = random.Random(100 + i)
        doc = [rng.randrange(10, 4000) for _ in range(doc_len if workload == "rewrite" else 32)]
        out.append(doc + doc[:16] if workload == "rewrite" else doc)
    return out


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int, list[list[int]]]:
    """(decode seconds, decode tokens, outputs): the steps after every request has its first token."""
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    decode_s, t_start = 0.0, None
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if t_start is not None:
            decode_s += dt
        for o in outs:
            tokens[o.request_id] = list(o.outputs[0].token_ids)
        if t_start is None and all(tokens[i] for i in ids):
            t_start = time.perf_counter()  # every prompt done: decode from here
    generated = sum(len(t) - 1 for t in tokens.values())
    return decode_s, generated, [tokens[i] for i in ids]


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    common = {"model": str(ensure_random_model()), "num_threads": 1, "seed": 0}  # the measured random hybrid
    spec = SpeculativeConfig("ngram", args.k, 1, 4)
    base = LLMEngine(EngineConfig(**common))  # type: ignore[arg-type]
    speculating = LLMEngine(EngineConfig(speculative=spec, **common))  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    if args.temperature > 0:
        params = replace(params, temperature=args.temperature, top_p=0.95, seed=7)
    results: dict = {"temperature": args.temperature, "k": args.k, "doc_len": args.doc_len, "tokens": args.tokens,
                     "workload": args.workload, "rows": []}  # fmt: skip
    ngram = speculating.scheduler.speculator.drafter  # type: ignore[union-attr]
    for batch in args.batches:
        prompts = documents(batch, args.doc_len, args.workload)
        _, _, ref = run(base, prompts, params)  # the plain greedy outputs, and a warm-up
        reference = {tuple(p): r for p, r in zip(prompts, ref)}
        drafters = {"ngram": ngram, "oracle": OracleDrafter(reference), "garbage": GarbageDrafter(reference)}
        samples: dict[str, list[tuple[float, int, float]]] = {m: [] for m in MODES}
        modes = ["off", *(m for m in args.modes if m != "off")]
        for _ in range(args.rounds):
            for mode in modes:
                engine = base if mode == "off" else speculating
                if mode != "off":
                    speculator = engine.scheduler.speculator
                    assert speculator is not None
                    speculator.drafter = drafters[mode.removesuffix("-every-step")]
                    speculator.config = replace(spec, max_draft_backoff=0) if mode.endswith("every-step") else spec
                before = engine.scheduler.stats
                seconds, generated, outs = run(engine, prompts, params)
                assert outs == ref, f"{mode} at batch {batch}: output differs from the plain run"
                after = engine.scheduler.stats
                steps = after.spec.num_drafts - before.spec.num_drafts
                acc = after.spec.num_accepted_tokens - before.spec.num_accepted_tokens
                samples[mode].append((generated / seconds, steps, 1.0 + acc / steps if steps else 1.0))
        base_tps = statistics.median(s[0] for s in samples["off"])
        for mode in modes:
            tps = statistics.median(s[0] for s in samples[mode])
            results["rows"].append({
                "batch": batch, "mode": mode, "decode_tok_s": round(tps, 2), "speedup": round(tps / base_tps, 3),
                "mean_accepted_length": round(statistics.median(s[2] for s in samples[mode]), 3),
                "verify_steps": samples[mode][-1][1],
            })  # fmt: skip
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short document and few tokens, 2 rounds")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--doc-len", type=int, default=512)
    p.add_argument("--workload", choices=("rewrite", "chat"), default="rewrite")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="off always runs (the baseline)")
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled requests (seeded, top_p 0.95)")
    p.add_argument("--tokens", type=int, default=128, help="max_tokens per request")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args()
    if args.quick:
        args.doc_len, args.tokens, args.rounds = 128, 32, 2
    res = measure(args)
    prompt = f"document {res['doc_len']} tokens" if res["workload"] == "rewrite" else "32-token prompt"
    print(f"k={res['k']}  {res['workload']}  temperature {res['temperature']}  {prompt}, "
          f"{res['tokens']} generated per request, 1 thread, "
          "fp32")
    print(f"{'batch':>5} {'mode':>18} {'decode tok/s':>13} {'vs off':>7} {'mean accepted len':>18} "
          f"{'verify steps':>13}")
    for r in res["rows"]:
        print(f"{r['batch']:>5} {r['mode']:>18} {r['decode_tok_s']:>13.1f} {r['speedup']:>6.2f}x "
              f"{r['mean_accepted_length']:>18.2f} {r['verify_steps']:>13}")  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
