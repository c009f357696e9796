"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

`sample_ref` is the plain per-row reference; `Sampler` is the batched path the runner uses.
Logprobs are those of the model's raw distribution (log_softmax of the logits), as vLLM reports
by default, so they do not depend on the sampling settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recap.sampling_params import SamplingParams


@dataclass
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None  # None: the runner's shared generator
    # Token ids to forbid (EOS / stop ids while fewer than min_tokens were generated).
    banned_token_ids: tuple[int, ...] = ()


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: (logprob of the sampled token, [(token id, logprob)] top-k) or None when not asked.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def _filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied to one row of float32 logits ([V])."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        remove = probs.cumsum(-1) - probs >= p.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(remove, float("-inf")))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    # Exponential race (Gumbel-max equivalent): argmax p_i / q_i with q_i ~ Exp(1).
    q = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return int(torch.argmax(probs / q))


def _logprobs(row_logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    lp = torch.log_softmax(row_logits, dim=-1)
    top: list[tuple[int, float]] = []
    if k > 0:
        vals, idx = torch.topk(lp, k)
        top = [(int(i), float(v)) for i, v in zip(idx, vals)]
    return float(lp[token]), top


def sample_ref(logits: torch.Tensor, rows: list[SampleRow], shared: torch.Generator | None) -> SampleResult:
    """Plain reference: one row at a time."""
    tokens: list[int] = []
    lps: list[tuple[float, list[tuple[int, float]]] | None] = []
    for i, row in enumerate(rows):
        x = logits[i].float()
        if row.banned_token_ids:
            x = x.clone()
            x[list(row.banned_token_ids)] = float("-inf")
        if row.params.greedy:
            tok = int(torch.argmax(x))
        else:
            probs = _filter_logits(x, row.params).softmax(-1)
            tok = _draw(probs, row.generator if row.generator is not None else shared)
        tokens.append(tok)
        k = row.params.logprobs
        lps.append(None if k is None else _logprobs(logits[i].float(), tok, k))
    return SampleResult(tokens, lps)


class Sampler:
    """Batched sampling: greedy rows in one argmax, others per row (their filters differ)."""

    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
        raw = logits.float()
        logits = raw
        if not rows:
            return SampleResult([], [])
        banned = [r.banned_token_ids for r in rows]
        if any(banned):
            logits = raw.clone()
            for i, b in enumerate(banned):
                if b:
                    logits[i, list(b)] = float("-inf")
        tokens = torch.argmax(logits, dim=-1).tolist()
        for i, row in enumerate(rows):
            if not row.params.greedy:
                probs = _filter_logits(logits[i], row.params).softmax(-1)
                tokens[i] = _draw(probs, row.generator if row.generator is not None else self.generator)
        lps: list[tuple[float, list[tuple[int, float]]] | None] = []
        want = [r.params.logprobs is not None for r in rows]
        if any(want):
            lp_all = torch.log_softmax(raw, dim=-1)
            for i, row in enumerate(rows):
                if not want[i]:
                    lps.append(None)
                    continue
                k = row.params.logprobs or 0
                top: list[tuple[int, float]] = []
                if k:
                    vals, idx = torch.topk(lp_all[i], k)
                    top = [(int(a), float(b)) for a, b in zip(idx, vals)]
                lps.append((float(lp_all[i, tokens[i]]), top))
        else:
            lps = [None] * len(rows)
        return SampleResult(tokens, lps)
