"""Offline sampling fields and outputs: penalties, logit_bias, per-request seeds under any batch mix,
vLLM's logprobs shape, prompt_logprobs (exact whatever the chunking or caching), n bounded by config."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from recap import SamplingParams
from recap.engine.errors import InvalidRequestError
from recap.engine.outputs import Logprob
from tests.engine.test_equivalence import make_llm
from tests.engine.workloads import rnd


def test_logprobs_have_vllms_shape(tiny_models: dict[str, Path]) -> None:
    llm = make_llm(tiny_models["mamba2"], caching=True)
    out = llm.generate([rnd(3, 20)], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True))[0]
    o = out.outputs[0]
    assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids) == 5
    for tok, d in zip(o.token_ids, o.logprobs):
        assert tok in d and all(isinstance(v, Logprob) for v in d.values())
        assert d[tok].rank == 1  # greedy: the sampled token is the most likely
        assert sorted(v.rank for v in d.values()) == [1, 2, 3]
        assert d[tok].decoded_token == llm.get_tokenizer().decode([tok])
    assert o.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(o.token_ids, o.logprobs)))


@pytest.mark.parametrize("arch", ["bamba", "mamba"])
def test_prompt_logprobs_are_exact_under_chunking_and_caching(tiny_models: dict[str, Path], arch: str) -> None:
    path = tiny_models[arch]
    prompt = rnd(11, 75)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2, ignore_eos=True)
    ref = make_llm(path, caching=False).generate([prompt], params)[0]
    plp = ref.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    assert all(prompt[j] in plp[j] and len(plp[j]) in (2, 3) for j in range(1, len(prompt)))
    # chunked prefill (17-token chunks) and a second identical request on a warm cache give the same values
    llm = make_llm(path, caching=True, max_num_batched_tokens=17)
    first = llm.generate([prompt], params)[0]
    again = llm.generate([prompt], params)[0]
    assert again.num_cached_tokens == 0, "a prompt_logprobs request computes its whole prompt"
    for got in (first.prompt_logprobs, again.prompt_logprobs):
        assert got is not None and len(got) == len(prompt)
        for j in range(1, len(prompt)):
            assert got[j][prompt[j]].logprob == pytest.approx(plp[j][prompt[j]].logprob, abs=1e-4)
            assert got[j][prompt[j]].rank == plp[j][prompt[j]].rank
    # teacher forcing: the prompt logprob of token j is the (raw) logprob of sampling it after prompt[:j]
    for j in (5, 40, 74):
        forced = llm.generate([prompt[:j]], SamplingParams(temperature=0.0, max_tokens=1, logprobs=0,
                                                           logit_bias={prompt[j]: 100.0}))[0].outputs[0]
        assert forced.token_ids == [prompt[j]]
        assert forced.logprobs is not None
        assert forced.logprobs[0][prompt[j]].logprob == pytest.approx(plp[j][prompt[j]].logprob, abs=1e-4)


def test_seeded_requests_reproduce_in_any_batch(tiny_models: dict[str, Path]) -> None:
    llm = make_llm(tiny_models["bamba"], caching=True)
    p = rnd(21, 30)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([p], seeded)[0].outputs[0].token_ids
    others = [rnd(30 + i, 10 + i) for i in range(4)]
    noise = SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True)
    mixed = llm.generate([others[0], p, *others[1:]], [noise, seeded, noise, noise, noise])[1].outputs[0].token_ids
    assert mixed == alone
    other_seed = llm.generate([p], SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True))[0]
    assert other_seed.outputs[0].token_ids != alone


def test_seeded_requests_reproduce_after_preemption(tiny_models: dict[str, Path]) -> None:
    """A KV pool too small for the batch preempts (recompute) mid-decode: each seeded request still draws the tokens
    it draws alone, since its k-th token's generator depends on (seed, k) only."""
    probe = make_llm(tiny_models["bamba"], caching=False).engine.runner
    prompts = [rnd(50 + i, 20 + 4 * i) for i in range(4)]
    params = [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=16, ignore_eos=True) for i in range(4)]
    alone = [make_llm(tiny_models["bamba"], caching=True).generate([p], q)[0].outputs[0].token_ids
             for p, q in zip(prompts, params)]  # fmt: skip
    tight = make_llm(tiny_models["bamba"], caching=True, kv_cache_bytes=6 * 16 * probe.kv_bytes_per_token,
                     max_num_batched_tokens=32, max_model_len=96)  # fmt: skip
    together = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.engine.scheduler.counters.num_preemptions > 0, "the pool was meant to preempt"
    assert together == alone


def test_penalties_change_greedy_output(tiny_models: dict[str, Path]) -> None:
    llm = make_llm(tiny_models["mamba2"], caching=True)
    p = rnd(5, 12)
    plain = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    assert len(set(plain.token_ids)) < len(plain.token_ids), "a tiny random model repeats itself"
    pres = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                            presence_penalty=2.0, logit_bias=None))[0].outputs[0]
    strong = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                              logit_bias={t: -100.0 for t in plain.token_ids}))[0].outputs[0]
    assert not set(strong.token_ids) & set(plain.token_ids)
    assert pres.token_ids != plain.token_ids
    assert not math.isnan(sum(pres.token_ids))


def test_n_is_bounded_by_the_engine_config(tiny_models: dict[str, Path]) -> None:
    llm = make_llm(tiny_models["mamba2"], caching=True, max_n=3)
    out = llm.generate([rnd(1, 8)], SamplingParams(n=3, max_tokens=2))[0]
    assert len(out.outputs) == 3
    with pytest.raises(InvalidRequestError, match="n: 4 choices asked, at most 3 are allowed"):
        llm.generate([rnd(1, 8)], SamplingParams(n=4, max_tokens=2))
    with pytest.raises(ValueError, match="n must be at least 1"):
        SamplingParams(n=0)
