"""Sampled verification (runner/rejection.py, runner/speculative.py): the tokens a verify step emits have the
unspeculated sampler's law at every position, for drafts that are often right and drafts that are never right, for
the point-mass rule the runner uses and for the general rule with a full draft distribution q; a seeded request
emits exactly what the plain sampler draws, penalties and min_tokens bans included.

The statistical checks are deterministic (fixed seeds). Each compares the empirical frequencies p^ of n draws with
the exact law p by the Bretagnolle-Huber-Carol inequality, P(||p^ - p||_1 >= lam) <= 2^V exp(-n lam^2 / 2):
lam is set so that a correct sampler fails with probability at most DELTA per comparison. A wrong residual (e.g.
drawing from p instead of p without d on a rejection) moves the L1 distance by 2 p(d)(1 - p(d)), several lam here.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from recap.runner.rejection import point_mass_emit, speculative_emit
from recap.runner.sampler import SampleRow, draw, position_generator, processed_logits, sample_ref, target_probs
from recap.runner.speculative import position_rows, verify_emit
from recap.sampling_params import SamplingParams

V = 8
N = 4000
DELTA = 1e-6  # the false-failure probability of one comparison
PARAMS = SamplingParams(temperature=0.8, top_k=6, top_p=0.97)


def _bound(n: int) -> float:
    return math.sqrt(2.0 * (V * math.log(2.0) + math.log(1.0 / DELTA)) / n)


def _assert_law(samples: list[int], p: torch.Tensor, what: str) -> None:
    n = len(samples)
    assert n > 500, f"{what}: only {n} samples"
    freq = torch.bincount(torch.tensor(samples), minlength=V).double() / n
    l1 = float((freq - p.double()).abs().sum())
    assert l1 < _bound(n), f"{what}: L1 {l1:.4f} >= {_bound(n):.4f} over {n} draws; freq {freq}, p {p}"


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(3, V, generator=torch.Generator().manual_seed(seed)) * 1.5


def _rows(k: int) -> list[SampleRow]:
    return [SampleRow(PARAMS, None) for _ in range(k + 1)]


@pytest.mark.parametrize("draft", ["often right", "never right", "sometimes right"])
def test_point_mass_verification_has_the_plain_samplers_law(draft: str) -> None:
    """Two n-gram-style drafts through the runner's verify_emit (temperature, top-k, top-p): the first emitted
    token has law p_0, the second (when d_1 was accepted) p_1, the third (both accepted) p_2."""
    logits = _logits(1)
    p = torch.stack([target_probs(processed_logits(logits[j], SampleRow(PARAMS, None)), PARAMS) for j in range(3)])
    zero = [int(t) for t in (p[0] == 0).nonzero().flatten()]
    assert zero, "top-k / top-p were meant to rule some token out"
    if draft == "often right":
        drafts = [int(p[0].argmax()), int(p[1].argmax())]
    elif draft == "never right":
        drafts = [zero[0], int(p[1].argmax())]  # p_0(d_1) = 0: never accepted
    else:
        drafts = [int(p[0].argsort()[-3]), int(p[1].argsort()[-2])]
    gen = torch.Generator().manual_seed(7)
    emitted = [verify_emit(logits, drafts, _rows(2), gen) for _ in range(N)]
    _assert_law([e[0] for e in emitted], p[0], f"{draft}: position 0")
    assert sum(len(e) > 1 for e in emitted) / N == pytest.approx(float(p[0, drafts[0]]), abs=_bound(N))
    if draft == "never right":
        assert all(len(e) == 1 for e in emitted)
        return
    _assert_law([e[1] for e in emitted if len(e) > 1], p[1], f"{draft}: position 1")
    if draft == "often right":
        _assert_law([e[2] for e in emitted if len(e) > 2], p[2], f"{draft}: bonus")
    # The unspeculated sampler, measured against the same bound (the bound is not what lets a sampler pass).
    plain = sample_ref(logits[:1].expand(N, V), [SampleRow(PARAMS, None)] * N, torch.Generator().manual_seed(8))
    _assert_law(plain.token_ids, p[0], "plain sampler")


@pytest.mark.parametrize("q_kind", ["full", "one-hot"])
def test_general_rule_with_a_draft_distribution(q_kind: str) -> None:
    """speculative_emit with drafts drawn from a full q (a draft model) or a point mass: the emitted tokens have the
    target's law whatever q (a q far from p rejects often, so the residual carries the weight)."""
    logits = _logits(2)
    p = torch.stack([target_probs(logits[j], PARAMS) for j in range(3)])
    # Half the target, half noise: it proposes tokens p rules out and misweights the rest (accepts ~60%).
    q = 0.5 * p[:2] + 0.5 * torch.softmax(torch.randn(2, V, generator=torch.Generator().manual_seed(3)) * 2.0, -1)
    gen, dgen = torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)
    emitted = []
    for _ in range(N):
        drafts = [draw(q[j], dgen) for j in range(2)]
        qq = q if q_kind == "full" else torch.nn.functional.one_hot(torch.tensor(drafts), V).float()
        emitted.append(speculative_emit(p, drafts, qq, gen, draw))
    _assert_law([e[0] for e in emitted], p[0], f"{q_kind}: position 0")
    _assert_law([e[1] for e in emitted if len(e) > 1], p[1], f"{q_kind}: position 1")
    accepted = sum(len(e) > 1 for e in emitted) / N
    want = float(torch.minimum(p[0], q[0]).sum()) if q_kind == "full" else float((p[0] * q[0]).sum())
    assert accepted == pytest.approx(want, abs=_bound(N))  # P(accept) = sum min(p, q), or E_d p(d) for a point mass
    assert 0.2 < accepted < 0.9  # both branches ran often


