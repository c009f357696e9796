"""A pre-quantized checkpoint through the engine: planned, loaded and served in recap's int4 (its own codes),
with caching on equal to caching off (DESIGN invariant 1) exactly on Mamba2, as for int4 quantized by recap
(with attention, test_reduced_precision says why int4 matches only to a rounding edge)."""

from __future__ import annotations

from pathlib import Path

from recap.model.layers.int4_linear import Int4Linear
from recap.model.layers.linear import Linear
from tests.engine.test_equivalence import assert_same, make_llm
from tests.engine.workloads import SCRIPTS
from tests.model.test_prequantized import GPTQ, _int4_writer, _write


def test_gptq_checkpoint_serves_as_int4(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    root, _ = _write(tiny_models["mamba2"], tmp_path, GPTQ, _int4_writer("gptq", 128, False))
    want = SCRIPTS["multiturn"](make_llm(root / "quant", caching=False))
    llm = make_llm(root / "quant", caching=True)
    model = llm.engine.runner.model
    assert all(isinstance(m.impl, Int4Linear) for m in model.modules() if isinstance(m, Linear))
    got = SCRIPTS["multiturn"](llm)
    assert_same(got, want, "mamba2/gptq/multiturn")
