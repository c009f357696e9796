"""Token sampling: penalties and logit_bias, greedy, temperature, top-k, top-p, min-p, per-request
seeds, logprobs.

A seeded request's k-th output token is drawn from a generator seeded by (seed, k) alone (`position_generator`),
not from one stream carried along the request: the token is then the same in any batch, after a preemption
(recompute), in a step retried after a failure, and under speculation, where a stream carried along would
restart or skip draws.

`sample_ref` is the plain per-row reference; `Sampler` is the batched path the runner uses.
Logprobs are those of the model's raw distribution (log_softmax of the logits), as vLLM reports
by default, so they do not depend on the sampling settings.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from recap.runner.penalties import apply_penalties
from recap.sampling_params import SamplingParams

# (logprob of the sampled token, its rank (1 = most likely), [(token id, logprob)] top-k, best first)
RowLogprobs = tuple[float, int, list[tuple[int, float]]]


@dataclass
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None  # None: the runner's shared generator
    # Token ids to forbid (EOS / stop ids while fewer than min_tokens were generated).
    banned_token_ids: tuple[int, ...] = ()
    # The request's tokens, for the penalties (read only when params.has_penalties).
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    # Structured output: the tokens the grammar allows next (bool [V]); None when unconstrained.
    allowed: torch.Tensor | None = None


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[RowLogprobs | None]  # per row; None when not asked


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


def position_generator(seed: int, position: int) -> torch.Generator:
    """The generator of output token `position` of a request seeded with `seed`."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    # Exponential race (Gumbel-max equivalent): argmax p_i / q_i with q_i ~ Exp(1).
    q = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return int(torch.argmax(probs / q))


def processed_logits(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """One row ([V]) after the processors that depend on the request's tokens (penalties and logit_bias, the
    grammar's mask, min_tokens bans): what a greedy row takes the argmax of. A float32 copy; the batched path
    applies the same ops in place."""
    x = logits.float().clone()
    if row.params.has_penalties:
        x = apply_penalties(x, row.params, row.prompt_token_ids, row.output_token_ids)
    if row.allowed is not None:
        x = x.masked_fill(~row.allowed, float("-inf"))
    if row.banned_token_ids:
        x[list(row.banned_token_ids)] = float("-inf")
    return x


def target_probs(processed: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled row draws from: temperature, top-k/top-p/min-p, softmax."""
    return _filter_logits(processed, p).softmax(-1)


def row_logprobs(lp: torch.Tensor, token: int, k: int) -> RowLogprobs:
    """From one row of log-probabilities ([V]): the token's logprob, its rank and the top k."""
    top: list[tuple[int, float]] = []
    if k > 0:
        vals, idx = torch.topk(lp, k)
        top = [(int(i), float(v)) for i, v in zip(idx, vals)]
    value = lp[token]
    return float(value), int((lp > value).sum()) + 1, top


def sample_ref(logits: torch.Tensor, rows: list[SampleRow], shared: torch.Generator | None) -> SampleResult:
    """Plain reference: one row at a time."""
    tokens: list[int] = []
    lps: list[RowLogprobs | None] = []
    for i, row in enumerate(rows):
        x = processed_logits(logits[i], row)
        if row.params.greedy:
            tok = int(torch.argmax(x))
        else:
            tok = draw(target_probs(x, row.params), row.generator if row.generator is not None else shared)
        tokens.append(tok)
        k = row.params.logprobs
        lps.append(None if k is None else row_logprobs(torch.log_softmax(logits[i].float(), -1), tok, k))
    return SampleResult(tokens, lps)


def takes_argmax(params: SamplingParams, banned: bool, constrained: bool) -> bool:
    """Whether a row's token is the argmax of its raw logits and nothing else is asked of them: greedy, no
    penalties or logit_bias, no logprobs, no banned ids (`banned`: min_tokens not yet reached) and no grammar
    (`constrained`). Such rows need no logits on the host (Backend.forward_greedy)."""
    return (params.greedy and not params.has_penalties and params.logprobs is None and not banned
            and not constrained)  # fmt: skip


def _argmax_only(row: SampleRow) -> bool:
    return takes_argmax(row.params, bool(row.banned_token_ids), row.allowed is not None)


class Sampler:
    """Batched sampling: greedy rows in one argmax, others per row (their filters differ)."""

    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
        """Tokens for `rows` from their logits [R, V], which may live on a GPU: rows that only take the argmax
        are decided there (R ids come back, not R x V logits); any other row brings the logits to the host."""
        if not rows:
            return SampleResult([], [])
        if logits.device.type != "cpu" and not all(_argmax_only(r) for r in rows):
            logits = logits.cpu()
        raw = logits.float()
        logits = raw
        banned = [r.banned_token_ids for r in rows]
        penalized = [r.params.has_penalties for r in rows]
        masked = [r.allowed is not None for r in rows]
        if any(banned) or any(penalized) or any(masked):
            logits = raw.clone()
            for i, row in enumerate(rows):
                if penalized[i]:
                    apply_penalties(logits[i], row.params, row.prompt_token_ids, row.output_token_ids)
                if row.allowed is not None:
                    logits[i].masked_fill_(~row.allowed, float("-inf"))
                if banned[i]:
                    logits[i, list(banned[i])] = float("-inf")
        tokens = torch.argmax(logits, dim=-1).tolist()
        for i, row in enumerate(rows):
            if not row.params.greedy:
                probs = target_probs(logits[i], row.params)
                tokens[i] = draw(probs, row.generator if row.generator is not None else self.generator)
        lps: list[RowLogprobs | None] = []
        want = [r.params.logprobs is not None for r in rows]
        if any(want):
            lp_all = torch.log_softmax(raw, dim=-1)
            for i, row in enumerate(rows):
                if not want[i]:
                    lps.append(None)
                    continue
                lps.append(row_logprobs(lp_all[i], tokens[i], row.params.logprobs or 0))
        else:
            lps = [None] * len(rows)
        return SampleResult(tokens, lps)
