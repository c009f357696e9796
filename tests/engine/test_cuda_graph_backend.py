"""The CUDA backend's captured decode steps (recap/backends/cuda.py, cuda_graph.py), on a CPU.

Without a GPU the steps are "captured" by the reference capture (cuda_graph.rerun_capture): each replay runs
the model again over the graph's static inputs, the batch captured over padding rows only. Its host lists are
therefore the padding template's, not the step's, exactly as a CUDA graph freezes them: the tokens come out
right only if the Triton kernels (under Triton's interpreter here) decide every row from the device tensors the
step loads. The tests compare the engine on that backend with the torch kernels' eager run: the same greedy
tokens and logprobs, checkpoints written inside graph steps (decode tokens that complete a block) hit by a later
request with the same tokens, padding rows that leave every other slot bit for bit as it was, and no read of a
tensor's value on the host while a step is replayed. The reference capture's warm-up fails with HostReadError
at an op that reads the host (cuda_graph.HostReads), as a GPU's warm-up does under sync debug mode "error": the
MoE hybrids capture because their routed experts run the fused kernel (kernels/triton/fused_moe.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recap import LLM, SamplingParams
from recap.backends.cuda import GRAPH_ROWS, CudaBackend, table_width
from recap.backends.cuda_graph import HostReadError, HostReads, Step, rerun_capture
from recap.kernels.metadata import SeqSpec
from tests.engine.conftest import tiny_model_dir
from tests.engine.test_equivalence import assert_same
from tests.engine.workloads import rnd

pytest.importorskip("triton")

PARAMS = SamplingParams(temperature=0.0, max_tokens=7, logprobs=0, ignore_eos=True)


def make_llm(path: Path, kernels: str, caching: bool, **kw: object) -> LLM:
    return LLM(str(path), device="cpu", kernels=kernels, enable_prefix_caching=caching, block_size=16,  # type: ignore[arg-type]
               max_model_len=256, check_integrity=True, seed=0, checkpoint_policy="all", **kw)  # fmt: skip


def graph_llm(path: Path, **kw: object) -> tuple[LLM, CudaBackend]:
    """The engine on the Triton kernels with the CUDA backend's decode graphs (reference capture); `kw`: LLM's."""
    llm = make_llm(path, "triton", caching=True, **kw)
    runner = llm.engine.runner
    backend = CudaBackend(kernels=runner.backend.kernels, capture=rerun_capture)
    backend.prepare(runner.model)
    runner.backend = backend
    return llm, backend


def script(llm: LLM) -> list:
    """Three rows decoding together (a 4-row graph with one padding row), two of them crossing a block boundary
    mid-decode; then a request that extends the first one's prompt and output: it hits the checkpoint that a
    decode step of a graph wrote."""
    prompts = [rnd(1, 29), rnd(2, 41), rnd(3, 20)]
    first = llm.generate(prompts, PARAMS)
    follow = prompts[0] + list(first[0].outputs[0].token_ids) + rnd(4, 9)
    return first + llm.generate([follow], PARAMS)


# 35 s each under the interpreter; lfm2: the short-conv hybrid without sliding windows (LFM3 has them: no graphs);
# MoE hybrids (the fused experts; 25-65 s each): nemotron_h (per-expert modules, non-gated relu2, grouped sigmoid
# routing), granite_hybrid (stacked SwiGLU experts), qwen3_5_moe (gated shared expert), kimi_linear, bailing (Ling)
_SLOW = [pytest.param(a, marks=pytest.mark.slow)
         for a in ("qwen3_5", "lfm2", "granite_hybrid", "qwen3_5_moe", "kimi_linear", "bailing_hybrid")]


@pytest.mark.parametrize("arch", ["nemotron_h", *_SLOW])
def test_graph_decode_equals_eager(tiny_models: dict[str, Path], tmp_path: Path, arch: str) -> None:
    path = tiny_models[arch] if arch in tiny_models else tiny_model_dir(tmp_path, arch)
    want = script(make_llm(path, "torch", caching=False))
    llm, backend = graph_llm(path)
    got = script(llm)
    assert_same(got, want, f"{arch}/graphs")
    assert backend._graphs and all(g is not None for g in backend._graphs.values()), "decode steps were captured"
    assert {g.rows for g in backend._graphs.values() if g is not None} >= {1, 4}
    assert got[-1].num_cached_tokens >= 32, "the follow-up hits a checkpoint written by a graph step"
    moes = [m for m in llm.engine.runner.model.modules() if hasattr(m, "set_moe_kernel")]
    assert all(m.moe_kernel is not None for m in moes), "routed experts run the fused kernel"


def test_padding_rows_leave_other_slots_alone(tiny_models: dict[str, Path]) -> None:
    """Three rows in a 4-row graph: every state slot no request holds and the padding rows' pad ids (-1) must
    leave the pools untouched, bit for bit."""
    llm, backend = graph_llm(tiny_models["nemotron_h"])
    eng, caches = llm.engine, llm.engine.runner.caches
    ids = [eng.add_request(rnd(10 + i, 18 + 5 * i), PARAMS) for i in range(3)]
    eng.step()  # the prefill
    before = [t.clone() for t in caches.state_tensors()]
    positions = caches.slot_positions.clone()
    eng.step()  # a decode step: a graph of 4 rows
    step = eng.scheduler.last_output
    assert step is not None and len(step.scheduled) == 3
    held = {s.state_slot for s in step.scheduled} | {c.slot for s in step.scheduled for c in s.checkpoints}
    assert any(g is not None and g.rows == 4 for g in backend._graphs.values())
    free = [s for s in range(before[0].shape[0]) if s not in held]
    for old, new in zip(before, caches.state_tensors()):
        assert torch.equal(old[free], new[free]), "a padding row wrote a slot no request holds"
    assert torch.equal(positions[free], caches.slot_positions[free])
    for i in ids:
        eng.abort_request(i)


def test_captured_step_reads_nothing_on_the_host(tiny_models: dict[str, Path]) -> None:
    llm, backend = graph_llm(tiny_models["qwen3_5"])
    llm.generate([rnd(5, 20)], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    step = next(g for g in backend._graphs.values() if g is not None)
    with HostReads():
        step.replay()
    for read in (lambda: torch.ones(1).item(), lambda: torch.bincount(torch.ones(3, dtype=torch.long)),
                 lambda: torch.ones(3)[torch.ones(3) > 0]):  # fmt: skip
        with pytest.raises(HostReadError, match="on the host"), HostReads():
            read()  # the mode does catch a host read
    with HostReads():
        torch.ones(3)[torch.tensor([0, 2])]  # an integer index is no host read


def test_the_reference_capture_catches_the_moe_loops_host_read(tiny_models: dict[str, Path]) -> None:
    """With the torch kernels a MoE layer runs its per-expert loop, which reads the host (bincount, then a list
    of counts): the reference capture's warm-up finds it, as a GPU's does, and graphs go off for the model (the
    Triton kernel set's fused experts capture: test_graph_decode_equals_eager[nemotron_h])."""
    path = tiny_models["nemotron_h"]
    prompts = [rnd(7, 25), rnd(8, 30)]
    want = make_llm(path, "torch", caching=False).generate(prompts, PARAMS)
    llm = make_llm(path, "torch", caching=True)
    runner = llm.engine.runner
    backend = CudaBackend(kernels=runner.backend.kernels, capture=rerun_capture)
    backend.prepare(runner.model)
    runner.backend = backend
    assert_same(llm.generate(prompts, PARAMS), want, "moe-loop/eager")
    assert backend._uncapturable and set(backend._graphs.values()) == {None}


def test_shape_rows_pads_decode_steps_only() -> None:
    b = CudaBackend(capture=rerun_capture)
    rows = [SeqSpec([5], context_len=40, block_ids=[1, 2, 3], state_slot=0), SeqSpec([6], context_len=3,
            block_ids=[4], state_slot=1), SeqSpec([7], context_len=9, block_ids=[5], state_slot=2)]  # fmt: skip
    padded = b.shape_rows(rows)
    assert len(padded) == 4 and padded[3].padding and padded[3].state_slot == -1
    assert all(len(s.block_ids) == table_width(3) == 8 for s in padded)
    assert list(padded[0].block_ids[:3]) == [1, 2, 3] and set(padded[0].block_ids[3:]) == {-1}
    prefill = [SeqSpec([1, 2], block_ids=[1], state_slot=0)]
    assert b.shape_rows(prefill) is prefill
    assert table_width(9) == 16 and table_width(0) == 8 and GRAPH_ROWS[-1] == 256


def test_a_model_that_reads_the_host_runs_eagerly_unpadded(tiny_models: dict[str, Path]) -> None:
    """A capture that finds a host read (on a GPU: the warm-up under sync debug mode "error", e.g. a MoE's expert
    loop) turns graphs off for the model: every step runs the module path, decode steps are no longer padded,
    and the tokens are the eager run's."""

    def host_read(step: Step) -> Step:
        raise HostReadError("called a synchronizing CUDA operation")

    path = tiny_models["nemotron_h"]
    want = make_llm(path, "torch", caching=False).generate([rnd(7, 25), rnd(8, 30)], PARAMS)
    llm = make_llm(path, "torch", caching=True)
    runner = llm.engine.runner
    backend = CudaBackend(kernels=runner.backend.kernels, capture=host_read)
    backend.prepare(runner.model)
    runner.backend = backend
    assert_same(llm.generate([rnd(7, 25), rnd(8, 30)], PARAMS), want, "host-read/eager")
    assert backend._uncapturable and set(backend._graphs.values()) == {None}
    rows = [SeqSpec([5], context_len=3, block_ids=[1], state_slot=0)] * 3
    assert backend.shape_rows(rows) is rows  # no padding once graphs are off
