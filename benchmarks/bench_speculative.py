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
last prefill. Configurations alternate inside each round; medians over rounds. With --interleave steps (random
model) two speculating engines take both roles in turn: each mode's run goes step by step in lockstep (ABBA) with a
plain run on the other engine ("off": its speculator detached), then the engines swap; "paired" is the median over
rounds of the geometric mean of the two ratios. Two engines of one process run up to ~10% apart (measured with both
plain: where their memory landed), which the swap cancels, and the lockstep cancels the machine's load: with
--clock cpu that resolves a 1% overhead where alternating whole runs of two engines spreads over +-10%.
With --temperature > 0 the requests are sampled (top_p 0.95, a seed each): verification is rejection sampling, and
a seeded request's output with speculation equals the plain run's (docs/speculative.md), which the benchmark
asserts as for greedy; the oracle proposes that seeded output.

With --model trained: the shipped trained default (NemotronH 9.2M, recap/model/weights/default) and real text,
modes off / ngram / draft (the shipped 2.6M draft, recap/model/weights/default-draft) / draft-self (the target as its
own draft: every draft accepted, the bound a draft model reaches at its cost). Workloads, through the chat template:
"rewrite" asks to repeat a document of about --doc-len tokens (the answer has begun with its first sentence); "chat"
asks a short question. Each mode has its own engine; modes alternate inside each round (--interleave steps:
--modes off ngram, two n-gram engines crossing over as above).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from recap.config import SpeculativeConfig
from recap.core.request import Request
from recap.engine.config import EngineConfig
from recap.engine.llm_engine import LLMEngine
from recap.model.default_model import ensure_random_model
from recap.model.trained_default import default_model_path, draft_model_path
from recap.sampling_params import SamplingParams

MODES = ("off", "ngram", "oracle", "garbage", "garbage-every-step")
TRAINED_MODES = ("off", "ngram", "draft", "draft-self")


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


# "cpu": the calling thread's CPU time (engine steps, drafting and the native kernels run in it at 1 thread):
# time taken by other processes on a shared machine does not count, so a few-percent overhead can be seen.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


class Run:
    """One run of the prompts through an engine, a step at a time: the decode seconds are the steps' after every
    request has its first token."""

    def __init__(self, engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                 clock: Callable[[], float]) -> None:  # fmt: skip
        self.engine, self.clock = engine, clock
        self.ids = [engine.add_request(p, params) for p in prompts]
        self.tokens: dict[str, list[int]] = {i: [] for i in self.ids}
        self.decode_s, self.decoding = 0.0, False

    def step(self) -> bool:
        """One engine step (False: every request had finished)."""
        if not self.engine.has_unfinished_requests():
            return False
        t0 = self.clock()
        outs = self.engine.step()
        dt = self.clock() - t0
        if self.decoding:
            self.decode_s += dt
        for o in outs:
            self.tokens[o.request_id] = list(o.outputs[0].token_ids)
        self.decoding = self.decoding or all(self.tokens[i] for i in self.ids)  # every prompt done: decode from here
        return True

    def result(self) -> tuple[float, int, list[list[int]]]:
        """(decode seconds, decode tokens, outputs)."""
        generated = sum(len(t) - 1 for t in self.tokens.values())
        return self.decode_s, generated, [self.tokens[i] for i in self.ids]


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
        clock: Callable[[], float] = time.perf_counter) -> tuple[float, int, list[list[int]]]:  # fmt: skip
    """(decode seconds, decode tokens, outputs): the steps after every request has its first token."""
    r = Run(engine, prompts, params, clock)
    while r.step():
        pass
    return r.result()


def lockstep(a: Run, b: Run) -> None:
    """Both runs to the end, one step of each in turn, which goes first alternating (ABBA): a shared machine's
    load then falls on both alike, at the scale of a step rather than of a run."""
    turn = 0
    while any([r.step() for r in ((a, b) if turn % 2 == 0 else (b, a))]):
        turn += 1


Sample = tuple[float, int, float]  # decode tok/s, verify steps, mean accepted length


def timed(engines: dict[str, LLMEngine], prompts: list[list[int]], params: SamplingParams, rounds: int,
          ref: list[list[int]], before_run: Callable[[str, LLMEngine], None] | None = None,
          clock: Callable[[], float] = time.perf_counter) -> dict[str, list[Sample]]:  # fmt: skip
    """`rounds` rounds, the modes alternating inside each; every output checked against the plain run's."""
    samples: dict[str, list[Sample]] = {m: [] for m in engines}
    for _ in range(rounds):
        for mode, engine in engines.items():
            if before_run is not None:
                before_run(mode, engine)
            before, r = _counts(engine), Run(engine, prompts, params, clock)
            while r.step():
                pass
            samples[mode].append(_sample(r, ref, mode, before, _counts(engine)))
    return samples


