"""Speculative decoding (docs/speculative.md): greedy output with drafts equals the output without, token for
token, whatever the drafts and however many are accepted; the recurrent state is rolled back exactly; rejected
drafts leave no trace in hashes, blocks or checkpoints. Drafters: the n-gram one, and test-only drafters that
propose the target's own greedy continuation (all accepted), garbage (none accepted) or a scripted mix."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from recap import LLM, SamplingParams
from recap.backends import CpuBackend
from recap.backends.verify_graph import MAX_VERIFY_TOKENS
from recap.core.output import SchedulerOutput
from recap.core.request import Request
from recap.core.speculation import FIRST_DRAFTS
from recap.engine.outputs import RequestOutput
from tests.engine.conftest import tiny_model_dir
from tests.engine.workloads import drain, rnd

K = 3
VOCAB = 512
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# Every decode step drafts (no backoff after misses), so every acceptance pattern runs as scripted.
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "max_draft_backoff": 0}
# Mamba1, Mamba2, Gated DeltaNet (Qwen3.5) and a short-conv hybrid (LFM2); Bamba adds attention to Mamba2, LFM3
# sliding-window attention (the window group), Kimi-Linear KDA with MLA, RecurrentGemma RG-LRU states with
# sliding-window attention only, RWKV-4 WKV states and token shifts, xLSTM mLSTM states (both attention-free),
# Zaya's q/k conv windows and value shift beside full and sliding attention.
ARCHS = ["mamba", "mamba2", "qwen3_5", "lfm2", "bamba", "lfm3", "kimi_linear", "recurrent_gemma", "rwkv", "xlstm",
         "zaya"]


# The default tiny Mamba1 repeats one token whatever its state: a wider init makes its output depend on it.
OVERRIDES: dict[str, dict[str, object]] = {"mamba": {"initializer_range": 0.3}}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    paths = {a: tiny_model_dir(root, a, **OVERRIDES.get(a, {})) for a in ARCHS}
    paths["repeats"] = tiny_model_dir(root / "repeats", "mamba")  # the default tiny Mamba1: one token, repeated
    return paths


def make(path: Path, spec: bool | dict[str, object], caching: bool = True, **kw: object) -> LLM:
    """spec: True for SPEC, or a speculative config of its own."""
    opts: dict[str, object] = {"block_size": 16, "max_model_len": 256, "check_integrity": True, "seed": 0,
                               "max_num_seqs": 8, "num_threads": 1, **kw}
    config = SPEC if spec is True else spec or None
    return LLM(str(path), enable_prefix_caching=caching, speculative_config=config, **opts)  # type: ignore[arg-type]


def tokens(outs: Sequence[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


class ScriptedDrafter:
    """Proposes from the reference (unspeculated) continuation of each prompt: `accept(request, call)` drafts
    taken from it, then wrong tokens. Accepting everything is the draft = target bound; 0 is pure overhead."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], accept: Callable[[Request, int], int]) -> None:
        self.reference = reference
        self.accept = accept
        self.calls: dict[str, int] = defaultdict(int)
        self.accepted: dict[str, list[int]] = defaultdict(list)  # per request: what each verify step accepts

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        ref = self.reference[tuple(request.prompt_token_ids)]
        done = len(request.output_token_ids)
        assert request.output_token_ids == ref[:done], "the speculated output left the reference"
        call = self.calls[request.request_id]
        self.calls[request.request_id] += 1
        good = ref[done : done + max_tokens][: self.accept(request, call)]
        nxt = ref[done + len(good)] if done + len(good) < len(ref) else 0
        bad = [(nxt + 1 + j) % VOCAB for j in range(max_tokens - len(good))]  # never the reference's next token
        self.accepted[request.request_id].append(len(good))  # bad[0] is never the reference's token
        return good + bad

    def forget(self, request_id: str) -> None:
        pass


def with_drafter(llm: LLM, drafter: object) -> LLM:
    speculator = llm.engine.scheduler.speculator
    assert speculator is not None
    speculator.drafter = drafter  # type: ignore[assignment]
    return llm


