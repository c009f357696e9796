"""The Triton q/k preparation (recap/kernels/triton/rope_qk.py) against the attention layers' module ops.

Every attention layer that prepares q/k through layers/qk_rope.py (Attention: LFM, Falcon-H1, Zamba2, Bamba...,
GatedAttention: Qwen3.5 / Qwen3-Next, OLMo-Hybrid) runs `prepare_qk` once with its module ops and once with the
fused kernel handed to it (`set_rope_kernel`, as a backend does): with and without per-head norms (plain and
zero-centred), full, partial and proportional RoPE or none, GQA and odd head counts, head dims that are not
powers of two, positions up to 2^18, strided inputs (q and the gate as the halves of Qwen3.5's q_proj rows).
fp32 on the interpreter, bf16 too on a GPU. RoPE alone is bit-exact in fp32 (the same fp64 cos/sin, the same
rounded products); a norm's reduction order differs, so with norms the tolerance is the norm tests'.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from recap.kernels.triton.rope_qk import rope_qk
from recap.model.layers.attention import Attention
from recap.model.layers.gated_attention import GatedAttention
from recap.model.layers.norm import OffsetRMSNorm, RMSNorm
from recap.model.layers.qk_rope import QKRope
from recap.model.mixer_configs import AttentionConfig

from .device_rows import DEVICE, TOL

DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
HIDDEN = 32
# (layer class, norm class, AttentionConfig fields): every variant of the two layers the kernel serves.
VARIANTS: list[tuple[str, type[RMSNorm], dict[str, object]]] = [
    ("attention", RMSNorm, {"num_heads": 4, "num_kv_heads": 2, "head_dim": 24, "rotary_dim": 24}),
    ("attention", RMSNorm, {"num_heads": 5, "num_kv_heads": 1, "head_dim": 40, "rotary_dim": 10}),  # partial
    ("attention", RMSNorm, {"num_heads": 3, "num_kv_heads": 3, "head_dim": 16, "rotary_dim": 16, "qk_norm": "head"}),
    ("attention", RMSNorm, {"num_heads": 6, "num_kv_heads": 2, "head_dim": 24, "rotary_dim": 24, "qk_norm": "head",
                            "rope_angles": 4, "head_gate": True}),  # LFM3's proportional RoPE
    ("attention", RMSNorm, {"num_heads": 2, "num_kv_heads": 1, "head_dim": 20, "rotary_dim": 0, "qk_norm": "head",
                            "rope_theta": None}),  # q/k norms without RoPE
    ("gated", OffsetRMSNorm, {"num_heads": 3, "num_kv_heads": 1, "head_dim": 32, "rotary_dim": 8, "qk_norm": "head",
                              "output_gate": True}),  # Qwen3.5: a quarter of each head rotated
    ("gated", RMSNorm, {"num_heads": 5, "num_kv_heads": 5, "head_dim": 24, "rotary_dim": 12, "qk_norm": "head"}),
    ("gated", RMSNorm, {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "rotary_dim": 16, "qk_norm": "all"}),
]  # fmt: skip


def _layer(kind: str, norm_cls: type[RMSNorm], fields: dict[str, object], dtype: torch.dtype) -> QKRope:
    cfg = AttentionConfig(**{"rope_theta": 10000.0, **fields})  # type: ignore[arg-type]
    layer = Attention(HIDDEN, cfg, dtype) if kind == "attention" else GatedAttention(HIDDEN, cfg, 1e-6, dtype, norm_cls)
    for m in layer.modules():
        if isinstance(m, RMSNorm):
            with torch.no_grad():
                m.weight.copy_(torch.randn(m.weight.shape) * 0.3 + (0.0 if isinstance(m, OffsetRMSNorm) else 1.0))
    return layer


def _inputs(rng: random.Random, cfg: AttentionConfig, dtype: torch.dtype, rows: int) -> dict[str, torch.Tensor]:
    """q and the gate as the two halves of each head's q_proj row (strided views), k a column slice, positions
    spread up to 2^18."""
    h, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qg = (torch.randn(rows, h, 2 * d) * 2.0).to(dtype)
    k = (torch.randn(rows, hk * d + 5) * 2.0).to(dtype)[:, 3 : 3 + hk * d].view(rows, hk, d)
    positions = torch.tensor([rng.choice([0, 1, rng.randrange(4096), rng.randrange(1 << 18)]) for _ in range(rows)])
    positions[-1] = (1 << 18) - 1  # the longest context served (256k)
    return {"q": qg[..., :d], "k": k, "gate": qg[..., d:], "positions": positions}


def _head_norms(layer: QKRope) -> tuple[RMSNorm, RMSNorm] | None:
    cfg: AttentionConfig = layer.cfg  # type: ignore[attr-defined]
    return (layer.q_norm, layer.k_norm) if cfg.qk_norm == "head" else None  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [3, 17])
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_each_attention_variant_equals_its_module_ops(variant: int, seed: int, dtype: torch.dtype) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    layer = _layer(*VARIANTS[variant], dtype)
    cfg: AttentionConfig = layer.cfg  # type: ignore[attr-defined]
    x = _inputs(rng, cfg, dtype, rng.choice([1, 3, 11]))
    gate = x["gate"] if cfg.output_gate else None
    norms = _head_norms(layer)
    want = layer.prepare_qk(x["q"], x["k"], x["positions"], norms, gate)
    layer.set_rope_kernel(rope_qk)
    assert layer._fused(x["q"], norms), "every variant here is one the kernel serves"
    got = layer.prepare_qk(x["q"], x["k"], x["positions"], norms, gate)
    layer.set_rope_kernel(None)
    assert got[3] is want[3] is False, "no cache write asked for: none done"
    exact = norms is None and dtype == torch.float32
    for name, g, w in zip(("q", "k", "gate"), got[:3], want[:3], strict=True):
        if w is None:
            assert g is None
            continue
        assert g.dtype == w.dtype == dtype and g.shape == w.shape and g.is_contiguous(), name
        if exact and name != "gate":  # the sigmoid's exp may differ in the last bit between libraries
            assert torch.equal(g, w), f"{name}: RoPE alone is bit-exact"
        tol = TOL if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("offset", [False, True])
def test_a_token_alone_equals_the_token_in_a_batch(offset: bool) -> None:
    """Batch invariance: the prefill row and the decode step of one token give the same bits."""
    g = torch.Generator(device=DEVICE).manual_seed(5)
    q, k, gate = (torch.randn(9, h, 40, generator=g) for h in (6, 2, 6))
    weights = (torch.randn(40, generator=g), torch.randn(40, generator=g))
    positions = torch.randint(0, 1 << 18, (9,), generator=g)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 10, 2, dtype=torch.float32) / 10))
    batch = rope_qk(q, k, positions, inv_freq, weights=weights, eps=1e-6, offset=offset, gate=gate)
    for r in (0, 4, 8):
        one = slice(r, r + 1)
        alone = rope_qk(q[one], k[one], positions[one], inv_freq, weights=weights, eps=1e-6, offset=offset,
                        gate=gate[one])  # fmt: skip
        for a, b in zip(alone, batch, strict=True):
            assert a is not None and b is not None and torch.equal(a[0], b[r])


def test_inputs_it_cannot_serve_are_refused() -> None:
    q, k, pos = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.arange(2)
    inv = torch.ones(4)
    with pytest.raises(ValueError, match="one T, D and dtype"):
        rope_qk(q, torch.randn(2, 2, 8), pos, inv)
    with pytest.raises(ValueError, match="unit stride"):
        rope_qk(q.transpose(1, 2).contiguous().transpose(1, 2), k, pos, inv)
    with pytest.raises(ValueError, match="positions"):
        rope_qk(q, k, torch.arange(3), inv)
    with pytest.raises(ValueError, match="rotary dim of 18"):
        rope_qk(q, k, pos, torch.ones(9))
    with pytest.raises(ValueError, match="16 entries"):
        rope_qk(q, k, pos, inv, weights=(torch.ones(16), torch.ones(15)))
    with pytest.raises(ValueError, match="gate's shape"):
        rope_qk(q, k, pos, inv, gate=torch.randn(2, 4, 8))
    empty = rope_qk(q[:0], k[:0], pos[:0], inv)
    assert empty[0].shape == (0, 4, 16) and empty[1].shape == (0, 2, 16) and empty[2] is None


def test_parts_the_kernel_does_not_compute_keep_their_module_ops() -> None:
    layer = _layer(*VARIANTS[2], torch.float32)
    layer.set_rope_kernel(rope_qk)
    norms = _head_norms(layer)
    q = torch.randn(2, 3, 16)
    assert layer._fused(q, norms)
    assert not layer._fused(q, (norms[0], OffsetRMSNorm(16, 1e-6, torch.float32)))  # type: ignore[index]
    assert not layer._fused(q, (RMSNorm(16, 1e-5, torch.float32), norms[1]))  # type: ignore[index]
    half = RMSNorm(16, 1e-6, torch.float16), RMSNorm(16, 1e-6, torch.float16)
    assert not layer._fused(q.bfloat16(), half)  # a plain norm's weight in another 16-bit dtype
    layer.rotary = None
    assert not layer._fused(q, None)  # nothing to compute


def test_a_backend_hands_its_kernel_sets_rope_to_every_attention_layer(tmp_path: Path) -> None:
    """The Triton kernel set's backend puts the attention layers of a Qwen3.5 hybrid (GatedAttention) and an LFM3
    hybrid (Attention) on the fused kernel; preparing them for the torch kernel set gives back their module ops."""
    from recap.backends.base import model_parts
    from recap.backends.eager import TorchBackend
    from recap.kernels.triton.kernel_set import TRITON_KERNELS
    from recap.model.loader import load_model
    from recap.model.testing import make_tiny_checkpoint

    for arch, cls in (("qwen3_5", GatedAttention), ("lfm3", Attention)):
        model = load_model(make_tiny_checkpoint(arch, tmp_path / arch), linear_backend="torch").model
        layers = [m for m in model_parts(model) if isinstance(m, QKRope)]
        assert layers and all(type(m) is cls for m in layers), arch
        TorchBackend(kernels=TRITON_KERNELS).prepare(model)
        assert all(m.rope_kernel is rope_qk for m in layers), arch
        TorchBackend().prepare(model)
        assert all(m.rope_kernel is None for m in layers), arch
