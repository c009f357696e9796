"""recap/bench/kl_divergence.py's KlStats against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from recap.bench.kl_divergence import KlStats


def test_identical_logits_give_zero_kl_full_agreement_and_their_own_perplexity() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    targets = torch.arange(6)
    s = KlStats()
    s.add(logits, logits.clone(), targets)
    assert s.mean_kl == 0.0 and s.kl_quantile(0.99) == 0.0 and s.top1_agreement == 1.0
    nll = -torch.log_softmax(logits.double(), -1)[torch.arange(6), targets].sum()
    assert s.perplexity == pytest.approx(math.exp(float(nll) / 6))


def test_two_classes_match_the_closed_form_across_windows() -> None:
    # p = (0.2, 0.8) against q = (0.9, 0.1): KL = 0.2 ln(0.2/0.9) + 0.8 ln(0.8/0.1), top tokens 1 and 0
    base = torch.tensor([[math.log(0.2), math.log(0.8)]], dtype=torch.float64)
    other = torch.tensor([[math.log(0.9), math.log(0.1)]], dtype=torch.float64)
    s = KlStats()
    s.add(base, other, torch.tensor([0]))
    s.add(other, other, torch.tensor([1]))  # a second window: KL 0, same top token
    want = 0.2 * math.log(0.2 / 0.9) + 0.8 * math.log(0.8 / 0.1)
    assert s.mean_kl == pytest.approx(want / 2, rel=1e-12)
    assert s.kl_quantile(1.0) == pytest.approx(want, rel=1e-12)
    assert s.mean_kl_se == pytest.approx(want / math.sqrt(2) / math.sqrt(2), rel=1e-12)  # std of (want, 0): want/sqrt 2
    assert s.positions == 2 and s.top1_agreement == 0.5
    assert s.perplexity == pytest.approx(math.exp(-(math.log(0.9) + math.log(0.1)) / 2))


def test_a_class_the_base_gives_probability_zero_adds_nothing() -> None:
    base = torch.tensor([[0.0, 0.0, -math.inf]], dtype=torch.float64)
    other = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64)  # (1/3, 1/3, 1/3)
    s = KlStats()
    s.add(base, other, torch.tensor([0]))
    assert s.mean_kl == pytest.approx(math.log(1.5), rel=1e-12)  # 2 x 0.5 ln(0.5 / (1/3))


def test_logits_of_different_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="same"):
        KlStats().add(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))
