"""The CUDA backend's decode graphs with the output head and argmax inside (backends/cuda.py forward_greedy), on a
CPU with the reference capture (see tests/engine/test_cuda_graph_backend.py for how that stands in for a GPU).

A step whose sampled rows all take the argmax of their raw logits replays a graph that yields the token ids; any
other step (a sampled row, a row asking logprobs) replays the graph without the head and samples as before. Both
must give the eager torch kernels' tokens (and logprobs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from recap import SamplingParams
from tests.engine.test_cuda_graph_backend import graph_llm, make_llm
from tests.engine.test_equivalence import assert_same
from tests.engine.workloads import rnd

pytest.importorskip("triton")

GREEDY = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)


def count_sampler_calls(llm: Any) -> list[int]:
    """Wraps the runner's sampler; the list holds how many rows each call sampled."""
    runner, calls = llm.engine.runner, []
    inner = runner.sampler

    def counted(logits: Any, rows: list) -> Any:
        calls.append(len(rows))
        return inner(logits, rows)

    runner.sampler = counted
    return calls


def test_greedy_decode_steps_take_the_head_in_the_graph(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["nemotron_h"]
    prompts = [rnd(21, 29), rnd(22, 41), rnd(23, 20)]
    want = make_llm(path, "torch", caching=False).generate(prompts, GREEDY)
    llm, backend = graph_llm(path)
    calls = count_sampler_calls(llm)
    got = llm.generate(prompts, GREEDY)
    assert [list(o.outputs[0].token_ids) for o in got] == [list(o.outputs[0].token_ids) for o in want]
    assert calls == [], "no step brought logits to the sampler"
    assert backend._graphs and all(g is not None and g.takes_head for g in backend._graphs.values())
    assert {head for _, head in backend._graphs} == {True}
    assert {g.rows for g in backend._graphs.values() if g is not None} >= {4}


def test_rows_that_need_logits_keep_the_sampler(tiny_models: dict[str, Path]) -> None:
    """A greedy row decoding beside a seeded sampled row and a greedy row with logprobs: every step samples from the
    logits (the graphs without the head), with the eager run's tokens and logprobs; once only plain greedy rows are
    left, the steps take the head graphs."""
    path = tiny_models["nemotron_h"]
    prompts = [rnd(31, 25), rnd(32, 33), rnd(33, 18)]
    params = [SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True)]  # fmt: skip
    want = make_llm(path, "torch", caching=False).generate(prompts, params)
    llm, backend = graph_llm(path)
    calls = count_sampler_calls(llm)
    got = llm.generate(prompts, params)
    assert [list(o.outputs[0].token_ids) for o in got] == [list(o.outputs[0].token_ids) for o in want]
    assert_same(got[2:], want[2:], "mixed/graphs")  # the logprobs row's, within tolerance
    assert calls[0] == 3 and all(n == 3 for n in calls[:4]), "the mixed steps sampled every row from the logits"
    assert len(calls) == 4, "the last 5 steps (the greedy row alone) took the head and argmax in the graph"
    heads = {head for (_, head), g in backend._graphs.items() if g is not None}
    assert heads == {False, True}


def test_async_scheduling_keeps_the_graphs_ids_for_the_next_step(tiny_models: dict[str, Path]) -> None:
    """Under async scheduling the head graphs' ids (three rows of a 4-row graph) stay tensors: each step's
    placeholders are filled from the last step's, and its output resolves a step late, with the eager tokens."""
    path = tiny_models["nemotron_h"]
    prompts = [rnd(21, 29), rnd(22, 41), rnd(23, 20)]
    want = make_llm(path, "torch", caching=False).generate(prompts, GREEDY)
    llm, backend = graph_llm(path, async_scheduling=True)
    calls = count_sampler_calls(llm)
    got = llm.generate(prompts, GREEDY)
    assert [list(o.outputs[0].token_ids) for o in got] == [list(o.outputs[0].token_ids) for o in want]
    assert calls == [] and {head for _, head in backend._graphs} == {True}
    assert llm.engine._pending is None and llm.engine.scheduler.view.in_flight is None
