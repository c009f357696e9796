"""The output head's own precision under a quantization (model/head_format.py): int8 under int4 by default, tied or
untied, quantized as loaded (untied) or prepared (tied) with no full-precision copy kept; its logits against the
int8 reference, the decode graph against the module path, caching on against off, the memory figures counting
it at its format, and bad values refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from recap import cli
from recap.backends import TorchBackend, prepare
from recap.backends.decode_graph import DecodeGraph
from recap.engine.config import EngineConfig
from recap.kernels.linear_rows import linear_rows_available
from recap.launch.engine_args import engine_config
from recap.model.footprint import (
    QUANTIZED_BYTES_PER_WEIGHT,
    SCALE_BYTES_PER_ROW,
    held_weight_bytes,
    serving_weight_bytes_lower_bound,
)
from recap.model.head_format import head_backend
from recap.model.hf_config import read_hf_config, translate_config
from recap.model.layers.int4_linear import Int4Linear
from recap.model.layers.linear import Int8Linear, Linear
from recap.model.loader import build_model, load_model
from recap.model.quant import int8_available, int8_linear_ref, quantize_int8
from recap.runner.memory import weight_format
from tests.backends.test_decode_graph import _decode_both
from tests.engine.test_equivalence import assert_same, make_llm
from tests.engine.workloads import SCRIPTS

needs_native = pytest.mark.skipif(not linear_rows_available(), reason="no C compiler for the native kernels")


@pytest.fixture(scope="module")
def mamba2(tmp_path_factory: pytest.TempPathFactory) -> Callable[[bool], Path]:
    """tied -> a tiny Mamba2 checkpoint with its head tied to the embedding or its own lm_head."""
    from recap.model.testing import make_tiny_checkpoint

    return lambda tied: make_tiny_checkpoint("mamba2", tmp_path_factory.mktemp(f"tied{tied}"),
                                             tie_word_embeddings=tied)  # fmt: skip


def test_the_rule_and_bad_values() -> None:
    assert head_backend("int4") == head_backend("int4", "int8") == "int8"
    assert head_backend("int4", "same") == "int4" and head_backend("int8") == "int8"
    assert head_backend(None) is None and head_backend(None, "same") is None
    with pytest.raises(ValueError, match="head_quantization"):
        head_backend("int4", "int2")
    with pytest.raises(ValueError, match="not quantized"):
        head_backend(None, "int8")
    with pytest.raises(ValueError, match="head_quantization"):
        EngineConfig(quantization="int4", head_quantization="fp16")
    with pytest.raises(ValueError, match="linear backend"):
        TorchBackend("int4", head_backend="int3")
    parser = cli.build_parser()
    args = ["serve", "m", "-q", "int4", "--head-quantization"]
    assert engine_config(parser.parse_args(args + ["same"])).head_quantization == "same"
    assert engine_config(parser.parse_args(args[:-1])).head_quantization == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(args + ["int4"])


@pytest.mark.parametrize("tied", [True, False])
def test_load_model_refuses_bad_values(tied: bool, mamba2: Callable[[bool], Path]) -> None:
    with pytest.raises(ValueError, match="head_quantization"):
        load_model(mamba2(tied), quantization="int4", head_quantization="q6_k")
    with pytest.raises(ValueError, match="not quantized"):
        load_model(mamba2(tied), head_quantization="int8")


@needs_native
@pytest.mark.skipif(not int8_available(), reason="the int8 reference's weight needs fbgemm")
@pytest.mark.parametrize("tied", [True, False])
def test_int8_head_under_int4_matches_the_int8_reference(tied: bool, mamba2: Callable[[bool], Path]) -> None:
    """The head is int8 (every other linear int4), released as loaded where untied (no fp32 copy); its output
    equals the int8 reference over the fp32 weight quantized per channel, bit for bit; "same" keeps it int4."""
    path = mamba2(tied)
    lm = load_model(path, quantization="int4")
    assert lm.head_backend == "int8" and lm.linear_backend == "int4"
    if not tied:
        assert isinstance(lm.model.head().impl, Int8Linear) and lm.model.head().released  # as loaded
    prepare(lm)
    head = lm.model.head()
    others = [m for m in lm.model.modules() if isinstance(m, Linear) and m is not head and not m.reads_weight]
    assert isinstance(head.impl, Int8Linear) and head.released  # tied: its reference to the table dropped too
    assert others and all(isinstance(m.impl, Int4Linear) for m in others)
    weight = load_model(path, linear_backend="torch").model.head().weight.detach().clone()
    x = torch.randn(5, lm.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        assert torch.equal(head(x), int8_linear_ref(x, quantize_int8(weight, None)))
        same = load_model(path, quantization="int4", head_quantization="same")
        prepare(same)
        assert same.head_backend == "int4" and isinstance(same.model.head().impl, Int4Linear)
        exact = x @ weight.T
        err8 = (head(x) - exact).norm() / exact.norm()
        err4 = (same.model.head()(x) - exact).norm() / exact.norm()
    assert 0 < err8 < err4 / 3, (err8, err4)  # 8 bits: several times closer than 4


@needs_native
@pytest.mark.parametrize("tied", [True, False])
def test_decode_graph_replays_the_module_path_with_the_int8_head(
    tied: bool, mamba2: Callable[[bool], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The captured decode step and the module path give the same hidden states and, through the int8 head, the
    same logits and tokens (Mamba2: bit for bit); the eager backend picks the same tokens."""
    lm = load_model(mamba2(tied), quantization="int4")
    backend = prepare(lm)
    model = lm.model
    replays: list[int] = []
    real = DecodeGraph.run
    monkeypatch.setattr(DecodeGraph, "run", lambda self, b, c: (replays.append(1), real(self, b, c))[1])
    prompts = [list(range(3, 24)), list(range(30, 48))]
    graph_h, module_h, _, _ = _decode_both(model, backend, prompts, 9)
    assert len(replays) == 9
    for a, b in zip(graph_h, module_h):
        assert torch.equal(a, b) and torch.equal(model.compute_logits(a), model.compute_logits(b))
    from recap.model.testing import greedy_generate

    eager = load_model(mamba2(tied), quantization="int4", native_decode=False)
    eager_backend = prepare(eager)
    assert type(eager_backend) is TorchBackend and isinstance(eager.model.head().impl, Int8Linear)
    assert greedy_generate(eager.model, prompts[0], 6, backend=eager_backend) == greedy_generate(
        model, prompts[0], 6, backend=backend)  # fmt: skip