def crossover(pair: tuple[LLMEngine, LLMEngine], modes: list[str], prompts: list[list[int]], params: SamplingParams,
              rounds: int, ref: list[list[int]], use: Callable[[str, LLMEngine], None],
              clock: Callable[[], float]) -> dict[str, list[Sample]]:  # fmt: skip
    """Each round and speculating mode m: m on one engine in lockstep with "off" on the other, then the engines'
    roles swapped. Two engines of one process differ in speed by up to ~10% (where their memory landed; measured
    with both plain): the swap cancels that, the lockstep the machine's load. A sample is the geometric mean of a
    mode's two runs; samples["off"] holds one per speculating mode per round, in order (`rows` pairs them)."""
    samples: dict[str, list[Sample]] = {m: [] for m in modes}
    for _ in range(rounds):
        for mode in modes[1:]:
            got: dict[str, list[Sample]] = {mode: [], "off": []}
            for on, off in (pair, pair[::-1]):
                use(mode, on)
                use("off", off)
                before, r, plain = _counts(on), Run(on, prompts, params, clock), Run(off, prompts, params, clock)
                lockstep(plain, r)
                got["off"].append(_sample(plain, ref, "off", (0, 0), (0, 0)))
                got[mode].append(_sample(r, ref, mode, before, _counts(on)))
            for m, (x, y) in got.items():
                samples[m].append((math.sqrt(x[0] * y[0]), y[1], math.sqrt(x[2] * y[2])))
    return samples


def _counts(engine: LLMEngine) -> tuple[int, int]:
    """The engine's verify steps and accepted drafts so far (0, 0 without a speculator)."""
    spec = engine.scheduler.stats.spec
    return (spec.num_drafts, spec.num_accepted_tokens) if spec is not None else (0, 0)


def _sample(r: Run, ref: list[list[int]], mode: str, before: tuple[int, int], after: tuple[int, int]) -> Sample:
    """A finished run's decode tok/s, verify steps and mean accepted length (its output checked)."""
    seconds, generated, outs = r.result()
    assert outs == ref, f"{mode} at batch {len(ref)}: output differs from the plain run"
    steps, accepted = after[0] - before[0], after[1] - before[1]
    return generated / seconds, steps, 1.0 + accepted / steps if steps else 1.0


def rows(batch: int, samples: dict[str, list[Sample]]) -> list[dict]:
    """Medians per mode, each mode's ratio to the median of "off", and the median of its per-round ratios to the
    "off" run of the same round (paired: slow drift of a shared machine cancels)."""
    base_tps = statistics.median(s[0] for s in samples["off"])
    out = []
    n = len(samples) - 1  # modes paired with "off" (interleave "steps": off's samples cycle through them)
    for i, (mode, got) in enumerate(samples.items()):
        offs = samples["off"] if mode == "off" or len(samples["off"]) == len(got) else samples["off"][i - 1 :: n]
        tps = statistics.median(s[0] for s in got)
        out.append({
            "batch": batch, "mode": mode, "decode_tok_s": round(tps, 2), "speedup": round(tps / base_tps, 3),
            "paired_speedup": round(statistics.median(s[0] / o[0] for s, o in zip(got, offs)), 3),
            "mean_accepted_length": round(statistics.median(s[2] for s in got), 3), "verify_steps": got[-1][1],
            "runs_tok_s": [round(s[0], 2) for s in got],
        })  # fmt: skip
    return out


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    common = {"model": str(ensure_random_model()), "num_threads": 1, "seed": 0}  # the measured random hybrid
    spec = SpeculativeConfig("ngram", args.k, 1, 4)
    crossing = args.interleave == "steps"  # two speculating engines, "off" with the speculator detached (crossover)
    pair = (LLMEngine(EngineConfig(speculative=spec if crossing else None, **common)),  # type: ignore[arg-type]
            LLMEngine(EngineConfig(speculative=spec, **common)))  # type: ignore[arg-type]  # fmt: skip
    speculators = {id(e): e.scheduler.speculator for e in pair}
    ngrams = {id(e): s.drafter for e in pair if (s := e.scheduler.speculator) is not None}  # one index each
    params = sampling(args)
    results: dict = {"model": "random", "temperature": args.temperature, "k": args.k, "doc_len": args.doc_len,
                     "tokens": args.tokens, "workload": args.workload, "rows": [], "interleave": args.interleave}
    modes = ["off", *(m for m in args.modes if m != "off")]
    for batch in args.batches:
        prompts = documents(batch, args.doc_len, args.workload)
        reference: dict[tuple[int, ...], list[int]] = {}
        drafters = {"oracle": OracleDrafter(reference), "garbage": GarbageDrafter(reference)}

        def use(mode: str, engine: LLMEngine, drafters: dict[str, Any] = drafters) -> None:
            speculator = engine.scheduler.speculator = None if mode == "off" else speculators[id(engine)]
            if mode != "off":
                assert speculator is not None
                kind = mode.removesuffix("-every-step")
                speculator.drafter = ngrams[id(engine)] if kind == "ngram" else drafters[kind]
                speculator.config = replace(spec, max_draft_backoff=0) if mode.endswith("every-step") else spec

        refs = []
        for engine in pair:  # the plain greedy outputs, and a warm-up of both engines
            use("off", engine)
            refs.append(run(engine, prompts, params)[2])
        ref = refs[0]
        assert refs[1] == ref, "two engines of one model gave different plain outputs"
        reference.update((tuple(p), r) for p, r in zip(prompts, ref))
        clock = CLOCKS[args.clock]
        if crossing:
            samples = crossover(pair, modes, prompts, params, args.rounds, ref, use, clock)
        else:
            engines = {m: pair[0] if m == "off" else pair[1] for m in modes}
            samples = timed(engines, prompts, params, args.rounds, ref, use, clock)
        results["rows"] += rows(batch, samples)
    return results


