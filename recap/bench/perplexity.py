"""Perplexity of a text file through the engine's prompt logprobs, and the same through transformers.

The file's tokens are cut into consecutive windows of `window` tokens; each window is scored on its own,
after the tokenizer's BOS token where it has one (so every text token is predicted; the default models
were trained on documents that start after <|endoftext|>), else from its second token. Perplexity is
exp(mean negative log-likelihood) over all scored tokens. `recap eval perplexity MODEL --data FILE`.
`transformers_perplexity` is the plain reference (one forward per window, log_softmax, gather) that
tests/model/test_trained_default.py holds the engine's figure to.

`--protocol llama-cpp` scores what llama.cpp's `llama-perplexity -c N` scores (its default, non-strided
mode), so the two engines' figures compare: the token stream (BOS first only if `--add-bos`, as the GGUF's
tokenizer.ggml.add_bos_token says) cut into whole chunks of N tokens, each chunk's first token replaced by BOS
when --add-bos, and only the second half of each chunk scored (tokens N/2+1 .. N-1, N/2-1 per chunk).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class PerplexityResult:
    scored_tokens: int
    windows: int
    nll: float  # summed negative log-likelihood, nats
    window_nll: tuple[float, ...] = ()  # each window's share of nll

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.scored_tokens)


def chunk_nll(running: list[float], scored: int) -> list[float]:
    """Each chunk's NLL (nats) from llama-perplexity's running estimates [i]PPL_i over chunks of `scored` scored
    tokens: chunk i adds i * scored * ln PPL_i - (i - 1) * scored * ln PPL_(i-1). Printed to 4 decimals: a chunk's
    figure is within ~1e-4 nats a token."""
    total = [i * scored * math.log(p) for i, p in enumerate(running, 1)]
    return [t - u for t, u in zip(total, [0.0, *total[:-1]], strict=True)]


def paired_log_ratio(a: Sequence[float], b: Sequence[float], tokens: Sequence[int]) -> tuple[float, float]:
    """ln(ppl_a / ppl_b) over the same windows, and its standard error with the windows as the samples: from the
    windows' NLLs a, b (nats) and scored token counts. Two formats' perplexities on one text differ by far less
    than either's own +/- (which counts how hard the text is); paired per window, the text's difficulty cancels."""
    if not len(a) == len(b) == len(tokens) or len(a) < 2:
        raise ValueError(f"paired_log_ratio needs >= 2 windows of both runs, got {len(a)}, {len(b)}, {len(tokens)}")
    n = sum(tokens)
    d = [(x - y) / t for x, y, t in zip(a, b, tokens, strict=True)]  # per-token ln ratio of each window
    w = [t / n for t in tokens]
    mean = sum(wi * di for wi, di in zip(w, d, strict=True))
    var = sum(wi * (di - mean) ** 2 for wi, di in zip(w, d, strict=True)) * len(d) / (len(d) - 1)
    return mean, math.sqrt(var / len(d))


def windows_of(tokenizer: Any, text: str, window: int, max_tokens: int | None = None) -> list[list[int]]:
    """The text's token ids in windows of `window` (the last may be shorter), each led by BOS where the
    tokenizer has one; `max_tokens` caps the text tokens read."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    bos = getattr(tokenizer, "bos_token_id", None)
    lead = [bos] if bos is not None else []
    out = [lead + ids[i : i + window] for i in range(0, len(ids), window)]
    out = [w for w in out if len(w) >= 2]
    if not out:
        raise ValueError("the text has too few tokens to score")
    return out


def llama_cpp_windows(ids: Sequence[int], n_ctx: int, bos: int | None, chunks: int | None = None) -> list[list[int]]:
    """llama-perplexity's chunks of the text's ids (see the module doc; score them from llama_cpp_score_from)."""
    if n_ctx < 4:
        raise ValueError(f"the context must be at least 4 tokens, got {n_ctx}")
    stream = ([bos] if bos is not None else []) + list(ids)
    n = len(stream) // n_ctx if chunks is None else min(chunks, len(stream) // n_ctx)
    if n < 1 or len(stream) < 2 * n_ctx:  # llama-perplexity's own minimum
        raise ValueError(f"llama.cpp's protocol needs at least {2 * n_ctx} tokens, the text has {len(stream)}")
    out = [stream[i * n_ctx : (i + 1) * n_ctx] for i in range(n)]
    return [[bos, *w[1:]] if bos is not None else w for w in out]


