"""The compiled one-row linear (layers/rowvec.py) against its reference, alone and inside a model's decode."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from recap.model.layers import linear as linear_mod
from recap.model.layers.rowvec import rowvec_available, rowvec_linear, rowvec_linear_ref, use_rowvec
from recap.model.loader import load_model
from recap.model.testing import greedy_generate


@pytest.fixture(autouse=True, scope="module")
def _compiled_kernel() -> None:
    """Compiles the kernel once for the module (10-45 s on a machine's first compile, ~10 s after)."""
    if not rowvec_available():
        pytest.skip("torch.compile cannot build the one-row kernel here")


@pytest.mark.parametrize(("out_f", "in_f", "bias"), [(1, 1, False), (7, 33, True), (300, 129, False), (64, 1000, True)])
def test_rowvec_matches_reference(out_f: int, in_f: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(out_f * 1000 + in_f)
    w = torch.randn(out_f, in_f, generator=g)
    b = torch.randn(out_f, generator=g) if bias else None
    x = torch.randn(1, in_f, generator=g)
    with torch.inference_mode():
        y, ref = rowvec_linear(x, w, b), rowvec_linear_ref(x, w, b)
    assert y.shape == ref.shape == (1, out_f)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * in_f**0.5)


def test_rowvec_takes_one_fp32_row_on_one_thread_only() -> None:
    w = torch.randn(8, 16)
    assert use_rowvec(torch.randn(1, 16), w)
    assert not use_rowvec(torch.randn(2, 16), w)
    assert not use_rowvec(torch.randn(1, 16, dtype=torch.bfloat16), w.bfloat16())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert not use_rowvec(torch.randn(1, 16), w)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("arch", ["mamba2", "bamba"])
def test_decode_with_rowvec_matches_reference(
    arch: str, tiny_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy decode (batch 1) with the compiled mat-vec gives the reference's tokens and logits."""
    path = tiny_checkpoint(arch)
    ref_model = load_model(path).model
    fast_model = load_model(path, compile_decode=True).model
    calls = []

    def counted(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return rowvec_linear(x, w, b)

    monkeypatch.setattr(linear_mod, "rowvec_linear", counted)
    prompt = torch.randint(0, ref_model.config.vocab_size, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    fast = greedy_generate(fast_model, prompt, 12)
    assert calls and set(calls) == {1}  # the decode steps' linears took the compiled path
    calls.clear()
    assert greedy_generate(ref_model, prompt, 12) == fast
    assert not calls  # the reference model never does
    hidden = torch.randn(1, ref_model.config.hidden_size)
    with torch.inference_mode():
        fast_logits, ref_logits = fast_model.compute_logits(hidden), ref_model.compute_logits(hidden)
    torch.testing.assert_close(fast_logits, ref_logits, rtol=1e-5, atol=1e-5)
