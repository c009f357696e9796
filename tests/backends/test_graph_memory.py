"""The decode graphs' memory as the backends estimate it before capture (backends/graph_memory.py) against what
capturing allocates: the CPU decode graphs' activation buffers (tolerance: none, the estimate mirrors the buffers
the capture makes byte for byte) and the CUDA graphs' static inputs under the reference capture; and the plan's
line for them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from recap.backends import CpuBackend, TorchBackend, prepare
from recap.backends.cuda import CudaBackend, shape_template, static_input_model
from recap.backends.cuda_graph import CapturedStep, rerun_capture, static_input_bytes
from recap.backends.decode_graph import MAX_ROWS, DecodeGraph, capture
from recap.backends.graph_memory import StepLimits, decode_graph_bytes, decode_graph_row_floats
from recap.kernels import decode_ops
from recap.kernels.kernel_set import TORCH_KERNELS
from recap.kernels.linear_rows import linear_rows_available
from recap.model.cache import ModelCaches
from recap.model.loader import load_model
from recap.model.models.base import CausalLM
from recap.runner.host_memory import MemoryLimit, MemoryPlanError
from recap.runner.memory import MemoryPlan, PoolSizes

native = pytest.mark.skipif(
    not (linear_rows_available() and decode_ops.decode_ops_available()), reason="no C compiler for native kernels"
)


def _held_bytes(graph: DecodeGraph) -> int:
    """The bytes of the graph's buffers (a view shares its storage: counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in graph._keep}
    return sum(storages.values())


def _cpu_model(path: Path) -> tuple[CausalLM, CpuBackend, ModelCaches]:
    lm = load_model(path)
    backend = prepare(lm)
    assert isinstance(backend, CpuBackend)
    return lm.model, backend, ModelCaches.allocate(lm.model.config, 9, 16, 10, lm.model.dtype, num_window_blocks=9)


@native
# Mamba2 alone; short convs + attention; + MLPs; GDN + gated attention
@pytest.mark.parametrize("arch", ["mamba2", "lfm2", "bamba", "qwen3_5"])
def test_the_cpu_estimate_is_what_each_captured_graph_holds(tiny_checkpoint: Callable[[str], Path], arch: str) -> None:
    model, backend, caches = _cpu_model(tiny_checkpoint(arch))
    graphs = capture(model, caches, print)
    assert all(g is not None for g in graphs.values()), f"{arch}: a row count was not captured"
    for rows, graph in graphs.items():
        assert graph is not None
        assert _held_bytes(graph) == decode_graph_bytes(model.config, True, rows), f"{arch}, {rows} rows"
    limits = StepLimits(max_num_seqs=4, max_model_len=256, block_size=16)
    assert backend.graph_bytes(model, limits) == sum(_held_bytes(g) for g in graphs.values() if g is not None)
    assert len(graphs) == MAX_ROWS


@native
def test_a_model_the_graphs_do_not_capture_is_estimated_at_nothing(tiny_checkpoint: Callable[[str], Path]) -> None:
    model, backend, caches = _cpu_model(tiny_checkpoint("qwen3_next"))  # fused GDN projections: not captured
    assert decode_graph_row_floats(model.config, True) is None
    assert all(g is None for g in capture(model, caches, lambda _: None).values())
    assert backend.graph_bytes(model, StepLimits(4, 256, 16)) == 0


def test_bf16_activations_and_the_torch_backend_hold_no_graph(tiny_checkpoint: Callable[[str], Path]) -> None:
    config = load_model(tiny_checkpoint("bamba"), native_decode=False).config
    assert decode_graph_row_floats(config, True) and decode_graph_bytes(config, False, 8) == 0
    model = load_model(tiny_checkpoint("bamba"), native_decode=False).model
    assert TorchBackend().graph_bytes(model, StepLimits(4, 256, 16)) == 0


@pytest.mark.parametrize("arch", ["bamba", "mamba2"])  # attention and SSM metadata; SSM metadata alone
def test_the_cuda_estimate_of_static_inputs_is_what_the_reference_capture_holds(
    tiny_checkpoint: Callable[[str], Path], arch: str
) -> None:
    triton = pytest.importorskip("recap.kernels.triton.kernel_set").TRITON_KERNELS  # what the reference capture runs
    model = load_model(tiny_checkpoint(arch), native_decode=False).model
    TorchBackend(kernels=triton).prepare(model)
    caches = ModelCaches.allocate(model.config, 9, 16, 10, model.dtype, num_window_blocks=9)
    inputs = static_input_model(model.config, 16, triton)
    chunk = model.config.ssm_chunk_size
    attn = model.config.has_attention
    for rows, width in [(1, 8), (3, 16), (8, 32)]:
        width = width if attn else 1
        template = shape_template(rows, width, 16 if attn else 1, chunk, attn, "cpu", triton)
        step = CapturedStep(model, caches, template, rerun_capture)
        assert step.static_bytes == static_input_bytes(template) == inputs(rows, width), f"{arch} {rows}x{width}"
    for rows, width in [(64, 256), (256, 2048)]:  # large shapes: the templates alone, no capture
        width = width if attn else 1
        template = shape_template(rows, width, 16 if attn else 1, chunk, attn, "cpu", triton)
        assert static_input_bytes(template) == inputs(rows, width), f"{arch} {rows}x{width}"


def test_the_cuda_backend_counts_its_largest_shapes_and_pool(tiny_checkpoint: Callable[[str], Path]) -> None:
    model = load_model(tiny_checkpoint("bamba"), native_decode=False).model
    backend = CudaBackend(kernels=TORCH_KERNELS, capture=rerun_capture)
    small, large = (backend.graph_bytes(model, StepLimits(n, length, 16)) for n, length in ((1, 128), (256, 32768)))
    d = model.config.hidden_size
    assert small > 2 * (d * 4 + static_input_model(model.config, 16, TORCH_KERNELS)(1, 8))  # 2 graphs, the pool
    assert large > 64 * 256 * d * 4  # MAX_GRAPHS graphs of 256 rows' hidden states at least


def test_the_plan_counts_the_graphs_and_refuses_on_them() -> None:
    pools = PoolSizes(num_kv_blocks=5, num_state_slots=4, kv_bytes=4 << 20, state_bytes=4 << 20)
    limit = MemoryLimit(20 << 20, "test")
    plan = MemoryPlan(8 << 20, 0, pools, 16, 1 << 20, limit, graph_bytes=2 << 20)
    assert plan.total_bytes == 19 << 20 and plan.fits
    assert "; decode graphs 2.0 MiB (2,097,152 B)" in plan.describe()
    over = MemoryPlan(8 << 20, 0, pools, 16, 1 << 20, limit, graph_bytes=3 << 20 | 1)
    with pytest.raises(MemoryPlanError, match=r"decode graphs 0\.00 GiB"):
        over.check()