def llama_cpp_score_from(n_ctx: int) -> int:
    """The first scored position of a llama-perplexity chunk: logits from n_ctx/2 on predict the next token."""
    return n_ctx // 2 + 1


def engine_perplexity(llm: Any, windows: Sequence[list[int]], score_from: int = 1) -> PerplexityResult:
    """Through recap: one request per window with prompt_logprobs=0 (each prompt token's own logprob); the
    tokens at positions score_from.. of each window are scored."""
    from recap.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([list(w) for w in windows], params)
    per: list[float] = []
    for w, out in zip(windows, outs, strict=True):
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(w)
        per.append(-sum(plp[j][w[j]].logprob for j in range(score_from, len(w))))
    n = sum(len(w) - score_from for w in windows)
    return PerplexityResult(scored_tokens=n, windows=len(windows), nll=sum(per), window_nll=tuple(per))


def transformers_perplexity(model: Any, windows: Sequence[list[int]], score_from: int = 1) -> PerplexityResult:
    """The reference: transformers' forward per window, fp32 log_softmax, the next token's logprob."""
    import torch

    per: list[float] = []
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w])
            logits = model(input_ids=ids, use_cache=False).logits[0, score_from - 1 : -1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, score_from:, None])
            per.append(-float(lp.sum(dtype=torch.float64)))
    n = sum(len(w) - score_from for w in windows)
    return PerplexityResult(scored_tokens=n, windows=len(windows), nll=sum(per), window_nll=tuple(per))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="recap eval", description="evaluate a model on a text file")
    sub = p.add_subparsers(dest="eval_command", required=True)
    q = sub.add_parser("perplexity", help="perplexity of a text file through the engine's prompt logprobs")
    q.add_argument("model", nargs="?", default=None, help="model folder (default: the trained default model)")
    q.add_argument("--data", type=Path, required=True, help="UTF-8 text file")
    q.add_argument("--window", type=int, default=512, help="tokens per scored window")
    q.add_argument("--max-tokens", type=int, default=None, help="read at most this many tokens of the file")
    q.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    q.add_argument("--quantization", default=None, choices=("int8", "int4", "int4_k"))
    q.add_argument("--num-threads", type=int, default=None)
    q.add_argument("--transformers", action="store_true", help="also compute it with transformers (fp32)")
    q.add_argument("--protocol", default="recap", choices=("recap", "llama-cpp"),
                   help="recap: BOS + --window tokens, all scored; llama-cpp: llama-perplexity -c WINDOW's chunks")
    q.add_argument("--add-bos", action="store_true", help="llama-cpp protocol: the GGUF adds BOS")
    q.add_argument("--chunks", type=int, default=None, help="llama-cpp protocol: at most this many chunks")
    return p


def main(argv: Sequence[str]) -> int:
    return run_eval(build_parser().parse_args(list(argv)))


def run_eval(args: argparse.Namespace) -> int:
    from recap.engine.llm import LLM

    text = args.data.read_text(encoding="utf-8")
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, num_threads=args.num_threads,
              max_model_len=args.window + 2, enable_prefix_caching=False)  # fmt: skip
    windows, score_from = protocol_windows(llm.get_tokenizer(), text, args)
    res = engine_perplexity(llm, windows, score_from)
    label = f"recap {args.dtype}" + (f" {args.quantization}" if args.quantization else "")
    print(f"{label}: perplexity {res.perplexity:.4f} over {res.scored_tokens} tokens ({res.windows} windows)")
    if args.transformers:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(llm.engine.model_path), dtype=torch.float32).eval()
        ref = transformers_perplexity(model, windows, score_from)
        print(f"transformers float32: perplexity {ref.perplexity:.4f} over {ref.scored_tokens} tokens")
    return 0


def protocol_windows(tokenizer: Any, text: str, args: argparse.Namespace) -> tuple[list[list[int]], int]:
    """The windows and first scored position of args.protocol."""
    if args.protocol == "recap":
        return windows_of(tokenizer, text, args.window, args.max_tokens), 1
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: args.max_tokens]
    bos = tokenizer.bos_token_id if args.add_bos else None
    return llama_cpp_windows(ids, args.window, bos, args.chunks), llama_cpp_score_from(args.window)
