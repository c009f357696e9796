"""Layer-level checks: the oneDNN linear against the reference, norms, rotary, caches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from recap.backends import prepare
from recap.model.cache import UNWRITTEN, ModelCaches
from recap.model.layers.linear import Linear, onednn_available
from recap.model.layers.norm import GatedRMSNorm, RMSNorm
from recap.model.layers.rotary import RotaryEmbedding
from recap.model.loader import load_model


@pytest.mark.skipif(not onednn_available(), reason="oneDNN not built in")
@pytest.mark.parametrize("rows", [1, 3, 8, 67])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_reference(rows, bias) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(rows)
    lin = Linear(96, 200, bias, torch.float32)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 96, generator=g))
        if lin.bias is not None:
            lin.bias.copy_(torch.randn(200, generator=g))
    x = torch.randn(rows, 96, generator=g)
    ref = F.linear(x, lin.weight, lin.bias)
    lin.set_backend("onednn")
    assert lin.backend == "onednn"
    torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(lin(x.view(1, rows, 96)), ref.view(1, rows, 200), rtol=1e-5, atol=1e-4)
    lin.set_backend("torch")
    assert torch.equal(lin(x), ref)


def test_model_backends_agree(tiny_checkpoint) -> None:  # noqa: ANN001
    from recap.kernels.metadata import SeqSpec
    from recap.model.testing import forward_step

    outs = []
    for backend in ("torch", "onednn"):
        lm = load_model(tiny_checkpoint("bamba"), linear_backend=backend)
        prepare(lm)
        caches = ModelCaches.allocate(lm.config, 4, 16, 2, torch.float32)
        hidden, _ = forward_step(lm.model, caches, [SeqSpec(list(range(30)), 0, [1, 2], state_slot=1)])
        outs.append(lm.model.compute_logits(hidden))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-4 * outs[0].abs().max().item())


def test_gated_rmsnorm_is_groupwise() -> None:
    norm = GatedRMSNorm(8, group_size=4, eps=1e-6, dtype=torch.float32)
    with torch.no_grad():
        norm.weight.fill_(1.0)
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0, 10.0, 10.0, 10.0, 10.0]])
    z = torch.full_like(x, 20.0)  # silu(20) ~ 20: the gate scales every channel alike
    torch.testing.assert_close(norm(x, z), torch.ones_like(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_plain_formulas(dtype: torch.dtype) -> None:
    """The in-place norms against the textbook order of operations (fp32 math, cast back, then weight)."""
    g = torch.Generator().manual_seed(2)
    x, z = torch.randn(7, 12, generator=g).to(dtype), torch.randn(7, 12, generator=g).to(dtype)
    w = torch.randn(12, generator=g).to(dtype)
    norm, gated = RMSNorm(12, 1e-5, dtype), GatedRMSNorm(12, 4, 1e-5, dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
        gated.weight.copy_(w)
    x_in = x.clone()

    def plain(v: torch.Tensor) -> torch.Tensor:
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5)

    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(norm(x), w * plain(x.float()).to(dtype), **tol)
    h = x.float() * F.silu(z.float())
    expected = w * plain(h.view(7, 3, 4)).view(7, 12).to(dtype)
    torch.testing.assert_close(gated(x, z), expected, **tol)
    assert torch.equal(x, x_in)  # inputs are not modified in place


def test_partial_rotary_leaves_tail_and_preserves_norm() -> None:
    rope = RotaryEmbedding(rotary_dim=8, theta=10000.0)
    x = torch.randn(5, 2, 16)
    pos = torch.arange(5) + 100
    cos, sin = rope.cos_sin(pos, x.dtype)
    y = rope.apply(x, cos, sin)
    assert torch.equal(y[..., 8:], x[..., 8:])
    torch.testing.assert_close(y[..., :8].norm(dim=-1), x[..., :8].norm(dim=-1))
    cos0, sin0 = rope.cos_sin(torch.zeros(5, dtype=torch.long), x.dtype)
    assert torch.equal(rope.apply(x, cos0, sin0), x)  # position 0 is the identity


def test_copy_state_copies_every_ssm_layer(tiny_model) -> None:  # noqa: ANN001
    cfg = tiny_model("jamba").config
    caches = ModelCaches.allocate(cfg, 2, 16, 4, torch.float32)
    assert set(caches.state) == set(cfg.ssm_layers) and set(caches.kv) == set(cfg.attention_layers)
    assert (caches.slot_positions == UNWRITTEN).all()
    tensors = caches.state_tensors()
    assert len(tensors) == 2 * len(cfg.ssm_layers)  # conv + ssm per Mamba layer
    for t in tensors:
        t[2].normal_()
    caches.slot_positions[2] = 48
    caches.copy_state(2, 3)
    for t in tensors:
        assert torch.equal(t[3], t[2]) and not t[1].any()
    assert caches.slot_positions[3].item() == 48
