"""Batch-1 decode through the native kernels (kernels/linear_rows.py) inside whole models."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import recap.model.layers.linear as linear_mod
from recap.backends import CpuBackend, TorchBackend, prepare
from recap.kernels.linear_rows import RowKernel, linear_rows_available
from recap.model.layers.linear import Linear
from recap.model.loader import load_model
from recap.model.testing import greedy_generate


@pytest.mark.parametrize(("arch", "quantization"), [("mamba2", None), ("bamba", None), ("mamba2", "int8")])
def test_decode_with_native_kernels_matches_torch_kernels(
    arch: str, quantization: str | None, tiny_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy decode (batch 1) through the native kernels gives the tokens of the model without them."""
    if not linear_rows_available():
        pytest.skip("the native kernels cannot be built here (no C compiler)")
    path = tiny_checkpoint(arch)
    eager_lm = load_model(path, quantization=quantization, native_decode=False)
    fast_lm = load_model(path, quantization=quantization)
    eager_backend, fast_backend = prepare(eager_lm), prepare(fast_lm)
    eager, fast = eager_lm.model, fast_lm.model
    calls: list[int] = []
    real = RowKernel.__call__

    def counted(self: RowKernel, x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(self, x)

    monkeypatch.setattr(RowKernel, "__call__", counted)
    panels = linear_mod.linear_panels_f32  # fp32 weights: the panels are the one layout, one row included

    def counted_panels(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return panels(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(linear_mod, "linear_panels_f32", counted_panels)
    assert isinstance(fast_backend, CpuBackend) and type(eager_backend) is TorchBackend
    assert all(m.impl.native for m in fast.modules() if isinstance(m, Linear))
    assert not any(m.impl.native for m in eager.modules() if isinstance(m, Linear))
    assert all(m.backend == (quantization or "onednn") for m in fast.modules() if isinstance(m, Linear))
    prompt = torch.randint(0, eager.config.vocab_size, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    out = greedy_generate(fast, prompt, 12, backend=fast_backend)
    # the native kernels take every row count, decode steps and the prefill: the layers' one copy of each weight
    # is their layout (fp32 panels, int8 tiles)
    assert 1 in calls and 21 in calls
    calls.clear()
    assert greedy_generate(eager, prompt, 12, backend=eager_backend) == out
    assert bool(calls) == (quantization == "int8")  # the eager model takes no native kernel, bar int8's
    assert greedy_generate(fast, prompt, 12) == out  # the module path with the same native kernels
    hidden = torch.randn(1, eager.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():  # int8: the same native kernel in both models
        torch.testing.assert_close(fast.compute_logits(hidden), eager.compute_logits(hidden), rtol=1e-5, atol=1e-5)


def test_enforce_eager_and_the_torch_backend_keep_torch_kernels(tiny_checkpoint: Callable[[str], Path]) -> None:
    path = tiny_checkpoint("mamba2")
    for lm in (load_model(path, native_decode=False), load_model(path, linear_backend="torch")):
        assert type(prepare(lm)) is TorchBackend
        assert not any(m.impl.native for m in lm.model.modules() if isinstance(m, Linear))
    if linear_rows_available():
        lm = load_model(path)
        assert isinstance(prepare(lm), CpuBackend)
        assert all(m.impl.native for m in lm.model.modules() if isinstance(m, Linear))