def reference(path: Path, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    llm = make(path, spec=False, caching=False)
    return [tokens(llm.generate([p], params))[0] for p in prompts]


def _prompts() -> list[list[int]]:
    # Self-repeating prompts (for the n-gram drafter) of odd lengths around block boundaries.
    return [rnd(1, 7) * 5, rnd(2, 40), rnd(3, 11) * 3 + rnd(4, 5), rnd(5, 33)]


ALL = lambda request, call: K  # noqa: E731
NONE = lambda request, call: 0  # noqa: E731
PATTERN = (2, 0, 3, 1, 0, 3)


def _mixed(request: Request, call: int) -> int:
    """Per request a different acceptance: all, none, and a pattern with >= 2 then 0."""
    kind = sum(request.prompt_token_ids) % 3
    return K if kind == 0 else 0 if kind == 1 else PATTERN[call % len(PATTERN)]


@pytest.mark.parametrize("arch", ARCHS)
def test_speculation_equals_plain_greedy(models: dict[str, Path], arch: str) -> None:
    """Caching on, chunked prefill, one batch whose rows accept all, none or some drafts; then n-gram drafts."""
    path = models[arch]
    prompts = _prompts()
    want = reference(path, prompts)
    ref = {tuple(p): w for p, w in zip(prompts, want)}
    for name, accept in (("all", ALL), ("none", NONE), ("mixed", _mixed)):
        llm = with_drafter(make(path, spec=True, max_num_batched_tokens=24), ScriptedDrafter(ref, accept))
        assert tokens(llm.generate(prompts, GREEDY)) == want, f"{arch}/{name}"
        stats = llm.engine.scheduler.stats
        assert stats.spec.num_drafts > 0, f"{arch}/{name}: no verify step ran"
        if name == "all":
            assert stats.spec.num_accepted_tokens == stats.spec.num_draft_tokens
        if name == "none":
            assert stats.spec.num_accepted_tokens == 0
    llm = make(path, spec=True, max_num_batched_tokens=24)  # the n-gram drafter
    assert tokens(llm.generate(prompts, GREEDY)) == want, f"{arch}/ngram"


def _running(llm: LLM) -> tuple[int, int] | None:
    """(computed tokens, running slot) of the engine's one running request; None when it is done."""
    sched = llm.engine.scheduler
    if not sched.view.running:
        return None
    (request,) = sched.view.running
    return request.num_computed_tokens, sched.cache.state_slot(request.request_id)


@pytest.mark.parametrize("arch", ARCHS)
def test_rolled_back_state_equals_plain_state(models: dict[str, Path], arch: str) -> None:
    """After every verify step (accepting 2, 0, 3, 1, 0, 3 drafts) the running slot holds what an unspeculated run
    holds after as many tokens: every recurrent layer's conv window and SSM / matrix state."""
    path = models[arch]
    prompt = rnd(31, 23)
    (want,) = reference(path, [prompt])
    plain = make(path, spec=False, caching=False)
    spec = with_drafter(make(path, spec=True, caching=False),
                        ScriptedDrafter({tuple(prompt): want}, lambda request, call: PATTERN[call % len(PATTERN)]))
    plain.engine.add_request(prompt, GREEDY)
    spec.engine.add_request(prompt, GREEDY)
    plain.engine.step()  # the prompt, as the first spec step
    compared = 0
    while (at := (spec.engine.step(), _running(spec))[1]) is not None:
        computed, slot = at
        while (mine := _running(plain)) is not None and mine[0] < computed:
            plain.engine.step()
        assert mine is not None and mine[0] == computed
        a, b = spec.engine.runner.caches, plain.engine.runner.caches
        assert int(a.slot_positions[slot]) == int(b.slot_positions[mine[1]]) == computed
        for x, y in zip(a.state_tensors(), b.state_tensors()):
            torch.testing.assert_close(x[slot], y[mine[1]], rtol=1e-4, atol=1e-5)
        compared += 1
    assert compared >= len(PATTERN) and spec.engine.scheduler.stats.spec.num_accepted_tokens > 0


def test_ngram_drafts_are_accepted_where_the_output_repeats(models: dict[str, Path]) -> None:
    """A model whose greedy output repeats itself: the n-gram drafter's proposals are accepted, output unchanged."""
    path = models["repeats"]
    prompts = _prompts()
    want = reference(path, prompts)
    assert all(len(set(w)) == 1 for w in want), "the tiny model was meant to repeat one token"
    llm = make(path, spec=True)
    assert tokens(llm.generate(prompts, GREEDY)) == want
    stats = llm.engine.scheduler.stats
    assert stats.spec.num_accepted_tokens > 0 and stats.spec.mean_acceptance_length > 2.0


@pytest.mark.parametrize("arch", ["bamba"])
def test_long_adaptive_drafts_equal_plain_greedy(models: dict[str, Path], arch: str) -> None:
    """k = 15 with the default backoff: a request's cap starts at FIRST_DRAFTS and doubles while its drafts are all
    accepted (verify rows of 5, 9 and up to 16 tokens: the verify graphs of those sizes), halves on misses; greedy
    output equals the plain run's for drafts all, none or partly right, and for the n-gram drafter."""
    path = models[arch]
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    want = reference(path, prompts, params)
    ref = {tuple(p): w for p, w in zip(prompts, want)}
    long = {"method": "ngram", "num_speculative_tokens": 15, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    for name, accept in (("all", lambda request, call: 15), ("mixed", lambda request, call: (15, 15, 2, 0)[call % 4])):
        drafter = ScriptedDrafter(ref, accept)
        llm = with_drafter(make(path, spec=long, max_num_batched_tokens=64, max_num_seqs=1), drafter)
        assert tokens(llm.generate(prompts, params)) == want, f"{arch}/{name}"
        if name == "all":
            longest = max(max(a) for a in drafter.accepted.values())
            assert longest > 2 * FIRST_DRAFTS, f"{arch}: the cap never grew past {2 * FIRST_DRAFTS}"
    llm = make(path, spec=long, max_num_batched_tokens=64)
    assert tokens(llm.generate(prompts, params)) == want, f"{arch}/ngram"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mamba2", "qwen3_5", "lfm2"])
def test_speculation_on_the_triton_kernels(models: dict[str, Path], arch: str) -> None:
    """The GPU kernel set (here under Triton's interpreter) writes the per-position states from the same metadata."""
    pytest.importorskip("triton")
    path = models[arch]
    prompts = _prompts()
    want = reference(path, prompts)
    ref = {tuple(p): w for p, w in zip(prompts, want)}
    llm = with_drafter(make(path, spec=True, device="cpu", kernels="triton", max_num_batched_tokens=24),
                       ScriptedDrafter(ref, _mixed))  # fmt: skip
    assert tokens(llm.generate(prompts, GREEDY)) == want
    assert llm.engine.scheduler.stats.spec.num_accepted_tokens > 0


@pytest.mark.parametrize("arch", ["mamba2", "qwen3_5", "bamba"])
def test_checkpoint_written_while_speculating_is_exact(models: dict[str, Path], arch: str) -> None:
    """A step accepting >= 2 drafts, then one accepting none, ...; the request's decode-end checkpoint is then hit
    by a follow-up request, whose output must equal the unspeculated run's (caching off)."""
    path = models[arch]
    first = rnd(11, 21)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    (out1,) = reference(path, [first], params)
    follow = first + out1 + rnd(12, 9)
    (out2,) = reference(path, [follow], params)
    drafter = ScriptedDrafter({tuple(first): out1, tuple(follow): out2},
                              lambda request, call: PATTERN[call % len(PATTERN)])  # fmt: skip
    llm = with_drafter(make(path, spec=True), drafter)
    eng = llm.engine
    rid = eng.add_request(first, params)
    got1 = drain(eng)[rid]
    assert got1.outputs[0].token_ids == out1
    (accepted,) = drafter.accepted.values()  # one request (the engine names it by its child id)
    assert any(a >= 2 and b == 0 for a, b in zip(accepted, accepted[1:])), accepted
    stats = eng.scheduler.stats
    assert stats.checkpoints_created > 0 and stats.checkpoints_refused == 0
    (got2,) = llm.generate([follow], params)
    assert got2.num_cached_tokens > len(first), "the follow-up did not hit the decode-region checkpoint"
    assert got2.outputs[0].token_ids == out2


def test_preemption_under_speculation(models: dict[str, Path]) -> None:
    path = models["bamba"]
    probe = make(path, spec=False, caching=False)
    block_bytes = probe.engine.runner.kv_bytes_per_token * 16
    prompts = [rnd(60 + i, 50 + 7 * i) for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = reference(path, prompts, params)
    ref = {tuple(p): w for p, w in zip(prompts, want)}
    llm = with_drafter(make(path, spec=True, kv_cache_bytes=12 * block_bytes, max_model_len=160,
                            max_num_batched_tokens=64), ScriptedDrafter(ref, _mixed))  # fmt: skip
    assert tokens(llm.generate(prompts, params)) == want
    stats = llm.engine.scheduler.stats
    assert stats.preemptions > 0, "the pool was meant to force preemption"
    assert stats.spec.num_accepted_tokens > 0


@pytest.mark.parametrize("arch", ["mamba2", "bamba"])
def test_abort_while_speculating(models: dict[str, Path], arch: str) -> None:
    path = models[arch]
    a_prompt, b_prompt = rnd(70, 30), rnd(71, 19)
    want = reference(path, [a_prompt, b_prompt])
    ref = {tuple(a_prompt): want[0], tuple(b_prompt): want[1]}
    llm = with_drafter(make(path, spec=True), ScriptedDrafter(ref, _mixed))
    eng = llm.engine
    a = eng.add_request(a_prompt, GREEDY)
    b = eng.add_request(b_prompt, GREEDY)
    for _ in range(4):  # the prompts, then verify steps
        eng.step()
    assert eng.scheduler.stats.spec.num_drafts > 0
    eng.abort_request(a)
    outs = drain(eng)
    assert outs[a].outputs[0].finish_reason == "abort"
    assert outs[b].outputs[0].token_ids == want[1]
    eng.scheduler.check_integrity()
    assert tokens(llm.generate([a_prompt], GREEDY)) == [want[0]]


def test_stops_inside_accepted_drafts(models: dict[str, Path]) -> None:
    """An EOS / stop token among the accepted drafts ends the request there, as without speculation."""
    path = models["mamba2"]
    prompt = rnd(80, 26)
    (full,) = reference(path, [prompt])
    stop = full[7]
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop])
    want = reference(path, [prompt], params)
    llm = with_drafter(make(path, spec=True), ScriptedDrafter({tuple(prompt): full}, ALL))
    assert tokens(llm.generate([prompt], params)) == want
    assert want[0][-1] == stop


def test_stop_string_inside_accepted_drafts(models: dict[str, Path]) -> None:
    """A stop string completed by an accepted draft ends the text and the tokens where the plain run ends them."""
    path = models["mamba2"]
    prompt = rnd(81, 26)
    base = make(path, spec=False, caching=False)
    (full,) = base.generate([prompt], GREEDY)
    text = full.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    (want,) = base.generate([prompt], params)
    assert want.outputs[0].finish_reason == "stop" and len(want.outputs[0].token_ids) < 24
    llm = with_drafter(make(path, spec=True), ScriptedDrafter({tuple(prompt): full.outputs[0].token_ids}, ALL))
    (got,) = llm.generate([prompt], params)
    assert (got.outputs[0].token_ids, got.outputs[0].text) == (want.outputs[0].token_ids, want.outputs[0].text)
    assert got.outputs[0].finish_reason == "stop"


def test_ineligible_requests_decode_plainly(models: dict[str, Path]) -> None:
    """Requests that report logprobs get no drafts, greedy or sampled (sampled and penalized requests do:
    tests/engine/test_speculative_sampled.py)."""
    path = models["mamba2"]
    prompt = rnd(90, 20)
    llm = make(path, spec=True)
    drafter = ScriptedDrafter({tuple(prompt): []}, ALL)
    with_drafter(llm, drafter)
    for params in (SamplingParams(temperature=0.8, max_tokens=5, seed=1, logprobs=2),
                   SamplingParams(temperature=0.0, max_tokens=5, logprobs=0)):  # fmt: skip
        llm.generate([prompt], params)
    assert not drafter.calls and llm.engine.scheduler.stats.spec.num_drafts == 0


def test_metrics_snapshot_reports_acceptance(models: dict[str, Path]) -> None:
    path = models["mamba"]
    prompts = _prompts()[:2]
    want = reference(path, prompts)
    llm = with_drafter(make(path, spec=True), ScriptedDrafter({tuple(p): w for p, w in zip(prompts, want)}, ALL))
    llm.generate(prompts, GREEDY)
    snap = llm.engine.metrics_snapshot()
    assert snap.spec.num_drafts > 0 and snap.spec.num_accepted_tokens == snap.spec.num_draft_tokens
    assert snap.spec.accepted_per_position[0] == snap.spec.num_drafts
    assert snap.spec.mean_acceptance_length > 2.0


def test_bad_speculative_config_is_a_value_error(models: dict[str, Path]) -> None:
    for bad in ("{oops", {"method": "eagle"}, {"method": "ngram", "num_speculative_tokens": 0}):
        with pytest.raises(ValueError, match="speculative"):
            LLM(str(models["mamba2"]), speculative_config=bad)  # type: ignore[arg-type]


def test_memory_plan_names_the_scratch_slots(models: dict[str, Path]) -> None:
    runner = make(models["mamba2"], spec=True, max_num_seqs=4).engine.runner
    assert runner.num_scratch_slots == K * 4
    assert runner.caches.num_state_slots == runner.pools.num_state_slots + K * 4
    assert f"{K * 4} scratch slots for speculation" in runner.memory_plan().describe()


def test_the_step_cap_is_the_verify_graph_the_backend_captured(models: dict[str, Path]) -> None:
    """The scheduler caps a step's drafts at the CPU verify graph's size only for a model whose verify steps take
    the graph (Mamba2, Qwen3.5's GDN hybrid); a KDA hybrid's run the module path, where no step size costs a jump:
    no cap."""
    for arch, want in (("mamba2", MAX_VERIFY_TOKENS), ("qwen3_5", MAX_VERIFY_TOKENS), ("kimi_linear", None)):
        engine = make(models[arch], spec=True).engine
        assert isinstance(engine.runner.backend, CpuBackend), arch
        assert engine.runner.backend.max_verify_tokens(engine.runner.model, engine.runner.caches) == want, arch
        assert engine.scheduler.speculator is not None and engine.scheduler.speculator.max_step_tokens == want, arch


def test_a_steps_drafts_fit_the_backends_verify_step(models: dict[str, Path]) -> None:
    """The scheduler keeps a step's rows and drafts within the backend's fast verify step (the CPU verify graph's
    16 tokens): 8 rows whose drafts are always right verify at most 16 tokens a step, with the plain outputs."""
    path = models["mamba2"]
    prompts = _prompts() * 2
    want = reference(path, prompts)
    llm = with_drafter(make(path, spec=True), ScriptedDrafter({tuple(p): w for p, w in zip(prompts, want)}, ALL))
    sched = llm.engine.scheduler
    assert sched.speculator is not None
    limit = sched.speculator.max_step_tokens
    assert limit == MAX_VERIFY_TOKENS  # Mamba2's verify steps replay the CPU verify graph
    widest: list[int] = []
    schedule = sched.schedule

    def recording() -> SchedulerOutput:
        out = schedule()
        decodes = all(len(sr.token_ids) - sr.num_draft_tokens == 1 for sr in out.scheduled)
        if decodes and any(sr.num_draft_tokens for sr in out.scheduled):  # what a verify graph would take
            widest.append(sum(len(sr.token_ids) for sr in out.scheduled))
        return out

    sched.schedule = recording  # type: ignore[method-assign]
    assert tokens(llm.generate(prompts, GREEDY)) == want
    assert widest and (limit is None or max(widest) <= limit)
