"""The Triton RMS norm (recap/kernels/triton/rms_norm.py) against the norm modules' torch ops, its references.

Each norm module runs once with its torch ops and once with the fused kernel handed to it (`set_norm_kernel`,
as a backend does): random widths (odd, not powers of two), group sizes, row counts (1 row to many), strided
inputs (a column slice of a wider projection, as a split gives), fp32 everywhere (the interpreter) and bf16 on
a GPU; and rows are independent: a row normalized alone equals the same row inside a batch, bit for bit.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from recap.kernels.triton.rms_norm import rms_norm
from recap.model.layers.norm import GatedRMSNorm, HeadGatedRMSNorm, OffsetRMSNorm, RMSNorm

from .device_rows import DEVICE, TOL

DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
SEEDS = [11, 23, 37]


def _modules(rng: random.Random, dtype: torch.dtype) -> list[tuple[torch.nn.Module, int, bool]]:
    """(norm, row width, takes a gate) for every norm module the kernel serves, with random weights."""
    group = rng.choice([16, 24, 40, 64])
    groups = rng.randint(1, 5)
    width = rng.choice([48, 80, 200, 333])
    mods: list[tuple[torch.nn.Module, int, bool]] = [
        (RMSNorm(width, 1e-6, dtype), width, False),
        (OffsetRMSNorm(width, 1e-6, dtype), width, False),
        (GatedRMSNorm(group * groups, group, 1e-5, dtype), group * groups, True),
        (GatedRMSNorm(group * groups, group, 1e-5, dtype, norm_before_gate=True), group * groups, True),
        (HeadGatedRMSNorm(group, 1e-6, dtype), group * groups, True),
    ]
    for m, _, _ in mods:
        with torch.no_grad():
            m.weight.copy_(torch.randn(m.weight.shape) * 0.5 + 1.0)
    return mods


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_each_norm_module_equals_its_torch_ops(seed: int, dtype: torch.dtype) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    tol = TOL if dtype == torch.float32 else 1e-2
    for norm, width, gated in _modules(rng, dtype):
        rows = rng.choice([1, 3, 17])
        wide = torch.randn(rows, width + 7) * 3.0  # a column slice: rows are strided, as after a split
        x = wide[:, 3 : 3 + width].to(dtype)
        z = torch.randn(rows, width).to(dtype) if gated else None
        args = (x,) if z is None else (x, z)
        want = norm(*args)
        norm.set_norm_kernel(rms_norm)
        got = norm(*args)
        norm.set_norm_kernel(None)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape, type(norm).__name__
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=type(norm).__name__)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_row_alone_equals_the_row_in_a_batch(seed: int) -> None:
    """Batch invariance: the prefill row and the decode step of one token give the same bits."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(9, 96, generator=g)
    z = torch.randn(9, 96, generator=g)
    w = torch.randn(32, generator=g)
    batch = rms_norm(x, w, 1e-6, group=32, gate=z, weight_in_dtype=True)
    for r in (0, 4, 8):
        alone = rms_norm(x[r : r + 1], w, 1e-6, group=32, gate=z[r : r + 1], weight_in_dtype=True)
        assert torch.equal(alone[0], batch[r])


def test_shapes_it_cannot_serve_are_refused() -> None:
    x = torch.randn(2, 30)
    with pytest.raises(ValueError, match="groups of 16"):
        rms_norm(x, torch.ones(16), 1e-6, group=16)
    with pytest.raises(ValueError, match="gate's shape"):
        rms_norm(x, torch.ones(30), 1e-6, gate=torch.randn(2, 31))
    assert rms_norm(torch.randn(0, 30), torch.ones(30), 1e-6).shape == (0, 30)


def test_a_backend_hands_its_kernel_sets_norm_to_every_norm(tmp_path: Path) -> None:
    """The Triton kernel set's backend puts every norm of a Qwen3.5 hybrid (residual, q/k, GDN output norms) on the
    fused kernel, and the residual norms' adds on the fused add + norm; preparing the model for the torch kernel
    set gives them back their torch ops."""
    from recap.backends.base import model_parts
    from recap.backends.eager import TorchBackend
    from recap.kernels.triton.add_rms_norm import add_rms_norm
    from recap.kernels.triton.kernel_set import TRITON_KERNELS
    from recap.model.layers.norm import FusedNorm
    from recap.model.loader import load_model
    from recap.model.testing import make_tiny_checkpoint

    model = load_model(make_tiny_checkpoint("qwen3_5", tmp_path / "m"), linear_backend="torch").model
    norms = [m for m in model_parts(model) if isinstance(m, FusedNorm)]
    assert {type(m) for m in norms} >= {OffsetRMSNorm, HeadGatedRMSNorm}
    TorchBackend(kernels=TRITON_KERNELS).prepare(model)
    assert all(m.norm_kernel is rms_norm for m in norms)
    residual_norms = [m for m in norms if isinstance(m, RMSNorm)]
    assert residual_norms and all(m.add_norm_kernel is add_rms_norm for m in residual_norms)
    TorchBackend().prepare(model)
    assert all(m.norm_kernel is None for m in norms)
    assert all(m.add_norm_kernel is None for m in residual_norms)
