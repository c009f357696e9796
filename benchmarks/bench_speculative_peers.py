"""Speculative decoding, recap beside llama.cpp, on the trained default model and its GGUF conversion: decode
tokens/s, speedup over each engine's own plain greedy decode, mean accepted length, on the rewrite workload and
plain chat (benchmarks/bench_speculative.py's prompts), at batch 1 and 8, engines alternating inside each round.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_speculative_peers.py \
        --llama-bin build/llama-spec/bin --llama-lib /work/main/build/peers/llama-build/bin \
        --target-gguf /work/main/build/peers/ppl/default-f32.gguf \
        --draft-gguf /work/main/build/peers/ppl/default-draft-f32.gguf [--target DIR --draft DIR] \
        [--workloads rewrite chat] [--batches 1 8] [--ngram-k 4 15] [--draft-k 4] [--rounds 3] [--out F.json]

recap modes (fp32, 1 thread, one engine each): off; ngram-kK (prompt lookup, n = 1..4, K drafts at most);
draft (the draft model, --draft-k); draft-self (the target as its own draft: acceptance 1, the bound a draft
model reaches at its cost); garbage (an n-gram engine whose drafter never proposes the target's token:
acceptance 0, what a useless drafter costs with the default backoff). Every output is asserted equal to off's.
llama.cpp modes (benchmarks/peers_spec.py; 1 thread, greedy, EOS banned as recap's ignore_eos makes every run
`--tokens` long), all but one llama-speculative-simple: plain (its n-gram drafter set never to match, a
1024-gram: the speculative rows' own loop and timer, the baseline of their speedups); completion
(llama-completion's `eval time`, the single-token decode passes alone: 20-50% above plain's wall time here);
ngram (`--spec-type ngram-cache`: llama-lookup's n-gram cache, n = 1..4 as recap's prompt_lookup_min/max, 8
drafts, fixed in the tool); ngram-simple (the last 4 tokens looked up, max(--ngram-k) drafts: recap's
prompt_lookup_max and k); draft (-md the draft GGUF, --draft-k); draft-self (-md the target GGUF). llama.cpp's
tools run one sequence: at batch 8 its rows run the 8 prompts one after another (tokens/s = all tokens over all
decode time), so its batch-8 speedups are batch-1 ones on 8 prompts.
Each llama.cpp speculative output is checked against its plain output (`same_as_plain`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from recap.config import SpeculativeConfig
from recap.engine.config import EngineConfig
from recap.engine.llm_engine import LLMEngine
from recap.model.trained_default import default_model_path, draft_model_path
from recap.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is scripts, not a package

from bench_speculative import GarbageDrafter, run, text_prompts, timed  # noqa: E402
from peers_spec import LlamaRun, LlamaSpecTools, plain, same_prefix, speculative  # noqa: E402

LLAMA_MODES = ("plain", "completion", "ngram", "ngram-simple", "draft", "draft-self")


def recap_engines(args: argparse.Namespace) -> dict[str, LLMEngine]:
    common = {"model": str(args.target), "num_threads": 1, "seed": 0}
    specs: dict[str, SpeculativeConfig | None] = {"off": None}
    specs |= {f"ngram-k{k}": SpeculativeConfig("ngram", k, 1, 4) for k in args.ngram_k}
    specs |= {"draft": SpeculativeConfig("draft_model", args.draft_k, model=str(args.draft)),
              "draft-self": SpeculativeConfig("draft_model", args.draft_k, model=str(args.target)),
              "garbage": SpeculativeConfig("ngram", max(args.ngram_k), 1, 4)}  # fmt: skip
    modes = [m for m in specs if m == "off" or m in args.recap_modes or m.split("-k")[0] in args.recap_modes]
    return {m: LLMEngine(EngineConfig(speculative=specs[m], **common)) for m in modes}  # type: ignore[arg-type]


def llama_run(args: argparse.Namespace, tools: LlamaSpecTools, mode: str, prompt: str) -> LlamaRun:
    if mode == "completion":
        return plain(tools, args.target_gguf, prompt, args.tokens)
    k, draft = str(max(args.ngram_k)), {"draft": args.draft_gguf, "draft-self": args.target_gguf}
    spec = {
        "plain": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1024"],  # never matches: no drafts
        "ngram": ["--spec-type", "ngram-cache"],  # llama-lookup's cache, n = 1..4; 8 drafts (fixed in the tool)
        "ngram-simple": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
                         "--spec-ngram-simple-size-m", k, "--spec-draft-n-max", k],
    }.get(mode) or ["--spec-type", "draft-simple", "-md", str(draft[mode]), "--spec-draft-n-max", str(args.draft_k)]
    return speculative(tools, args.target_gguf, prompt, args.tokens, spec)


def llama_round(args: argparse.Namespace, tools: LlamaSpecTools, texts: list[str],
                plain_text: dict[int, str]) -> dict[str, dict[str, Any]]:  # fmt: skip
    """One pass of every llama.cpp mode over the prompts, one after another: tok/s over all of them."""
    out = {}
    for mode in args.llama_modes:
        runs = [llama_run(args, tools, mode, t) for t in texts]
        if mode == "plain":
            plain_text |= {i: r.text for i, r in enumerate(runs)}
        same = all(same_prefix(r.text, plain_text[i]) for i, r in enumerate(runs)) if plain_text else None
        seconds = sum(r.tokens / r.tok_s for r in runs)
        verify = sum(r.verify_steps for r in runs)
        out[mode] = {"tok_s": sum(r.tokens for r in runs) / seconds, "verify_steps": verify,
                     "len": 1.0 + sum(r.accepted for r in runs) / verify if verify else 1.0,
                     "passes": sum(r.passes for r in runs), "rollbacks": sum(r.rollbacks for r in runs),
                     "same_as_plain": same}  # fmt: skip
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    engines = recap_engines(args)
    tools = LlamaSpecTools(args.llama_bin, args.llama_lib) if args.llama_bin else None
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    results: dict[str, Any] = {"tokens": args.tokens, "doc_len": args.doc_len, "ngram_k": args.ngram_k,
                               "draft_k": args.draft_k, "rows": [], "load": []}  # fmt: skip
    tokenizer = engines["off"].tokenizer
    for workload in args.workloads:
        for batch in args.batches:
            prompts = text_prompts(tokenizer, batch, args.doc_len, workload)
            texts = [tokenizer.decode(p) for p in prompts]
            _, _, ref = run(engines["off"], prompts, params)
            reference = {tuple(p): r for p, r in zip(prompts, ref)}
            if "garbage" in engines:
                speculator = engines["garbage"].scheduler.speculator
                assert speculator is not None
                speculator.drafter = GarbageDrafter(reference)
            for engine in engines.values():
                run(engine, prompts, params)  # warm-up: decode and verify graphs captured
            ours: dict[str, list] = {m: [] for m in engines}
            theirs: dict[str, list] = {m: [] for m in args.llama_modes} if tools else {}
            plain_text: dict[int, str] = {}
            for _ in range(args.rounds):
                results["load"].append((time.strftime("%H:%M:%S"), os.getloadavg()[0]))
                for mode, got in timed(engines, prompts, params, 1, ref).items():
                    ours[mode] += got
                if tools is not None:
                    for mode, got in llama_round(args, tools, texts, plain_text).items():
                        theirs[mode].append(got)
            results["rows"] += summarize(workload, batch, ours, theirs)
    return results


def summarize(workload: str, batch: int, ours: dict[str, list], theirs: dict[str, list]) -> list[dict[str, Any]]:
    """Medians per mode; speedup against the same engine's plain decode."""
    out = []
    base = statistics.median(s[0] for s in ours["off"])
    for mode, got in ours.items():
        tps = statistics.median(s[0] for s in got)
        out.append({"engine": "recap", "workload": workload, "batch": batch, "mode": mode,
                    "decode_tok_s": round(tps, 1), "speedup": round(tps / base, 3),
                    "mean_accepted_length": round(statistics.median(s[2] for s in got), 2),
                    "verify_steps": got[-1][1], "runs_tok_s": [round(s[0], 1) for s in got]})  # fmt: skip
    if theirs:
        base = statistics.median(r["tok_s"] for r in theirs["plain"])
        for mode, got in theirs.items():
            tps = statistics.median(r["tok_s"] for r in got)
            out.append({"engine": "llama.cpp", "workload": workload, "batch": batch, "mode": mode,
                        "decode_tok_s": round(tps, 1), "speedup": round(tps / base, 3),
                        "mean_accepted_length": round(statistics.median(r["len"] for r in got), 2),
                        "verify_steps": got[-1]["verify_steps"], "rollbacks": got[-1]["rollbacks"],
                        "same_as_plain": got[-1]["same_as_plain"],
                        "runs_tok_s": [round(r["tok_s"], 1) for r in got]})  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, default=None, help="recap's target (default: the shipped default)")
    p.add_argument("--draft", type=Path, default=None, help="recap's draft (default: the shipped default-draft)")
    p.add_argument("--target-gguf", type=Path, default=None, help="llama.cpp's target (the target's conversion)")
    p.add_argument("--draft-gguf", type=Path, default=None, help="llama.cpp's draft (the draft's conversion)")
    p.add_argument("--llama-bin", type=Path, default=None, help="llama-completion, llama-speculative-simple here")
    p.add_argument("--llama-lib", type=Path, default=None, help="their shared libraries (LD_LIBRARY_PATH)")
    p.add_argument("--workloads", nargs="+", choices=("rewrite", "chat"), default=["rewrite", "chat"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ngram-k", type=int, nargs="+", default=[15], help="recap n-gram modes' k (llama: the max)")
    p.add_argument("--draft-k", type=int, default=4, help="draft-model modes' num_speculative_tokens / n-max")
    p.add_argument("--recap-modes", nargs="+", default=["ngram", "draft", "draft-self", "garbage"],
                   choices=("ngram", "draft", "draft-self", "garbage"))
    p.add_argument("--llama-modes", nargs="+", default=list(LLAMA_MODES), choices=LLAMA_MODES)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--doc-len", type=int, default=256)
    p.add_argument("--tokens", type=int, default=96, help="generated tokens per request")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args()
    args.target = args.target or default_model_path()
    args.draft = args.draft or draft_model_path()
    if args.llama_bin is not None and args.target_gguf is None:
        p.error("--llama-bin needs --target-gguf (and --draft-gguf for the draft mode)")
    if args.llama_bin is not None and "draft" in args.llama_modes and args.draft_gguf is None:
        p.error("llama.cpp's draft mode needs --draft-gguf")
    if "plain" not in args.llama_modes:
        args.llama_modes.insert(0, "plain")
    res = measure(args)
    print(f"{'engine':>9} {'workload':>8} {'batch':>5} {'mode':>11} {'tok/s':>8} {'speedup':>8} {'len':>6} "
          f"{'verify':>6}  notes")
    for r in res["rows"]:
        notes = f"rollbacks {r['rollbacks']}, same as plain: {r['same_as_plain']}" if "rollbacks" in r else ""
        print(f"{r['engine']:>9} {r['workload']:>8} {r['batch']:>5} {r['mode']:>11} {r['decode_tok_s']:>8.1f} "
              f"{r['speedup']:>7.2f}x {r['mean_accepted_length']:>6.2f} {r['verify_steps']:>6}  {notes}")
    print("load (1 min):", " ".join(f"{t} {v:.1f}" for t, v in res["load"]))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
