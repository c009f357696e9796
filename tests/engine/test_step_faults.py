"""A step whose forward pass raises (core/step_faults.py through the engine): the request that poisons its batches
ends with an error naming the cause, the requests batched with it finish with the tokens of a run without it
(cached = uncached, with chunked prefill and a failure mid-prompt, under async scheduling too), pools end idle;
transient faults (mid-prefill, mid-decode, with speculation) cost a recompute and no token; a runner that fails
every step stops the engine as before."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from recap import LLM
from recap.engine.llm_engine import MAX_FAILED_STEPS, LLMEngine
from tests.engine.conftest import tiny_model_dir
from tests.engine.workloads import GREEDY, rnd

POISON = 2  # rnd draws ids from [3, vocab): only the poisoned prompt holds it


def poison_backend(engine: LLMEngine, always: bool = False, calls: frozenset[int] = frozenset()) -> list[int]:
    """The runner's backend raises on any batch that holds POISON (`always`: on every batch; `calls`: on those
    forward calls, counted from 0, whatever they hold); returns a list that counts the failures."""
    backend = engine.runner.backend
    failures: list[int] = []
    count = [0]
    for name in ("forward", "forward_greedy"):
        real = getattr(backend, name)

        def wrapped(model, batch, caches, _real=real):  # type: ignore[no-untyped-def]
            count[0] += 1
            if always or count[0] - 1 in calls or bool((batch.input_ids == POISON).any()):
                failures.append(1)
                raise RuntimeError("poisoned batch")
            return _real(model, batch, caches)

        setattr(backend, name, wrapped)
    return failures


@pytest.fixture(scope="module")
def bamba(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("faults"), "bamba")


def make(path: Path, caching: bool = True, **kw: object) -> LLM:
    torch.set_num_threads(1)
    return LLM(str(path), enable_prefix_caching=caching, checkpoint_policy="recap", block_size=16, seed=0,
               max_num_seqs=4, max_num_batched_tokens=48, check_integrity=True, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_poisoned_prompt_fails_alone_and_the_others_are_untouched(bamba: Path, async_scheduling: bool) -> None:
    """Under async scheduling the step in flight is applied before the failed one is undone."""
    base = rnd(1, 40)
    prompts = [base + rnd(10 + i, 9 + i) for i in range(4)]
    prompts[2] = prompts[2][:45] + [POISON] + prompts[2][45:]  # in its second chunk: the first one succeeds
    reference = make(bamba, caching=False).generate([p for i, p in enumerate(prompts) if i != 2], GREEDY)
    llm = make(bamba, async_scheduling=async_scheduling)
    failures = poison_backend(llm.engine)
    outs = llm.generate(prompts, GREEDY)
    bad = outs[2]
    assert bad.finished and bad.outputs[0].finish_reason == "error" and bad.internal_error
    assert bad.error is not None and "poisoned batch" in bad.error
    for got, want in zip(outs[:2] + outs[3:], reference):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids and got.outputs[0].finish_reason == "length"
    stats = llm.engine.scheduler.stats
    assert stats.failed_steps == len(failures) >= 2 and stats.step_suspects >= 1
    snap = llm.engine.metrics_snapshot()
    assert snap.failed_steps == stats.failed_steps and snap.finished_by_reason.get("error") == 1
    # the engine goes on: the same prompts again hit the cache and give the same tokens
    again = llm.generate([prompts[0], prompts[1]], GREEDY)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in reference[:2]]
    assert again[0].num_cached_tokens > 0
    llm.engine.scheduler.check_integrity()
    assert llm.engine.scheduler.num_running == llm.engine.scheduler.num_waiting == 0


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.mark.parametrize("spec", [False, True])
@pytest.mark.parametrize("seeded", [False, True])
def test_transient_faults_cost_a_recompute_not_an_answer(bamba: Path, spec: bool, seeded: bool) -> None:
    """Steps that fail once, mid-prefill and mid-decode (with drafts being verified under speculation): every
    request is retried and finishes with the tokens of a run without faults, sampled with a seed too (each output
    position draws from its own generator, so the retry draws what the first try would have)."""
    base = rnd(5, 24)
    prompts = [base + base[: 8 + i] + rnd(30 + i, 5) for i in range(3)]  # repeats: the drafter finds drafts
    params = replace(GREEDY, max_tokens=12)
    if seeded:
        params = replace(params, temperature=1.0, seed=77)
    kw = {"speculative_config": SPEC} if spec else {}
    reference = make(bamba, caching=False, **kw).generate(prompts, params)
    llm = make(bamba, **kw)
    failures = poison_backend(llm.engine, calls=frozenset({1, 14}))  # apart: no suspect left at the second
    outs = llm.generate(prompts, params)
    assert len(failures) == 2 and llm.engine.scheduler.stats.failed_steps == 2
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
    assert all(o.outputs[0].finish_reason == "length" and not o.internal_error for o in outs)
    llm.engine.scheduler.check_integrity()


def fail_tier_steps(llm: LLM, where: str, times: int) -> list[int]:
    """The first `times` steps that carry tier orders raise: `before` the runner runs them, or `after` (saves
    written, loads started, reports collected). Returns a list that counts the failures."""
    runner, failures = llm.engine.runner, []
    target = runner.tier if where == "before" else runner
    name = "step" if where == "before" else "_run"
    real = getattr(target, name)

    def wrapped(out, *args):  # type: ignore[no-untyped-def]
        if (out.tier_saves or out.tier_loads) and len(failures) < times:
            if where == "after":
                real(out, *args)
            failures.append(1)
            raise RuntimeError("poisoned batch")
        return real(out, *args)

    setattr(target, name, wrapped)
    return failures


@pytest.mark.parametrize("where", ["before", "after"])
def test_faults_with_host_and_disk_tiers_lose_no_entry_and_no_token(tmp_path: Path, where: str) -> None:
    """Conversations whose history lives in the host and disk tiers, with the steps that carry tier saves and
    loads failing before or after the runner ran those orders: the answers equal the uncached ones, every tier
    entry ends written, and the disk holds exactly the files its index knows."""
    from tests.engine.test_disk_tier import conversations, reference
    from tests.engine.test_disk_tier import make as make_tiered

    model = tiny_model_dir(tmp_path, "bamba")
    probe = make_tiered(model, None, caching=False).engine.runner
    sizes = probe.kv_bytes_per_token * 16, probe.state_bytes_per_slot
    llm = make_tiered(model, tmp_path / "disk", sizes=sizes, cache_host_bytes=3 * sizes[0] + sizes[1])
    failures = fail_tier_steps(llm, where, times=6)
    got = conversations(llm)
    assert len(failures) == 6 and llm.engine.scheduler.stats.failed_steps == 6
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in reference(model)]
    tiers, store = llm.engine.scheduler.tiers, llm.engine.runner.tier
    assert tiers is not None and store is not None and store.disk is not None
    assert sum(t.counters.promotions for t in tiers.indexes) > 0
    while store.disk.busy:
        store.disk.wait(0.05)
    llm.engine.step()  # an idle step collects the last reports
    for index in tiers.indexes:
        index.check()
        assert all(index.is_ready(k) for k in index.iter_keys()), f"{index.name}: an entry never reported written"
    files = {p.name for p in store.disk.dir.iterdir()}
    assert len(files) == tiers.tier("disk").num_entries, "files the disk index does not know of, or the reverse"
    llm.close()


def test_a_runner_that_fails_every_step_stops_the_engine(bamba: Path) -> None:
    """Every step fails (a lost device): each request fails on its own retry, and once MAX_FAILED_STEPS steps in a
    row have failed the error is raised: the engine stops (the server's /health then says so)."""
    llm = make(bamba)
    failures = poison_backend(llm.engine, always=True)
    errored = 0
    with pytest.raises(RuntimeError, match="poisoned batch"):
        for i in range(MAX_FAILED_STEPS):
            out = llm.generate([rnd(3 + i, 20)], GREEDY)[0]
            assert out.outputs[0].finish_reason == "error" and out.internal_error
            errored += 1
    assert len(failures) == MAX_FAILED_STEPS + 1 and errored == MAX_FAILED_STEPS // 2
