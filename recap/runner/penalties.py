"""Logit processors that depend on a request's tokens: presence, frequency and repetition penalties,
and logit_bias (vLLM's semantics, applied before temperature and the top-k/top-p/min-p filters, and
before a greedy argmax).

`apply_penalties` works on one row in place; `apply_penalties_ref` is the plain per-token loop it is
tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from recap.sampling_params import SamplingParams


def apply_penalties(
    logits: torch.Tensor, p: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> torch.Tensor:
    """Penalize one float32 row ([V]) in place; returns it. Ids outside the vocabulary are ignored."""
    vocab = logits.numel()
    if p.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.tensor(sorted({t for t in (*prompt_ids, *output_ids) if 0 <= t < vocab}), dtype=torch.long,
                            device=logits.device)  # fmt: skip
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and output_ids:
        ids = torch.tensor([t for t in output_ids if 0 <= t < vocab], dtype=torch.long, device=logits.device)
        counts = torch.bincount(ids, minlength=vocab).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if p.logit_bias:
        for tok, bias in p.logit_bias.items():
            if tok < vocab:
                logits[tok] += bias
    return logits


def apply_penalties_ref(
    logits: torch.Tensor, p: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> torch.Tensor:
    """Plain reference: token by token on a copy."""
    out = logits.clone()
    vocab = out.numel()
    for t in set(prompt_ids) | set(output_ids):
        if 0 <= t < vocab and p.repetition_penalty != 1.0:
            v = float(out[t])
            out[t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
    for t in set(output_ids):
        if 0 <= t < vocab:
            out[t] -= p.frequency_penalty * list(output_ids).count(t) + p.presence_penalty
    for t, bias in (p.logit_bias or {}).items():
        if t < vocab:
            out[t] += bias
    return out
