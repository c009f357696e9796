"""Engine behaviour: preemption, aborts, forks (n > 1), stop conditions, chat boundaries."""

from __future__ import annotations

from pathlib import Path

import pytest

from recap import SamplingParams
from recap.engine.errors import InvalidRequestError
from recap.engine.outputs import RequestOutput
from tests.engine.test_equivalence import assert_same, make_llm
from tests.engine.workloads import GREEDY, drain, rnd


def _alone(path: Path, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    llm = make_llm(path, caching=False)
    return [llm.generate([p], params)[0] for p in prompts]


@pytest.mark.parametrize("arch", ["bamba", "jamba", "nemotron_h", "granite_hybrid", "falcon_h1", "zamba2", "zamba",
                                  "minimax", "recurrent_gemma", "bailing_hybrid", "qwen4_exp", "inkling",
                                  "inkling2", "zaya"])
def test_preemption_keeps_outputs(tiny_models: dict[str, Path], arch: str) -> None:
    path = tiny_models[arch]
    probe = make_llm(path, caching=False, max_model_len=160)
    runner = probe.engine.runner  # both attention groups share the budget (RecurrentGemma: the window group alone)
    block_bytes = (runner.kv_bytes_per_token + runner.window_bytes_per_token) * 16
    # A window-only model frees blocks out of its window as requests run: its pool is the smallest the start-up
    # check accepts (one 160-token sequence), which these prompts still overrun.
    num_blocks = 12 if runner.kv_bytes_per_token else 160 // 16
    prompts = [rnd(60 + i, 50 + 7 * i) for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, ignore_eos=True)
    want = _alone(path, prompts, params)
    for policy in ("recap", "all"):
        llm = make_llm(path, caching=True, policy=policy, kv_cache_bytes=num_blocks * block_bytes, max_model_len=160,
                       max_num_seqs=8, max_num_batched_tokens=64)
        got = llm.generate(prompts, params)
        assert_same(got, want, f"{arch}/{policy}/preempted")
        assert llm.engine.scheduler.stats.preemptions > 0, "the pool was meant to force preemption"


def test_tiny_kv_budget_is_a_clear_error(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="KV cache budget"):
        make_llm(tiny_models["bamba"], caching=True, kv_cache_bytes=1)


@pytest.mark.parametrize("arch", ["mamba2", "bamba", "nemotron_h", "granite_hybrid", "falcon_h1", "zamba2", "zamba",
                                  "minimax", "recurrent_gemma", "bailing_hybrid", "qwen4_exp", "inkling",
                                  "inkling2", "rwkv", "xlstm", "zaya"])
def test_abort_mid_prefill(tiny_models: dict[str, Path], arch: str) -> None:
    path = tiny_models[arch]
    long_p, other = rnd(70, 150), rnd(71, 40)
    want = _alone(path, [other])[0]
    llm = make_llm(path, caching=True, max_num_batched_tokens=32)
    eng = llm.engine
    a = eng.add_request(long_p, GREEDY)
    b = eng.add_request(other, GREEDY)
    eng.step()
    eng.abort_request(a)
    outs = drain(eng)
    assert outs[a].outputs[0].finish_reason == "abort"
    assert_same([outs[b]], [want], f"{arch}/abort")
    eng.scheduler.check_integrity()
    # The aborted prompt's partial prefill must not be published past what was actually computed.
    again = llm.generate([long_p], GREEDY)[0]
    assert_same([again], _alone(path, [long_p]), f"{arch}/after-abort")


def test_n_samples_share_the_prompt_cache(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["bamba"]
    llm = make_llm(path, caching=True)
    p = rnd(80, 70)
    out = llm.generate([p], SamplingParams(n=3, temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs) == 3 and [o.index for o in out.outputs] == [0, 1, 2]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == out.outputs[2].token_ids
    stats = llm.engine.scheduler.stats
    assert stats.prefix_cache_hits >= 2 * 64, "forks 1 and 2 should hit the prompt end of fork 0"
    seeded = llm.generate([p], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))[0]
    again = llm.generate([p], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))[0]
    assert [o.token_ids for o in seeded.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in seeded.outputs}) > 1