def sampling(args: argparse.Namespace) -> SamplingParams:
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    if args.temperature > 0:
        params = replace(params, temperature=args.temperature, top_p=0.95, seed=7)
    return params


# Text for the trained model's rewrite workload, written for this benchmark in the register of the addresses the
# model was trained on (its documents are these sentences in a seeded order per request).
SENTENCES = (
    "The Congress has been asked to provide for the defense of the country and the welfare of its people.",
    "It is the duty of the Government to keep the public credit and to pay the debt of the nation.",
    "The ships of the navy have returned from the sea, and the men who served on them deserve our thanks.",
    "In the past year the revenue of the United States has been greater than in any year before it.",
    "We must give our attention to the condition of the farmers and of the laborers in every State.",
    "The treaty with the foreign powers will be laid before the Senate for its advice and consent.",
    "A great part of the public land in the West is still open to those who will settle upon it.",
    "The courts of the nation should be kept free from the influence of any party or any interest.",
    "I recommend that the Congress take measures to improve the harbors and the rivers of the country.",
    "The people of this country have shown in peace and in war that they are able to govern themselves.",
    "Our relations with the other nations of the world are friendly, and there is no cause for alarm.",
    "The schools of the States are the foundation on which the liberty of the people must rest.",
)
QUESTIONS = ("What is the duty of the Congress?", "Tell me about the whale.", "What did the President say?",
             "How should the public debt be paid?", "Where did the ship sail?", "Who will defend the country?",
             "What is the state of the Union?", "Why do the farmers need help?")  # fmt: skip


