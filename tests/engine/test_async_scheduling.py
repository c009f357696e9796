"""Async scheduling through the real engine (LLM(..., async_scheduling=True)) on tiny hybrids: a Mamba2 hybrid
(Bamba), a GDN hybrid (Qwen3.5) and LFM2 (short convs + attention). Against the synchronous loop on the same
workloads: the same greedy and seeded-sampling tokens, finish reasons and texts, with chunked prefill, several
concurrent requests with different max_tokens, stop strings and stop token ids (the step run past a stop never
shows), prefix-cache hits over multi-turn prompts (the same blocks and checkpoints registered), aborts mid-decode
and preemption under a tiny KV pool; the integrity check runs after every step. The engine's call order shows the
overlap: step N+1 is scheduled before step N is updated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recap import LLM, SamplingParams
from recap.config import SchedulerConfig, SpeculativeConfig
from recap.core.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from recap.core.scheduler import Scheduler
from recap.core.stats import RequestUpdate
from recap.engine.config import EngineConfig
from recap.engine.llm_engine import LLMEngine
from recap.engine.outputs import RequestOutput
from recap.runner.host_copy import PendingSamples
from recap.runner.placeholders import SampledIds, fill_ref
from tests.core.test_async_scheduling import registered
from tests.engine.conftest import tiny_model_dir
from tests.engine.workloads import drain, rnd

ARCHS = ["bamba", "qwen3_5", "lfm2"]
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("async")
    return {a: tiny_model_dir(root, a) for a in ARCHS}


def make(path: Path, async_on: bool, **kw: object) -> LLM:
    opts: dict[str, object] = {"block_size": 16, "max_model_len": 256, "check_integrity": True, "seed": 0,
                               "num_threads": 1, **kw}  # fmt: skip
    return LLM(str(path), async_scheduling=async_on, **opts)  # type: ignore[arg-type]


def answers(outs: list[RequestOutput]) -> list[tuple[list[int], str | None, str, int]]:
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text, len(o.outputs[0].token_ids))
            for o in outs]  # fmt: skip


def mixed_batch(path: Path) -> tuple[list[list[int]], list[SamplingParams]]:
    """Concurrent prompts sharing a prefix, greedy and seeded, with different max_tokens, stop ids and a stop string
    taken from a plain greedy answer (so they fire mid-decode), and one with penalties."""
    base = rnd(1, 40)
    prompts = [base[: 10 + 6 * i] + rnd(10 + i, 5 + 3 * i) for i in range(7)]
    probe = make(path, False, enable_prefix_caching=False).generate(
        prompts[:2], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stop_id = probe[0].outputs[0].token_ids[4]
    text = probe[1].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2] or text
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop_id,)),
        SamplingParams(temperature=0.0, max_tokens=12, stop=(stop,)),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=11, max_tokens=9),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        # its sampler reads its output history on the host: it waits for each token (Request.host_tokens)
        SamplingParams(temperature=0.0, presence_penalty=1.5, repetition_penalty=1.3, max_tokens=10, ignore_eos=True),
    ]
    return prompts, params


@pytest.mark.parametrize("arch", ARCHS)
def test_concurrent_mixed_requests_answer_as_the_synchronous_loop(models: dict[str, Path], arch: str) -> None:
    prompts, params = mixed_batch(models[arch])
    want = answers(make(models[arch], False, max_num_batched_tokens=24).generate(prompts, params))
    got = answers(make(models[arch], True, max_num_batched_tokens=24).generate(prompts, params))
    assert got == want
    assert want[0][1] == "stop" and want[1][1] == "stop" and want[2][3] == 3  # the stops fired mid-decode


@pytest.mark.parametrize("arch", ARCHS)
def test_multi_turn_hits_register_the_same_blocks_and_checkpoints(models: dict[str, Path], arch: str) -> None:
    """Each turn repeats the last one and its answer: prefix hits; the same cache afterwards."""
    runs = []
    for async_on in (False, True):
        llm = make(models[arch], async_on, max_num_batched_tokens=32)
        prompt, turns = rnd(3, 37), []
        for t in range(4):
            (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5 + 7 * t, ignore_eos=True))
            turns.append((out.outputs[0].token_ids, out.num_cached_tokens))
            prompt = prompt + out.outputs[0].token_ids + rnd(20 + t, 9)
        runs.append((turns, registered(llm.engine.scheduler)))
    (want, want_cache), (got, got_cache) = runs
    assert got == want and any(cached for _, cached in want[1:])
    assert got_cache == want_cache and want_cache[0]


@pytest.mark.parametrize("arch", ["bamba", "qwen3_5"])
def test_preemption_under_a_tiny_kv_pool(models: dict[str, Path], arch: str) -> None:
    """No request is preempted while a step in flight runs its row: none loses a sampled token."""
    probe = make(models[arch], False).engine.runner
    kv = 7 * 16 * (probe.kv_bytes_per_token + probe.window_bytes_per_token)
    prompts = [rnd(40 + i, 20 + 5 * i) for i in range(4)]
    # seeded requests too: a preempted request resumes without losing or repeating a draw of its generator
    params = [SamplingParams(temperature=0.8 * (i % 2), seed=3 + i, max_tokens=14, ignore_eos=True) for i in range(4)]
    outs, preempted = [], []
    for async_on in (False, True):
        llm = make(models[arch], async_on, kv_cache_bytes=kv, max_num_batched_tokens=32, max_model_len=96)
        outs.append(answers(llm.generate(prompts, params)))
        preempted.append(llm.engine.scheduler.counters.num_preemptions)
    assert outs[1] == outs[0]
    assert preempted[0] > 0 and preempted[1] > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_an_abort_mid_decode_leaves_the_others_as_they_were(models: dict[str, Path], arch: str) -> None:
    prompts = [rnd(60 + i, 18 + 4 * i) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    results = []
    for async_on in (False, True):
        eng = make(models[arch], async_on).engine
        ids = [eng.add_request(p, params) for p in prompts]
        seen: dict[str, RequestOutput] = {}
        for _ in range(4):
            seen.update((o.request_id, o) for o in eng.step())
        eng.abort_request(ids[1])
        eng.scheduler.check_integrity()
        seen.update(drain(eng))
        results.append({rid: seen[rid].outputs[0] for rid in ids})
        assert eng.scheduler.view.in_flight is None and not eng.scheduler.view.deferred
    want, got = results
    assert [got[i].token_ids for i in (ids[0], ids[2])] == [want[i].token_ids for i in (ids[0], ids[2])]
    assert got[ids[1]].finish_reason == "abort" and len(got[ids[1]].token_ids) < 10


def record_calls(sched: Scheduler, calls: list[tuple[str, int]]) -> None:
    """Record every schedule() and update_from_output() of `sched` with its step number, in call order."""
    schedule, update = sched.schedule, sched.update_from_output

    def recorded_schedule() -> SchedulerOutput:
        out = schedule()
        calls.append(("schedule", out.step))
        return out

    def recorded_update(out: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestUpdate]:
        calls.append(("update", out.step))
        return update(out, result)

    sched.schedule, sched.update_from_output = recorded_schedule, recorded_update  # type: ignore[method-assign]


def test_schedule_of_step_n_plus_1_comes_before_the_update_of_step_n(models: dict[str, Path]) -> None:
    for async_on in (False, True):
        calls: list[tuple[str, int]] = []
        eng = make(models["bamba"], async_on).engine
        record_calls(eng.scheduler, calls)
        eng.add_request(rnd(5, 20), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        drain(eng)
        at = {call: i for i, call in enumerate(calls)}
        ahead = [n for kind, n in calls if kind == "update" and at.get(("schedule", n + 1), len(calls)) < at[kind, n]]
        assert (len(ahead) >= 4) == async_on, calls


def test_placeholders_are_filled_from_the_last_steps_ids_as_the_reference_does() -> None:
    from recap.core.output import PLACEHOLDER_TOKEN_ID

    sampled = {"a": 11, "b": 22, "c": 33}
    ids = SampledIds()
    ids.keep(list(sampled), torch.tensor(list(sampled.values())), torch.device("cpu"))
    rows = [ScheduledRequest("c", [PLACEHOLDER_TOKEN_ID], 5, [], -1, placeholder=True),
            ScheduledRequest("x", [1, 2, 3], 0, [], -1),
            ScheduledRequest("a", [PLACEHOLDER_TOKEN_ID], 9, [], -1, placeholder=True)]  # fmt: skip
    flat = torch.tensor([t for s in rows for t in s.token_ids] + [0, 0])  # two padding ids after the rows
    ids.fill(rows, flat)
    assert flat.tolist() == [t for r in fill_ref(rows, sampled) for t in r] + [0, 0] == [33, 1, 2, 3, 11, 0, 0]
    with pytest.raises(RuntimeError, match="sampled nothing"):
        ids.fill([ScheduledRequest("z", [PLACEHOLDER_TOKEN_ID], 1, [], -1, placeholder=True)], flat)


def test_async_scheduling_with_speculative_decoding_is_refused() -> None:
    with pytest.raises(ValueError, match="does not combine with speculative"):
        EngineConfig(scheduler=SchedulerConfig(async_scheduling=True), speculative=SpeculativeConfig.parse(
            {"method": "ngram", "num_speculative_tokens": 2}))


def trace_ids(eng: LLMEngine, trace: list[tuple[str, int]], mp: pytest.MonkeyPatch) -> None:
    """Record each execute (its step's output left pending), each apply, each resolution of a step's ids and each
    placeholder fill (with the step whose greedy-head tensor it read)."""
    runner, stepping = eng.runner, [-1]
    heads: dict[int, torch.Tensor] = {}
    execute, greedy, fill = runner.execute, runner.backend.forward_greedy, runner.sampled_ids.fill
    resolve, apply = PendingSamples.resolve, eng._apply
    by_pending: dict[int, int] = {}

    def traced_execute(out: SchedulerOutput) -> ModelRunnerOutput:
        stepping[0] = out.step
        result = execute(out)
        if result.pending is not None:
            by_pending[id(result.pending)] = out.step
            assert not result.sampled_token_ids  # nothing read on the host yet
        trace.append(("execute", out.step))
        return result

    def traced_greedy(*a: object) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, ids = greedy(*a)  # type: ignore[arg-type]
        heads[stepping[0]] = ids
        return hidden, ids

    def traced_fill(rows: list[ScheduledRequest], input_ids: torch.Tensor) -> None:
        if any(s.placeholder for s in rows):
            prev = next(n for n, t in heads.items() if t is runner.sampled_ids.ids)  # the head's own tensor
            trace.append(("fill", prev))
        fill(rows, input_ids)

    def traced_resolve(self: PendingSamples, result: ModelRunnerOutput) -> None:
        trace.append(("resolve", by_pending[id(self)]))
        resolve(self, result)

    def traced_apply(out: SchedulerOutput, result: ModelRunnerOutput, t0: float) -> None:
        trace.append(("apply", out.step))
        apply(out, result, t0)

    mp.setattr(runner, "execute", traced_execute)
    mp.setattr(runner.backend, "forward_greedy", traced_greedy)
    mp.setattr(runner.sampled_ids, "fill", traced_fill)
    mp.setattr(PendingSamples, "resolve", traced_resolve)
    mp.setattr(eng, "_apply", traced_apply)


@pytest.mark.parametrize("async_on", [False, True])
def test_sampled_ids_stay_unresolved_until_the_step_is_applied(
        models: dict[str, Path], async_on: bool, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Under async scheduling the runner's output holds the greedy head's tensor, unread, until `_apply`, which
    comes after the next step ran; that step's placeholders were filled from the tensor itself. The synchronous
    loop reads them before execute returns."""
    eng = make(models["bamba"], async_on).engine
    trace: list[tuple[str, int]] = []
    trace_ids(eng, trace, monkeypatch)
    eng.add_request(rnd(5, 20), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    drain(eng)
    resolved = [n for kind, n in trace if kind == "resolve"]
    if not async_on:
        assert not resolved and not any(kind == "fill" for kind, _ in trace)
        return
    at = {call: i for i, call in enumerate(trace)}
    assert resolved == sorted(resolved) and len(resolved) >= 7
    for n in resolved:  # each resolution is its step's apply, after the next step ran (but for the last)
        assert at["apply", n] < at["resolve", n]
        assert at.get(("execute", n + 1), -1) < at["resolve", n] or n == resolved[-1]
    fills = [n for kind, n in trace if kind == "fill"]
    assert len(fills) >= 5 and all(at["fill", n] < at["resolve", n] for n in fills)