def test_stop_conditions(tiny_models: dict[str, Path]) -> None:
    llm = make_llm(tiny_models["mamba2"], caching=True)
    p = rnd(90, 20)
    free = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    stop_id = free.token_ids[3]
    first = free.token_ids.index(stop_id)
    o = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_id]))[0].outputs[0]
    assert o.finish_reason == "stop" and o.token_ids == free.token_ids[: first + 1] and o.stop_reason == stop_id
    if len(free.text) > 3:
        stop = free.text[2:4]
        s = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=10, stop=[stop]))[0].outputs[0]
        assert s.finish_reason == "stop" and s.text == free.text[: free.text.index(stop)]


def test_eos_ends_with_stop_reason_none(tiny_models: dict[str, Path]) -> None:
    """vLLM's contract: the tokenizer's EOS ends a request with finish_reason "stop" and stop_reason None (so a
    client tells EOS from a stop token); the same id as an explicit stop token under ignore_eos is reported."""
    llm = make_llm(tiny_models["mamba2"], caching=False)
    eos = llm.get_tokenizer().eos_token_id
    assert isinstance(eos, int)
    forced = {"temperature": 0.0, "max_tokens": 5, "logit_bias": {eos: 100.0}}
    o = llm.generate([rnd(91, 20)], SamplingParams(**forced))[0].outputs[0]
    assert (o.finish_reason, o.token_ids, o.stop_reason) == ("stop", [eos], None)
    o = llm.generate([rnd(91, 20)], SamplingParams(**forced, ignore_eos=True, stop_token_ids=[eos]))[0].outputs[0]
    assert (o.finish_reason, o.token_ids, o.stop_reason) == ("stop", [eos], eos)


def test_invalid_requests_raise_typed_errors(tiny_models: dict[str, Path]) -> None:
    llm = make_llm(tiny_models["mamba2"], caching=True, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="out of vocabulary"):
        llm.generate([[1, 2, 99999]], GREEDY)
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        llm.generate([rnd(1, 70)], GREEDY)
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        llm.generate([rnd(1, 30)], SamplingParams(max_tokens=60))
    with pytest.raises(InvalidRequestError):
        llm.generate([[]], GREEDY)
    assert llm.generate([rnd(1, 10)], GREEDY)[0].finished  # still serving


def test_chat_passes_message_boundaries(tiny_models: dict[str, Path]) -> None:
    llm = make_llm(tiny_models["bamba"], caching=True)
    system = {"role": "system", "content": "You are a terse assistant. " * 6}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.chat([system, {"role": "user", "content": "first question?"}], params)
    second = llm.chat([system, {"role": "user", "content": "another, different one"}], params)[0]
    assert second.num_cached_tokens > 0, "the system prompt's message boundary should be a checkpoint"


@pytest.mark.parametrize("arch", ["rwkv", "mamba", "xlstm"])
@pytest.mark.parametrize("policy", ["recap", "all"])
def test_forced_preemption_of_an_attention_free_model(tiny_models: dict[str, Path], arch: str, policy: str) -> None:
    """An attention-free model never runs short of KV blocks (its slot does not grow), so memory never preempts it:
    the scheduler's own preemption is forced mid-decode instead. The preempted request starts over (from a
    checkpoint of its slot where its policy left one) and answers as it would alone."""
    path = tiny_models[arch]
    prompts = [rnd(80 + i, 45 + 9 * i) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, ignore_eos=True)
    want = _alone(path, prompts, params)
    eng = make_llm(path, caching=True, policy=policy, max_num_batched_tokens=64).engine
    ids = [eng.add_request(p, params) for p in prompts]
    outs: dict[str, RequestOutput] = {}
    sched = eng.scheduler
    for step in range(12):
        for o in eng.step():
            outs[o.request_id] = o
        if step in (5, 8) and sched._running:  # mid-decode (and mid-prefill of a later one): the tail goes
            sched._preempt(sched._running[-1])
    outs.update(drain(eng))
    assert_same([outs[i] for i in ids], want, f"{arch}/{policy}/forced-preemption")
    assert sched.stats.preemptions >= 1
    sched.check_integrity()