def text_prompts(tokenizer: Any, batch: int, doc_len: int, workload: str) -> list[list[int]]:
    """The trained model's prompts through its chat template: "rewrite" (a document of about doc_len tokens to
    repeat, the answer begun with its first sentence) or "chat" (a short question)."""
    out = []
    for i in range(batch):
        if workload == "chat":
            messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            out.append(tokenizer.encode(text, add_special_tokens=False))
            continue
        order = random.Random(200 + i).sample(SENTENCES, len(SENTENCES))
        doc: list[str] = []
        while len(tokenizer.encode(" ".join(doc))) < doc_len:
            doc.append(order[len(doc) % len(order)])
        messages = [{"role": "user", "content": "Repeat the following text exactly.\n\n" + " ".join(doc)}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + doc[0]
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def measure_trained(args: argparse.Namespace) -> dict:
    """Off, n-gram, the shipped draft and draft = target on the trained default: one engine per mode."""
    torch.set_num_threads(1)
    target, draft = str(default_model_path()), str(draft_model_path())
    common = {"model": target, "num_threads": 1, "seed": 0}
    specs = {"off": None, "ngram": SpeculativeConfig("ngram", args.k, 1, 4),
             "draft": SpeculativeConfig("draft_model", args.k, model=draft),
             "draft-self": SpeculativeConfig("draft_model", args.k, model=target)}  # fmt: skip
    modes = ["off", *(m for m in args.modes if m != "off")]
    engines = {m: LLMEngine(EngineConfig(speculative=specs[m], **common)) for m in modes}  # type: ignore[arg-type]
    pair = (engines["off"], engines[modes[-1]])
    if args.interleave == "steps":  # off and ngram only (main): two n-gram engines, "off" with the speculator detached
        engines["off"] = LLMEngine(EngineConfig(speculative=specs["ngram"], **common))  # type: ignore[arg-type]
        pair = (engines["off"], engines["ngram"])
    speculators = {id(e): e.scheduler.speculator for e in pair}

    def use(mode: str, engine: LLMEngine) -> None:
        engine.scheduler.speculator = None if mode == "off" else speculators[id(engine)]

    params = sampling(args)
    results: dict = {"model": "trained", "temperature": args.temperature, "k": args.k, "doc_len": args.doc_len,
                     "tokens": args.tokens, "workload": args.workload, "rows": [], "interleave": args.interleave}
    for batch in args.batches:
        prompts = text_prompts(engines["off"].tokenizer, batch, args.doc_len, args.workload)
        results["prompt_tokens"] = [len(p) for p in prompts]
        use("off", engines["off"])
        _, _, ref = run(engines["off"], prompts, params)  # the plain outputs
        for engine in engines.values():
            run(engine, prompts, params)  # warm-up (decode and verify graphs captured)
        if args.interleave == "steps":
            samples = crossover(pair, modes, prompts, params, args.rounds, ref, use, CLOCKS[args.clock])
        else:
            samples = timed(engines, prompts, params, args.rounds, ref, clock=CLOCKS[args.clock])
        results["rows"] += rows(batch, samples)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short document and few tokens, 2 rounds")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--doc-len", type=int, default=512)
    p.add_argument("--workload", choices=("rewrite", "chat"), default="rewrite")
    p.add_argument("--model", choices=("random", "trained"), default="random",
                   help="the random-weight hybrid (test drafters) or the trained default (its draft model)")
    p.add_argument("--modes", nargs="+", choices=sorted(set(MODES + TRAINED_MODES)), default=None,
                   help=f"off always runs (the baseline); default: random {MODES}, trained {TRAINED_MODES}")
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled requests (seeded, top_p 0.95)")
    p.add_argument("--tokens", type=int, default=128, help="max_tokens per request")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall time, or the thread's CPU time (other processes' load left out)")
    p.add_argument("--interleave", choices=("runs", "steps"), default="runs",
                   help="alternate the modes run by run, or step each mode's run in lockstep with a plain run "
                        "(steps: the paired ratio then sees a few-percent overhead through a shared machine's load)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args()
    if args.quick:
        args.doc_len, args.tokens, args.rounds = 128, 32, 2
    allowed = MODES if args.model == "random" else TRAINED_MODES
    args.modes = args.modes or list(allowed)
    if set(args.modes) - set(allowed):
        p.error(f"--model {args.model} runs the modes {allowed}")
    if args.model == "trained" and args.interleave != "runs" and set(args.modes) != {"off", "ngram"}:
        p.error("--interleave steps with --model trained runs --modes off ngram (a draft model's engine follows "
                "prefills whether it drafts or not)")
    res = measure(args) if args.model == "random" else measure_trained(args)
    prompt = f"document {res['doc_len']} tokens" if res["workload"] == "rewrite" else "a short prompt"
    print(f"{res['model']} model  k={res['k']}  {res['workload']}  temperature {res['temperature']}  {prompt}, "
          f"{res['tokens']} generated per request, 1 thread, "
          "fp32")
    print(f"{'batch':>5} {'mode':>18} {'decode tok/s':>13} {'vs off':>7} {'paired':>7} {'mean accepted len':>18} "
          f"{'verify steps':>13}   ({args.clock} clock)")
    for r in res["rows"]:
        print(f"{r['batch']:>5} {r['mode']:>18} {r['decode_tok_s']:>13.1f} {r['speedup']:>6.2f}x "
              f"{r['paired_speedup']:>6.3f}x "
              f"{r['mean_accepted_length']:>18.2f} {r['verify_steps']:>13}")  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