@pytest.mark.parametrize("tied", [True, False])
def test_the_memory_figures_count_the_head_at_its_format(tied: bool, mamba2: Callable[[bool], Path]) -> None:
    """The pre-load bound counts an untied head at int8 rather than int4: exactly vocab x hidden x (1 - 4.5 / 8)
    bytes and the int8 row scales more; a tied int8 head's tiles are the embedding's int8 rows, so the int4 copy
    beside them goes instead (one matrix); the measured bytes of the prepared models differ by at least that; the
    plan's format line names the head."""
    path = mamba2(tied)
    config = translate_config(read_hf_config(path))
    meta = build_model(config, torch.float32, "meta")
    v, d = config.vocab_size, config.hidden_size
    int4_copy = int(v * d * QUANTIZED_BYTES_PER_WEIGHT["int4"]) + v * SCALE_BYTES_PER_ROW["int4"]
    extra = int(v * d * QUANTIZED_BYTES_PER_WEIGHT["int8"]) + v * SCALE_BYTES_PER_ROW["int8"] - int4_copy
    if tied:
        extra = -int4_copy
    bound8 = serving_weight_bytes_lower_bound(meta, "int4", "int8")
    assert bound8 - serving_weight_bytes_lower_bound(meta, "int4", "int4") == extra
    assert serving_weight_bytes_lower_bound(meta, "int4") == serving_weight_bytes_lower_bound(meta, "int4", "int4")
    held = {}
    for head in ("auto", "same"):
        lm = load_model(path, quantization="int4", head_quantization=head)
        prepare(lm)
        held[head] = held_weight_bytes(lm.model).total
    assert bound8 <= held["auto"]
    if tied:  # one int8 matrix (whole tiles, an int32 row sum each) against the int8 table and an int4 copy
        padding = -(-v // 8) * 8 * (-(-d // 64) * 64) - v * d
        assert held["same"] - held["auto"] >= int4_copy - padding - 4 * v
    else:
        assert held["auto"] - held["same"] >= extra
    assert weight_format(torch.float32, "int4", "int8") == "float32 + int4 linear weights, int8 head"
    assert weight_format(torch.float32, "int8", "int8") == "float32 + int8 linear weights"


@pytest.mark.parametrize("tied", [True, False])
def test_caching_on_equals_off_with_the_int8_head(tied: bool, mamba2: Callable[[bool], Path]) -> None:
    """The engine with int4 linears and the int8 head: a cached prefix gives what recomputing it gives (the
    head reads the same hidden states either way), and the head served is int8."""
    path = mamba2(tied)
    kw = {"quantization": "int4", "head_quantization": "int8"}
    off = make_llm(path, caching=False, **kw)
    on = make_llm(path, caching=True, policy="recap", **kw)
    head = on.engine.runner.model.head()
    assert isinstance(head.impl, Int8Linear)
    assert "int8 head" in on.engine.runner.memory_plan().weight_format
    for script in ("multiturn", "sysprompt_marked"):
        got, want = SCRIPTS[script](on), SCRIPTS[script](off)
        assert_same(got, want, f"tied={tied}/{script}")
        assert any(o.num_cached_tokens > 0 for o in got)
