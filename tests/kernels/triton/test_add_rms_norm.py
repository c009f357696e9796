"""The Triton residual add + RMS norm (recap/kernels/triton/add_rms_norm.py) against its torch reference
(kernels/add_rms_norm.py) and against the norm modules' unfused `h + out; norm(h)` (layers/norm.py): odd widths,
1 to many rows, a strided x (a column slice, as a split gives), every weight variant; fp32 under the interpreter
and bf16 on a GPU. The new residual is the unfused add's, bit for bit, and its dtype is the stream's."""

from __future__ import annotations

import random

import pytest
import torch

from recap.kernels.add_rms_norm import add_rms_norm_ref
from recap.kernels.triton.add_rms_norm import add_rms_norm
from recap.model.layers.norm import OffsetRMSNorm, RMSNorm

from .device_rows import DEVICE, TOL

DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
VARIANTS = [{}, {"offset": True}, {"weight_in_dtype": True}]
SEEDS = [5, 19, 41]


def _inputs(rng: random.Random, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x strided, residual, weight) of a random odd-ish width and row count."""
    width, rows = rng.choice([33, 80, 200, 333]), rng.choice([1, 3, 17])
    x = (torch.randn(rows, width + 5) * 2.0)[:, 2 : 2 + width].to(dtype)
    residual = (torch.randn(rows, width) * 4.0).to(dtype)
    return x, residual, (torch.randn(width) * 0.5 + 1.0).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS, ids=["fp32_weight", "offset", "weight_in_dtype"])
@pytest.mark.parametrize("seed", SEEDS)
def test_kernel_equals_reference(seed: int, variant: dict[str, bool], dtype: torch.dtype) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    x, residual, w = _inputs(rng, dtype)
    want_y, want_h = add_rms_norm_ref(x, residual, w, 1e-6, **variant)
    got_y, got_h = add_rms_norm(x, residual, w, 1e-6, **variant)
    assert got_y.dtype == got_h.dtype == dtype and got_y.shape == got_h.shape == x.shape
    assert torch.equal(got_h, residual + x), "the new residual is the unfused add's"
    tol = TOL if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_y.float(), want_y.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_norm_modules_add_forward_fused_equals_unfused(seed: int, dtype: torch.dtype) -> None:
    """RMSNorm and OffsetRMSNorm: add_forward with the kernel handed over equals their `h + out; norm(h)`."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    x, residual, w = _inputs(rng, dtype)
    tol = TOL if dtype == torch.float32 else 1e-2
    for norm in (RMSNorm(w.numel(), 1e-6, dtype), OffsetRMSNorm(w.numel(), 1e-5, dtype)):
        with torch.no_grad():
            norm.weight.copy_(w)
        want_y, want_h = norm.add_forward(residual, x)
        torch.testing.assert_close(want_y, norm(residual + x), rtol=0, atol=0)
        norm.set_add_norm_kernel(add_rms_norm)
        got_y, got_h = norm.add_forward(residual, x)
        norm.set_add_norm_kernel(None)
        assert torch.equal(got_h, want_h), type(norm).__name__
        torch.testing.assert_close(got_y.float(), want_y.float(), rtol=tol, atol=tol, msg=type(norm).__name__)


def test_a_row_alone_equals_the_row_in_a_batch() -> None:
    g = torch.Generator(device=DEVICE).manual_seed(3)
    x, r, w = torch.randn(9, 96, generator=g), torch.randn(9, 96, generator=g), torch.randn(96, generator=g)
    batch = add_rms_norm(x, r, w, 1e-6, weight_in_dtype=True)
    for i in (0, 4, 8):
        alone = add_rms_norm(x[i : i + 1], r[i : i + 1], w, 1e-6, weight_in_dtype=True)
        assert torch.equal(alone[0][0], batch[0][i]) and torch.equal(alone[1][0], batch[1][i])


def test_inputs_it_cannot_serve_are_refused() -> None:
    x = torch.randn(2, 30)
    with pytest.raises(ValueError, match="one shape and dtype"):
        add_rms_norm(x, torch.randn(2, 31), torch.ones(30), 1e-6)
    with pytest.raises(ValueError, match="one shape and dtype"):
        add_rms_norm(x, torch.randn(2, 30, dtype=torch.float64), torch.ones(30), 1e-6)
    with pytest.raises(ValueError, match="weight of 30"):
        add_rms_norm(x, x, torch.ones(16), 1e-6)
    y, h = add_rms_norm(torch.randn(0, 30), torch.randn(0, 30), torch.ones(30), 1e-6)
    assert y.shape == h.shape == (0, 30)
