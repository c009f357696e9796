"""KL divergence of a model's next-token distributions from a base model's, as llama-perplexity's
`--kl-divergence` reports it: per scored position KL(base || other) = sum_v p(v) (log p(v) - log q(v)) over the
whole vocabulary, then its mean and percentiles over the positions, and how often the two agree on the most
likely token ("Same top p"). benchmarks/kl_divergence.py runs it on the trained default models.

KlStats takes the logits a window at a time, so no run holds more than one window's; it keeps one float per
position (the percentiles need them all). The sums run in float64: a quantized model's KL is of order 1e-4 nats
per position, and fp32's cancellation in p (log p - log q) is of that size at an 8k vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class KlStats:
    """KL(base || other), top-1 agreement and the other model's perplexity over the positions added."""

    kl: list[torch.Tensor] = field(default_factory=list)  # [n] float64 per add()
    same_top: int = 0
    nll: float = 0.0  # the other model's, on the true next tokens
    positions: int = 0

    def add(self, base_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """base_logits, logits [n, V] of the same n positions (a base logit may be -inf: probability 0);
        targets [n] the true next tokens."""
        if base_logits.shape != logits.shape or base_logits.dim() != 2:
            raise ValueError(f"logits of the same [positions, vocabulary] shape expected, got "
                             f"{tuple(base_logits.shape)} and {tuple(logits.shape)}")  # fmt: skip
        lp = torch.log_softmax(base_logits.double(), dim=-1)
        lq = torch.log_softmax(logits.double(), dim=-1)
        terms = torch.where(lp > -math.inf, lp.exp() * (lp - lq), 0.0)  # p = 0 adds nothing (a -inf base logit)
        self.kl.append(terms.sum(-1).clamp_min(0.0))  # >= 0 exactly; rounding can go below
        self.same_top += int((base_logits.argmax(-1) == logits.argmax(-1)).sum())
        self.nll -= float(lq.gather(1, targets.view(-1, 1)).sum())
        self.positions += base_logits.shape[0]

    def _all(self) -> torch.Tensor:
        if not self.kl:
            raise ValueError("no positions added")
        return torch.cat(self.kl)

    @property
    def mean_kl(self) -> float:
        return float(self._all().mean())

    @property
    def mean_kl_se(self) -> float:
        """The mean's standard error (llama-perplexity's "±"): the positions' standard deviation / sqrt(n)."""
        kl = self._all()
        return float(kl.std() / math.sqrt(kl.numel())) if kl.numel() > 1 else 0.0

    def kl_quantile(self, q: float) -> float:
        """The q-quantile of the per-position KL (linear interpolation between the sorted values)."""
        return float(torch.quantile(self._all(), q))

    @property
    def top1_agreement(self) -> float:
        """The fraction of positions where both models' most likely token is the same."""
        return self.same_top / self.positions

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.positions)

    def summary(self) -> dict[str, float | int]:
        return {"mean_kl": self.mean_kl, "mean_kl_pm": self.mean_kl_se, "kl_p99": self.kl_quantile(0.99),
                "max_kl": float(self._all().max()), "top1_agreement": self.top1_agreement,
                "perplexity": self.perplexity, "positions": self.positions}  # fmt: skip
