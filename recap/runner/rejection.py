"""Speculative sampling: verifying drafts of a sampled request so the emitted tokens are distributed exactly as the
unspeculated sampler's (Leviathan et al. 2023; Chen et al. 2023; vLLM's rejection sampler).

At draft position j the target's distribution is p_j (after the request's own processors, as the plain sampler
would compute it there) and the drafter's is q_j. Draft d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j));
on the first rejection the step emits a token drawn from the residual max(0, p_j - q_j), normalized, and stops; when
every draft is accepted it emits a bonus token drawn from p_k. The emitted token at each position then has law p_j.

`speculative_emit` is that rule for any q (a draft model's full distributions, rows of `draft_probs`). For a
point-mass draft (q_j = one-hot(d_j): the n-gram drafter) the rule accepts with probability p_j(d_j), and the
residual is p_j with d_j removed, renormalized: exactly the law of a token t ~ p_j given t != d_j. So
`point_mass_emit` draws t ~ p_j with the plain sampler's own draw and accepts iff t == d_j. A seeded request thus
draws each position from that position's generator, as the unspeculated run does, and emits the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# draw(probs [V], generator) -> token: the plain sampler's draw (recap.runner.sampler._draw).
Draw = Callable[[torch.Tensor, "torch.Generator | None"], int]


def _check(probs: torch.Tensor, drafts: Sequence[int]) -> None:
    if probs.dim() != 2 or probs.shape[0] != len(drafts) + 1:
        raise ValueError(f"target probs of shape {tuple(probs.shape)} for {len(drafts)} drafts (need k + 1 rows)")


def point_mass_emit(target: Callable[[int], torch.Tensor], drafts: Sequence[int],
                    generators: Sequence[torch.Generator | None], draw: Draw) -> list[int]:  # fmt: skip
    """Verify deterministic drafts; target(j) is the target's p_j ([V], j = 0..k), asked for only up to the first
    rejection, and drawn from generators[j] (a seeded request's generator of that output position). Returns the
    accepted drafts, then the token drawn where the first draft was rejected (or the bonus token after all k)."""
    emitted = []
    for j in range(len(drafts) + 1):
        t = draw(target(j), generators[j])
        emitted.append(t)
        if j == len(drafts) or t != drafts[j]:
            break
    return emitted


def speculative_emit(probs: torch.Tensor, drafts: Sequence[int], draft_probs: torch.Tensor,
                     generator: torch.Generator | None, draw: Draw) -> list[int]:  # fmt: skip
    """The general rule: draft_probs [k, V] are the drafter's q_j from which d_j was drawn (one-hot rows for a
    deterministic drafter). Accept d_j when u * q_j(d_j) <= p_j(d_j), u ~ U[0, 1); else draw from the residual."""
    _check(probs, drafts)
    if draft_probs.shape != (len(drafts), probs.shape[1]):
        raise ValueError(f"draft probs of shape {tuple(draft_probs.shape)} for {len(drafts)} drafts")
    emitted = []
    for j, d in enumerate(drafts):
        p, q = probs[j], draft_probs[j]
        if float(q[d]) <= 0.0:
            raise ValueError(f"draft {d} at position {j} has probability 0 under its own draft distribution")
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u * float(q[d]) <= float(p[d]):
            emitted.append(int(d))
            continue
        residual = (p - q).clamp_min(0.0)
        total = float(residual.sum())
        # A rejection needs p(d) < q(d), so the residual has mass sum(max(0, p - q)) = sum(max(0, q - p)) > 0;
        # only rounding can leave it empty, and then p itself is the right law up to that rounding.
        emitted.append(draw(residual / total if total > 0.0 else p, generator))
        return emitted
    emitted.append(draw(probs[len(drafts)], generator))
    return emitted
