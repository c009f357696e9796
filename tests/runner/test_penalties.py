"""Penalties and logit_bias: the in-place row version vs the per-token reference, their semantics,
and the batched Sampler vs sample_ref with penalized rows."""

from __future__ import annotations

import random

import pytest
import torch

from recap.runner.penalties import apply_penalties, apply_penalties_ref
from recap.runner.sampler import Sampler, SampleRow, sample_ref
from recap.sampling_params import SamplingParams


@pytest.mark.parametrize("seed", range(6))
def test_penalties_equal_reference(seed: int) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([7, 33, 101])
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 4
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
    output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 25))]
    p = SamplingParams(presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
                       repetition_penalty=rng.uniform(0.5, 2.0),
                       logit_bias={rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(3)})
    got = apply_penalties(logits.clone(), p, prompt, output)
    want = apply_penalties_ref(logits, p, prompt, output)
    torch.testing.assert_close(got, want)


def test_penalty_semantics() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    rep = apply_penalties(logits.clone(), SamplingParams(repetition_penalty=2.0), [0, 1], [])
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.5]  # positive divided, negative multiplied, unseen kept
    freq = apply_penalties(logits.clone(), SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [3], [2, 2])
    assert freq.tolist() == [2.0, -2.0, 1.0 - 1.0 - 0.25, 0.5]  # the prompt does not count for these two
    bias = apply_penalties(logits.clone(), SamplingParams(logit_bias={3: 10.0}), [], [])
    assert int(torch.argmax(bias)) == 3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampler_with_penalties_equals_reference(seed: int) -> None:
    torch.manual_seed(seed)
    logits = torch.randn(4, 41) * 3
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.7, logprobs=2),
        SamplingParams(temperature=0.8, frequency_penalty=1.0, presence_penalty=0.5, seed=3),
        SamplingParams(temperature=0.0, logit_bias={7: 50.0}, logprobs=0),
        SamplingParams(temperature=0.0),
    ]

    def rows() -> list[SampleRow]:
        return [SampleRow(p, torch.Generator().manual_seed(i), (), [1, 2, 3], [4, 4, 5]) for i, p in enumerate(params)]

    got = Sampler(0)(logits, rows())
    ref = sample_ref(logits, rows(), torch.Generator().manual_seed(0))
    assert got.token_ids == ref.token_ids
    assert got.token_ids[2] == 7  # the bias wins the argmax
    assert got.logprobs[2] is not None and ref.logprobs[2] is not None
    # logprobs are those of the raw distribution: the bias does not change them
    assert got.logprobs[2][0] == pytest.approx(float(torch.log_softmax(logits[2], -1)[7]), abs=1e-6)
    assert got.logprobs[2][1] == ref.logprobs[2][1] >= 1