def test_general_rule_rejects_bad_shapes() -> None:
    p = torch.full((3, V), 1.0 / V)
    with pytest.raises(ValueError, match="k \\+ 1"):
        speculative_emit(p, [1], torch.full((1, V), 1.0 / V), None, draw)
    with pytest.raises(ValueError, match="draft probs"):
        speculative_emit(p, [1, 2], torch.full((1, V), 1.0 / V), None, draw)
    with pytest.raises(ValueError, match="probability 0"):
        speculative_emit(p, [1, 2], torch.zeros(2, V), None, draw)


def _plain_run(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int], seed: int,
               stop_ids: tuple[int, ...]) -> list[int]:  # fmt: skip
    """What the unspeculated sampler emits at positions 0..k, one step at a time (penalties see the tokens so far),
    each drawn from its output position's generator, as the runner's."""
    out = list(output)
    for j in range(logits.shape[0]):
        banned = stop_ids if len(out) < params.min_tokens else ()
        gen = None if params.greedy else position_generator(seed, len(out))
        row = SampleRow(params, gen, banned, prompt, list(out))
        out.append(sample_ref(logits[j : j + 1], [row], None).token_ids[0])
    return out[len(output) :]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.1, top_p=0.9, seed=5, repetition_penalty=1.5, frequency_penalty=0.7),
    SamplingParams(temperature=0.9, min_p=0.05, seed=6, min_tokens=4, presence_penalty=1.0, logit_bias={3: 2.0}),
    SamplingParams(temperature=0.0, repetition_penalty=1.8, frequency_penalty=1.5, min_tokens=3),
])  # fmt: skip
def test_seeded_verification_emits_the_plain_tokens(params: SamplingParams) -> None:
    """Per position the processors see the accepted drafts as generated tokens; a seeded (or greedy) request then
    emits exactly the plain run's tokens: all of them for drafts equal to it, up to the first wrong draft else."""
    torch.manual_seed(0)
    stop_ids = (0, 1)
    for trial in range(20):
        k = 1 + trial % 4
        logits = torch.randn(k + 1, V) * 2.0
        logits[:, 0] += 4.0  # the stop token is likely: the min_tokens ban matters
        prompt, output = [2, 3, 5, 2], [3, 3, 7][: trial % 4]
        want = _plain_run(logits, replace(params, seed=trial), prompt, output, seed=trial, stop_ids=stop_ids)
        for wrong in range(k + 1):  # drafts equal to the plain run up to `wrong`, then a token it did not emit
            drafts = want[:k]
            if wrong < k:
                drafts = [*drafts[:wrong], (want[wrong] + 1) % V, *drafts[wrong + 1 :]]
            seeded = replace(params, seed=trial)
            gen = None if params.greedy else position_generator(trial, len(output))
            base = SampleRow(seeded, gen, (), prompt, output)
            got = verify_emit(logits, drafts, position_rows(base, drafts, len(output), stop_ids), None)
            assert got == want[: wrong + 1], (trial, wrong, drafts)


def test_position_rows_refuse_a_grammar() -> None:
    row = SampleRow(PARAMS, None, allowed=torch.ones(V, dtype=torch.bool))
    with pytest.raises(ValueError, match="structured-output"):
        position_rows(row, [1], 0, ())
    with pytest.raises(ValueError, match="sample rows"):
        verify_emit(torch.zeros(2, V), [1], _rows(2), None)


def test_point_mass_emit_stops_at_the_first_miss() -> None:
    order = iter([4, 5, 1, 9])
    got = point_mass_emit(lambda j: torch.ones(V), [4, 5, 6], [None] * 4, lambda probs, gen: next(order))
    assert got == [4, 5, 1]
