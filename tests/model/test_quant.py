"""Int8 linear weights (recap/model/quant.py) and the bf16 oneDNN path: fast path vs reference, row
independence, and whole models against fp32."""

from __future__ import annotations

import pytest
import torch

from recap.backends import prepare
from recap.kernels.linear_rows import linear_rows_available
from recap.kernels.metadata import SeqSpec
from recap.model.cache import ModelCaches
from recap.model.layers.linear import Linear, WeightReleasedError
from recap.model.loader import LoadedModel, load_model
from recap.model.quant import int8_activation_bits, int8_linear, int8_linear_ref, quantize_int8
from recap.model.testing import forward_step


@pytest.mark.parametrize(("rows", "n_in", "n_out", "bias", "seed"), [
    (1, 64, 48, True, 0), (5, 97, 131, False, 1), (8, 768, 300, True, 2), (3, 16, 7, True, 3), (17, 40, 33, False, 4),
])  # fmt: skip
def test_int8_linear_matches_reference(rows, n_in, n_out, bias, seed) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, n_in, generator=g) * 0.05
    b = torch.randn(n_out, generator=g) if bias else None
    x = torch.randn(rows, n_in, generator=g) * torch.logspace(-2, 2, rows)[:, None] + 0.3
    if rows > 2:
        x[1] = 0.0  # an all-zero row
    q = quantize_int8(w, b)
    y, ref = int8_linear(x, q), int8_linear_ref(x, q)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    for r in range(rows):
        scale = exact[r].abs().max().item() + 1e-6
        if int8_activation_bits() == 8:  # fbgemm's 7-bit (AVX2, no VNNI) path rounds some activations otherwise
            assert (y[r] - ref[r]).abs().max().item() <= 1e-4 * scale  # fp32 rounding (and grid ties) apart
        assert (y[r].double() - exact[r]).norm().item() <= 0.05 * exact[r].norm().item() + 1e-6  # int8 error


def test_int8_rows_are_independent() -> None:
    """A row's result does not depend on the other rows of the call (caching on/off batches rows differently)."""
    g = torch.Generator().manual_seed(7)
    q = quantize_int8(torch.randn(50, 64, generator=g), torch.randn(50, generator=g))
    x = torch.randn(9, 64, generator=g) * torch.logspace(-3, 3, 9)[:, None]
    whole = int8_linear(x, q)
    assert torch.equal(whole, torch.cat([int8_linear(x[r : r + 1], q) for r in range(9)]))
    assert torch.equal(whole[2:5], int8_linear(x[2:5], q))


def test_int8_weights_round_per_channel() -> None:
    w = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0], [-2.0, 1.0, 0.0]])
    q = quantize_int8(w, None)
    assert q.qweight.tolist() == [[127, -64, 32], [0, 0, 0], [-127, 64, 0]]
    assert torch.allclose(q.scales, torch.tensor([1 / 127, 1.0, 2 / 127]))


def test_linear_int8_backend() -> None:
    lin = Linear(32, 24, True, torch.float32)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(24, 32, generator=g))
        lin.bias.copy_(torch.randn(24, generator=g))
    x = torch.randn(4, 32, generator=g)
    weight = lin.weight.detach().clone()
    lin.set_backend("int8")
    assert lin.backend == "int8" and lin.released  # the int8 copy is the only one
    q = quantize_int8(weight, lin.bias)
    # the native int8 kernel where it builds (bit for bit the reference), fbgemm elsewhere
    assert torch.equal(lin(x), int8_linear_ref(x, q) if linear_rows_available() else int8_linear(x, q))
    impl = lin.impl
    lin.set_backend("int8")
    assert lin.impl is impl  # not quantized again
    with pytest.raises(WeightReleasedError):
        lin.set_backend("torch")  # the fp32 weight is gone


def _prepared(lm: LoadedModel) -> LoadedModel:
    prepare(lm)  # the linear backend and kernels its flags ask for, as a runner runs it
    return lm


def _logits(lm, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    caches = ModelCaches.allocate(lm.config, 1 + len(ids) // 16 + 1, 16, 2, lm.model.dtype)
    hidden, _ = forward_step(lm.model, caches, [SeqSpec(ids, 0, list(range(1, 2 + len(ids) // 16)), state_slot=1)])
    return lm.model.compute_logits(hidden)


# int8 logits' relative distance from fp32 on the tiny models: 0.016-0.049 with 8-bit activations (VNNI); 7-bit
# activations (AVX2 only) measured 0.081 on bamba
INT8_DRIFT = 0.08 if int8_activation_bits() == 8 else 0.12


@pytest.mark.parametrize("arch", ["mamba2", "bamba", "mamba"])
def test_reduced_precision_models_stay_close_to_fp32(arch, tiny_checkpoint) -> None:  # noqa: ANN001
    """Relative L2 distance of the logits (tiny models, init range 0.1, amplify rounding: measured int8 0.016-0.045,
    bf16 0.006-0.016 on these three)."""
    path = tiny_checkpoint(arch)
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    ref = _logits(_prepared(load_model(path)), ids)

    def dist(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    int8 = _prepared(load_model(path, quantization="int8"))
    # (a weight its owner reads itself, Mamba1's dt_proj, stays fp32: F.linear reads it)
    assert all(m.backend == "int8" for m in int8.model.modules() if isinstance(m, Linear) and not m.reads_weight)
    assert dist(_logits(int8, ids), ref) <= INT8_DRIFT
    bf16 = _prepared(load_model(path, dtype=torch.bfloat16))
    assert dist(_logits(bf16, ids), ref) <= 0.04
    bf16_ref = _prepared(load_model(path, dtype=torch.bfloat16, linear_backend="torch"))  # the reference bf16 linears
    assert dist(_logits(bf16, ids), _logits(bf16_ref, ids)) <= 0.04


def test_bad_quantization_is_rejected(tiny_checkpoint) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="quantization"):
        load_model(tiny_checkpoint("mamba2"), quantization="int3")
    with pytest.raises(ValueError, match="linear backend"):
        load_model(tiny_checkpoint("mamba2"), quantization="int8", linear_backend="onednn")
