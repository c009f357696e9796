"""DESIGN invariant 1 with int4 weights fitted by an importance matrix (`--quantization-imatrix`): the engine
loads, generates, and caching on equals caching off (as tests/engine/test_reduced_precision.py for plain int4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recap.model import activation_stats as AS
from recap.model.loader import load_model
from tests.engine.test_equivalence import assert_same, make_llm
from tests.engine.test_reduced_precision import _assert_same_tokens
from tests.engine.workloads import SCRIPTS


def _imatrix(path: Path, out: Path) -> Path:
    net = load_model(path, linear_backend="torch").model
    g = torch.Generator().manual_seed(3)
    chunks = [torch.randint(0, net.config.vocab_size, (64,), generator=g).tolist() for _ in range(3)]
    return AS.save(AS.collect(net, chunks), out, 64)


@pytest.mark.parametrize("quantization", ["int4", "int4_k"])
@pytest.mark.parametrize("arch", ["mamba2", "bamba"])
def test_imatrix_int4_caching_on_equals_off(tiny_models: dict[str, Path], arch: str, quantization: str,
                                            tmp_path: Path) -> None:  # fmt: skip
    path = tiny_models[arch]
    kw = {"quantization": quantization, "quantization_imatrix": str(_imatrix(path, tmp_path / "m.safetensors"))}
    for script in ("multiturn", "sysprompt_marked"):
        want = SCRIPTS[script](make_llm(path, caching=False, **kw))
        got = SCRIPTS[script](make_llm(path, caching=True, policy="recap", **kw))
        assert all(o.outputs[0].token_ids for o in want)
        if arch != "mamba2":  # attention: int4's activation codes (test_reduced_precision's docstring)
            _assert_same_tokens(got, want, f"{arch}/{quantization}/{script}", logprob_tol=2e-2)
        else:
            assert_same(got, want, f"{arch}/{quantization}/{script}")
        assert any(o.num_cached_tokens > 0 for o in got)
