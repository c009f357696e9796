"""Speculation for sampled and penalized requests (docs/speculative.md, "Sampled requests"): in one batch with greedy
ones, a seeded sampled request emits exactly its unspeculated tokens (the point-mass rejection rule draws as the
plain sampler does), whatever the drafts and the schedule; penalties and min_tokens are applied per draft position;
the integrity check holds after every step; the acceptance counters add up to what the drafts and outputs show.
The law of unseeded draws is tested in tests/runner/test_rejection.py."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from recap import SamplingParams
from recap.core.request import Request
from recap.engine.output_processor import child_id
from tests.engine.conftest import tiny_model_dir
from tests.engine.test_speculative import ALL, NONE, OVERRIDES, ScriptedDrafter, _mixed, make, tokens, with_drafter
from tests.engine.workloads import rnd

MIXED = [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, frequency_penalty=0.4, min_tokens=5),
    SamplingParams(temperature=0.9, top_k=40, max_tokens=24, seed=11, ignore_eos=True),
    SamplingParams(temperature=1.2, top_p=0.9, min_p=0.02, presence_penalty=0.5, max_tokens=24, seed=12, min_tokens=8),
    SamplingParams(temperature=0.7, max_tokens=20, seed=13, logit_bias={5: 3.0}, ignore_eos=True),
]
ARCHS = ["mamba2", "qwen3_5", "bamba"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec_sampled")
    return {a: tiny_model_dir(root, a, **OVERRIDES.get(a, {})) for a in ARCHS}


def _prompts() -> list[list[int]]:
    return [rnd(100 + i, 9 + 11 * i) for i in range(len(MIXED))]


def _alone(path: Path, prompts: list[list[int]], params: Sequence[SamplingParams]) -> list[list[int]]:
    llm = make(path, spec=False, caching=False)
    return [tokens(llm.generate([p], sp))[0] for p, sp in zip(prompts, params)]


class Recording:
    """Wraps a drafter; keeps (request id, output length, drafts) of every non-empty proposal."""

    def __init__(self, inner: ScriptedDrafter) -> None:
        self.inner = inner
        self.proposals: list[tuple[str, int, list[int]]] = []

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        drafts = self.inner.propose(request, max_tokens)
        if drafts:
            self.proposals.append((request.request_id, len(request.output_token_ids), list(drafts)))
        return drafts

    def forget(self, request_id: str) -> None:
        self.inner.forget(request_id)


def parent_id(rid: str) -> str:
    parent = rid.rpartition("#")[0]
    assert child_id(parent, 0) == rid, rid
    return parent


def _accepted(drafts: list[int], rest: list[int]) -> int:
    """A point-mass draft is accepted iff the emitted token equals it (a rejection draws from p without it)."""
    a = 0
    while a < len(drafts) and a < len(rest) and drafts[a] == rest[a]:
        a += 1
    return a


@pytest.mark.parametrize("arch", ARCHS)
def test_sampled_requests_speculate_beside_greedy_ones(models: dict[str, Path], arch: str) -> None:
    path = models[arch]
    prompts = _prompts()
    want = _alone(path, prompts, MIXED)
    ref = {tuple(p): w for p, w in zip(prompts, want)}
    for name, accept, budget in (("mixed", _mixed, 24), ("all", ALL, 64), ("none", NONE, 40)):
        drafter = Recording(ScriptedDrafter(ref, accept))
        llm = with_drafter(make(path, spec=True, max_num_batched_tokens=budget), drafter)
        outs = llm.generate(prompts, MIXED)
        assert tokens(outs) == want, f"{arch}/{name}"
        stats = llm.engine.scheduler.stats
        by_rid = {o.request_id: o.outputs[0].token_ids for o in outs}
        seen = {rid for rid, _, _ in drafter.proposals}
        assert len(seen) == len(MIXED), f"{arch}/{name}: only {sorted(seen)} drafted"
        # The counters add up to what the drafts and the outputs show.
        per_step = [_accepted(d, _output(by_rid, rid)[done:]) for rid, done, d in drafter.proposals]
        assert stats.spec.num_drafts == len(drafter.proposals)
        assert stats.spec.num_draft_tokens == sum(len(d) for _, _, d in drafter.proposals)
        assert stats.spec.num_accepted_tokens == sum(per_step)
        assert list(stats.spec.accepted_per_position) == [sum(a > j for a in per_step) for j in range(3)]
        if name == "all":
            assert stats.spec.num_accepted_tokens == stats.spec.num_draft_tokens
        if name == "none":
            assert stats.spec.num_accepted_tokens == 0


def _output(by_rid: dict[str, list[int]], rid: str) -> list[int]:
    """The output of the request a core request id belongs to (n = 1: its only child)."""
    return by_rid[parent_id(rid)]


def test_ngram_drafter_with_sampled_requests_reproduces_seeds(models: dict[str, Path]) -> None:
    """The n-gram drafter on self-repeating prompts: seeded requests give their unspeculated output, run after run."""
    path = models["mamba2"]
    prompts = [rnd(120 + i, 5) * 6 for i in range(len(MIXED))]
    want = _alone(path, prompts, MIXED)
    for _ in range(2):
        llm = make(path, spec=True)
        assert tokens(llm.generate(prompts, MIXED)) == want
        assert llm.engine.scheduler.stats.spec.num_drafts > 0
