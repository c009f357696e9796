"""KDA kernels against transformers' torch fallback (recurrent and chunked), and the decode update against its
reference with padding rows and rows without initial state. The shared invariants (fast = reference with
states at checkpoints inside chunks, chunked = one shot, packed = alone, padding inert, decode = varlen) run
on KDA through tests/kernels/cases.py."""

from __future__ import annotations

import random

import pytest
import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.kda import kda, kda_ref, kda_state_update, kda_state_update_ref

from .cases import Row, assert_close, build_meta

H, K, V = 3, 8, 6
SLOTS = 11


def _inputs(gen: torch.Generator, t: int) -> tuple[torch.Tensor, ...]:
    q, k = torch.randn(t, H, K, generator=gen), torch.randn(t, H, K, generator=gen)
    v = torch.randn(t, H, V, generator=gen)
    g = -torch.rand(t, H, K, generator=gen) * 3
    beta = torch.rand(t, H, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("length", [1, 17, 64, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_transformers_fallback(length: int, with_state: bool) -> None:
    """kda over one row (chunk grid 64, checkpoints at 16 and 48) equals transformers' chunked and
    recurrent torch functions: outputs, final state, and the states at the checkpoints."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    gen = torch.Generator().manual_seed(length)
    q, k, v, g, beta = _inputs(gen, length)
    init = torch.randn(H, K, V, generator=gen) if with_state else None
    cache = torch.zeros(SLOTS, H, K, V)
    if init is not None:
        cache[2] = init
    ctx = 5 if with_state else 0  # any context: only whether the slot is read matters
    cps = [(ctx + p, 3 + i) for i, p in enumerate((16, 48)) if p <= length]
    meta = build_meta([Row({"x": q}, ctx, 2, cps)], 64)
    out = kda(q, k, v, g, beta, cache, meta)
    for fn in (hf.chunk_kimi_delta_attention, hf.recurrent_kimi_delta_attention):
        o_hf, s_hf = fn(q[None], k[None], v[None], g[None], beta[None], initial_state=None if init is None
                        else init[None], output_final_state=True, use_qk_l2norm_in_kernel=True)  # fmt: skip
        assert_close(out, o_hf[0], 1e-4)
        assert_close(cache[2], s_hf[0], 1e-4)
    for p, slot in cps:  # the state after p - ctx tokens, by the recurrent fallback on the prefix
        n = p - ctx
        _, s_hf = hf.recurrent_kimi_delta_attention(
            q[None, :n], k[None, :n], v[None, :n], g[None, :n], beta[None, :n],
            initial_state=None if init is None else init[None], output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        assert_close(cache[slot], s_hf[0], 1e-4)


@pytest.mark.parametrize("seed", range(8))
def test_state_update_matches_reference(seed: int) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    b = rng.randint(1, 7)
    slots = [PAD_SLOT_ID if rng.random() < 0.25 else s for s in rng.sample(range(SLOTS), b)]
    init = torch.tensor([rng.random() > 0.25 for _ in slots])
    idx = torch.tensor(slots)
    pos = torch.tensor([rng.randint(0, 90) for _ in slots])
    q, k, v, g, beta = _inputs(gen, b)
    cache = torch.randn(SLOTS, H, K, V, generator=gen)
    cache_ref = cache.clone()
    sp, sp_ref = torch.full((SLOTS,), -1), torch.full((SLOTS,), -1)
    out = kda_state_update(q, k, v, g, beta, cache, idx, sp, pos, init)
    ref = kda_state_update_ref(q, k, v, g, beta, cache_ref, idx, sp_ref, pos, init)
    assert_close(out, ref)
    assert_close(cache, cache_ref)  # untouched slots bit-identical, written ones close
    assert torch.equal(sp, sp_ref)
    for r, s in enumerate(slots):
        if s == PAD_SLOT_ID:
            assert not out[r].any()


def test_long_row_strong_decay_stays_finite() -> None:
    """Strong per-channel decay over a long row (cumulative log decay far below fp32 exp range)."""
    gen = torch.Generator().manual_seed(9)
    q, k, v, g, beta = _inputs(gen, 200)
    g = g * 20  # down to -60 per token
    cache, cache_ref = torch.zeros(SLOTS, H, K, V), torch.zeros(SLOTS, H, K, V)
    meta = build_meta([Row({"x": q}, 0, 1, [(64, 4), (100, 5)])], 64)
    out = kda(q, k, v, g, beta, cache, meta)
    ref = kda_ref(q, k, v, g, beta, cache_ref, meta)
    assert out.isfinite().all()
    assert_close(out, ref, 1e-4)
    assert_close(cache, cache_ref, 1e-4)
