"""DESIGN invariant 1 within each weight precision: caching on equals caching off with bf16 weights and with
int8 or int4 linear weights (their activation rows are quantized independently, so batching cannot change a row's
result)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_equivalence import assert_same, make_llm
from tests.engine.workloads import SCRIPTS

PRECISIONS = {"bf16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"}}


@pytest.mark.parametrize("arch", ["mamba2", "bamba"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_caching_on_equals_off_in_reduced_precision(tiny_models: dict[str, Path], arch: str, precision: str) -> None:
    path, kw = tiny_models[arch], PRECISIONS[precision]
    for script in ("multiturn", "sysprompt_marked", "concurrent_mix"):
        want = SCRIPTS[script](make_llm(path, caching=False, **kw))
        got = SCRIPTS[script](make_llm(path, caching=True, policy="recap", **kw))
        assert_same(got, want, f"{arch}/{precision}/{script}")
        assert any(o.num_cached_tokens > 0 for o in got) or script == "concurrent_mix"


def test_llm_rejects_unknown_quantization(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="quantization"):
        make_llm(tiny_models["mamba2"], caching=False, quantization="fp4")
