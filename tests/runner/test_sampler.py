"""Batched Sampler vs the per-row reference, and the filters' semantics."""

from __future__ import annotations

import pytest
import torch

from recap.runner.sampler import Sampler, SampleRow, _filter_logits, sample_ref, takes_argmax
from recap.sampling_params import SamplingParams


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_batched_equals_reference(seed: int) -> None:
    torch.manual_seed(seed)
    logits = torch.randn(7, 53) * 3
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.7, top_k=5, seed=11),
        SamplingParams(temperature=1.3, top_p=0.8, seed=12, logprobs=0),
        SamplingParams(temperature=1.0, min_p=0.2, seed=13),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=3, top_p=0.5, min_p=0.1, seed=14, logprobs=5),
        SamplingParams(temperature=0.0, logprobs=2),
    ]
    rows_a = [SampleRow(p, _gen(100 + i), (4, 9) if i == 4 else ()) for i, p in enumerate(params)]
    rows_b = [SampleRow(p, _gen(100 + i), (4, 9) if i == 4 else ()) for i, p in enumerate(params)]
    got = Sampler(seed=0)(logits, rows_a)
    ref = sample_ref(logits, rows_b, _gen(0))
    assert got.token_ids == ref.token_ids
    for a, b in zip(got.logprobs, ref.logprobs):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert a[0] == pytest.approx(b[0], abs=1e-6)
            assert a[1] == b[1]  # rank
            assert [t for t, _ in a[2]] == [t for t, _ in b[2]]


def test_greedy_is_argmax_and_ban_applies() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 2.0, 1.0]])
    rows = [SampleRow(SamplingParams(temperature=0.0), None, (1,)), SampleRow(SamplingParams(temperature=0.0), None)]
    assert Sampler(0)(logits, rows).token_ids == [2, 0]


def test_filters_keep_the_right_support() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    keep = lambda p: torch.isfinite(_filter_logits(logits, p)).nonzero().flatten().tolist()  # noqa: E731
    assert keep(SamplingParams(top_k=2)) == [0, 1]
    assert keep(SamplingParams(top_p=0.75)) == [0, 1]  # 0.5 < 0.75, 0.5 + 0.3 reaches it
    assert keep(SamplingParams(top_p=0.5)) == [0]
    assert keep(SamplingParams(min_p=0.5)) == [0, 1]  # p >= 0.25
    assert keep(SamplingParams(min_p=0.05)) == [0, 1, 2, 3]


def test_seeded_sampling_is_reproducible_and_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    p = SamplingParams(temperature=1.0, seed=5)
    s = Sampler(0)
    draws_a = [s(logits, [SampleRow(p, g)]).token_ids[0] for g in [_gen(7)] for _ in range(1)]
    g1, g2 = _gen(7), _gen(7)
    seq1 = [s(logits, [SampleRow(p, g1)]).token_ids[0] for _ in range(50)]
    seq2 = [s(logits, [SampleRow(p, g2)]).token_ids[0] for _ in range(50)]
    assert seq1 == seq2 and draws_a[0] == seq1[0]
    g = _gen(3)
    counts = torch.bincount(torch.tensor([s(logits, [SampleRow(p, g)]).token_ids[0] for _ in range(3000)]), minlength=3)
    freq = counts.float() / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.04)


def test_invalid_params_raise() -> None:
    for kw in [dict(n=0), dict(temperature=-1), dict(top_p=0.0), dict(min_p=1.5), dict(max_tokens=0),
               dict(logprobs=99), dict(top_k=-2), dict(stop=[""])]:
        with pytest.raises(ValueError):
            SamplingParams(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("temperature", [5e-324, 1e-39, 9e-6])
def test_a_temperature_below_eps_is_argmax(temperature: float) -> None:
    """Dividing by a subnormal temperature overflows the logits to inf (a NaN softmax): such rows are greedy."""
    torch.manual_seed(7)
    logits = torch.randn(3, 41) * 4
    rows = [SampleRow(SamplingParams(temperature=temperature, seed=i, logprobs=1), _gen(i)) for i in range(3)]
    got = Sampler(seed=0)(logits, rows)
    assert got.token_ids == torch.argmax(logits, -1).tolist()
    assert got.token_ids == sample_ref(logits, rows, _gen(0)).token_ids


@pytest.mark.parametrize(
    ("params", "banned", "constrained", "want"),
    [
        (SamplingParams(temperature=0.0), False, False, True),
        (SamplingParams(temperature=0.0, logprobs=0), False, False, False),
        (SamplingParams(temperature=0.7), False, False, False),
        (SamplingParams(temperature=0.0, repetition_penalty=1.1), False, False, False),
        (SamplingParams(temperature=0.0, logit_bias={3: 1.0}), False, False, False),
        (SamplingParams(temperature=0.0), True, False, False),
        (SamplingParams(temperature=0.0), False, True, False),
    ],
)
def test_takes_argmax_only_for_plain_greedy_rows(params: SamplingParams, banned: bool, constrained: bool,
                                                 want: bool) -> None:  # fmt: skip
    """The rows whose token a backend may take inside its step (Backend.forward_greedy): and for those, the
    sampler's token is the argmax of the raw logits."""
    assert takes_argmax(params, banned, constrained) is want
    logits = torch.randn(3, 41, generator=_gen(5))
    if want:
        rows = [SampleRow(params, None) for _ in range(3)]
        assert Sampler(0)(logits, rows).token_ids == torch.argmax(logits, dim=-1).tolist()
