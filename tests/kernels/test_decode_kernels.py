"""The one-token update kernels (fast, in place on the slots) against their plain `*_ref` twins.

Random inputs from fresh seeds, odd batch sizes, padding rows (slot -1) that must leave every other slot
bit-identical, rows without initial state, G = 1 and G > 1 for SSD, checkpoint writes in decode batches
(the layers' update + copy_decode_checkpoints against the varlen references), and a bf16 smoke test.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.conv1d import causal_conv1d_ref, causal_conv1d_update, causal_conv1d_update_ref
from recap.kernels.gdn import gdn_gates, l2_normalize
from recap.kernels.gdn_decode import gated_delta_rule_update, gated_delta_rule_update_ref
from recap.kernels.mlstm import mlstm_update, mlstm_update_ref, state_width
from recap.kernels.rglru import rglru_update, rglru_update_ref
from recap.kernels.selective_scan import selective_scan_ref, selective_state_update, selective_state_update_ref
from recap.kernels.ssd import ssd_ref
from recap.kernels.ssd_decode import ssd_state_update, ssd_state_update_ref
from recap.kernels.varlen import copy_decode_checkpoints
from recap.kernels.wkv import wkv_update, wkv_update_ref

from .cases import Row, assert_close, build_meta, wkv_params, wkv_state
from .mlstm_case import mlstm_inputs

SLOTS = 23
DT_LIMIT = (0.0, 5.0)


def _batch(rng: random.Random, b: int) -> tuple[list[int], list[bool]]:
    """Distinct slots with ~1 in 4 padding rows, and has_initial_state (False for ~1 in 4 real rows)."""
    slots = rng.sample(range(SLOTS), b)
    slots = [PAD_SLOT_ID if rng.random() < 0.25 else s for s in slots]
    return slots, [rng.random() > 0.25 for _ in slots]


def _conv(gen: torch.Generator, b: int, dtype: torch.dtype) -> tuple[Callable[..., torch.Tensor], ...]:
    d, k = 11, 4
    x, w, bias = torch.randn(b, d, generator=gen), torch.randn(d, k, generator=gen), torch.randn(d, generator=gen)
    x, w, bias = x.to(dtype), w.to(dtype), bias.to(dtype)
    cache = torch.randn(SLOTS, d, k - 1, generator=gen).to(dtype)

    def call(fn: Callable[..., torch.Tensor], c: torch.Tensor, idx, init, sp, pos) -> torch.Tensor:  # noqa: ANN001
        return fn(x, c, w, bias, idx, "silu", init)

    return call, cache


def _mamba1(gen: torch.Generator, b: int, dtype: torch.dtype) -> tuple[Callable[..., torch.Tensor], ...]:
    i, n = 13, 6
    u, dt, z = (torch.randn(b, i, generator=gen).to(dtype) for _ in range(3))
    B, C = torch.randn(b, n, generator=gen).to(dtype), torch.randn(b, n, generator=gen).to(dtype)
    A = (-torch.rand(i, n, generator=gen) * 4).to(dtype)
    D, bias = torch.randn(i, generator=gen).to(dtype), torch.randn(i, generator=gen).to(dtype)
    cache = torch.randn(SLOTS, i, n, generator=gen).to(dtype)

    def call(fn: Callable[..., torch.Tensor], c: torch.Tensor, idx, init, sp, pos) -> torch.Tensor:  # noqa: ANN001
        return fn(c, u, dt, A, B, C, D, z, bias, True, idx, sp, pos, init)

    return call, cache


def _mamba2(groups: int) -> Callable[..., tuple[Callable[..., torch.Tensor], ...]]:
    def make(gen: torch.Generator, b: int, dtype: torch.dtype) -> tuple[Callable[..., torch.Tensor], ...]:
        h, p, n = 6, 5, 7
        x, dt = torch.randn(b, h, p, generator=gen).to(dtype), (torch.randn(b, h, generator=gen) * 2).to(dtype)
        B = torch.randn(b, groups, n, generator=gen).to(dtype)
        C = torch.randn(b, groups, n, generator=gen).to(dtype)
        A = (-torch.rand(h, generator=gen) * 3).to(dtype)
        D, bias = torch.randn(h, generator=gen).to(dtype), torch.randn(h, generator=gen).to(dtype)
        cache = torch.randn(SLOTS, h, p, n, generator=gen).to(dtype)

        def call(fn: Callable[..., torch.Tensor], c: torch.Tensor, idx, init, sp, pos) -> torch.Tensor:  # noqa: ANN001
            return fn(c, x, dt, A, B, C, D, bias, True, DT_LIMIT, idx, sp, pos, init)

        return call, cache

    return make


def _gdn(hk: int, hv: int) -> Callable[..., tuple[Callable[..., torch.Tensor], ...]]:
    def make(gen: torch.Generator, b: int, dtype: torch.dtype) -> tuple[Callable[..., torch.Tensor], ...]:
        dk, dv = 5, 4
        q = (l2_normalize(torch.randn(b, hk, dk, generator=gen)) * dk**-0.5).to(dtype)
        k = l2_normalize(torch.randn(b, hk, dk, generator=gen)).to(dtype)
        v = torch.randn(b, hv, dv, generator=gen).to(dtype)
        g, beta = gdn_gates(torch.randn(b, hv, generator=gen), torch.randn(b, hv, generator=gen),
                            torch.rand(hv, generator=gen), torch.randn(hv, generator=gen))  # fmt: skip
        cache = torch.randn(SLOTS, hv, dk, dv, generator=gen).to(dtype)

        def call(fn: Callable[..., torch.Tensor], c: torch.Tensor, idx, init, sp, pos) -> torch.Tensor:  # noqa: ANN001
            return fn(c, q, k, v, g, beta, idx, sp, pos, init)

        return call, cache

    return make


def _rglru(gen: torch.Generator, b: int, dtype: torch.dtype) -> tuple[Callable[..., torch.Tensor], ...]:
    w = 10
    x, a = torch.randn(b, w, generator=gen).to(dtype), torch.rand(b, w, generator=gen).to(dtype)
    cache = torch.randn(SLOTS, w, generator=gen).to(dtype)

    def call(fn: Callable[..., torch.Tensor], c: torch.Tensor, idx, init, sp, pos) -> torch.Tensor:  # noqa: ANN001
        return fn(x, a, c, idx, sp, pos, init)

    return call, cache


def _wkv(gen: torch.Generator, b: int, dtype: torch.dtype) -> tuple[Callable[..., torch.Tensor], ...]:
    a = 10
    k, v = (torch.randn(b, a, generator=gen) * 3).to(dtype), torch.randn(b, a, generator=gen).to(dtype)
    p = wkv_params(gen, a)
    cache = wkv_state(SLOTS, gen, a).to(dtype)

    def call(fn: Callable[..., torch.Tensor], c: torch.Tensor, idx, init, sp, pos) -> torch.Tensor:  # noqa: ANN001
        return fn(k, v, p["w"], p["u"], c, idx, sp, pos, init)

    return call, cache


def _mlstm(gen: torch.Generator, b: int, dtype: torch.dtype) -> tuple[Callable[..., torch.Tensor], ...]:
    h, k, v = 3, 4, 6
    x = {n: t.to(dtype) for n, t in mlstm_inputs(b, gen, h, k, v).items()}
    cache = torch.randn(SLOTS, h, state_width(k, v), generator=gen).to(dtype)

    def call(fn: Callable[..., torch.Tensor], c: torch.Tensor, idx, init, sp, pos) -> torch.Tensor:  # noqa: ANN001
        return fn(x["q"], x["k"], x["v"], x["i"], x["f"], c, idx, sp, pos, init)

    return call, cache


KERNELS = {
    "mlstm": (_mlstm, mlstm_update, mlstm_update_ref),
    "wkv": (_wkv, wkv_update, wkv_update_ref),
    "rglru": (_rglru, rglru_update, rglru_update_ref),
    "gdn_k2_v2": (_gdn(2, 2), gated_delta_rule_update, gated_delta_rule_update_ref),
    "gdn_k1_v3": (_gdn(1, 3), gated_delta_rule_update, gated_delta_rule_update_ref),
    "conv1d": (_conv, causal_conv1d_update, causal_conv1d_update_ref),
    "mamba1": (_mamba1, selective_state_update, selective_state_update_ref),
    "mamba2_g1": (_mamba2(1), ssd_state_update, ssd_state_update_ref),
    "mamba2_g3": (_mamba2(3), ssd_state_update, ssd_state_update_ref),
}


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("seed", range(8))
def test_update_matches_reference(name: str, seed: int) -> None:
    rng, gen = random.Random(1000 + seed), torch.Generator().manual_seed(1000 + seed)
    make, fast, ref = KERNELS[name]
    b = rng.choice([1, 3, 5, 7, 9])
    slots, init = _batch(rng, b)
    if seed == 0:
        slots[0] = PAD_SLOT_ID  # at least one padding row somewhere
    call, before = make(gen, b, torch.float32)
    idx, init_t = torch.tensor(slots), torch.tensor(init)
    pos = torch.tensor([rng.randint(0, 99) for _ in slots])
    outs, caches, sps = [], [], []
    for fn in (fast, ref):
        cache, sp = before.clone(), torch.full((SLOTS,), -5)
        outs.append(call(fn, cache, idx, init_t, sp, pos))
        caches.append(cache)
        sps.append(sp)
    assert_close(outs[0], outs[1])
    assert_close(caches[0], caches[1])
    for r, s in enumerate(slots):
        if s == PAD_SLOT_ID:
            assert not outs[0][r].any()
    used = {s for s in slots if s != PAD_SLOT_ID}
    for s in range(SLOTS):
        if s not in used:  # bit-identical, not merely close
            assert torch.equal(caches[0][s], before[s]), f"slot {s} changed"
    if name != "conv1d":
        assert torch.equal(sps[0], sps[1])
        assert all(sps[0][s] == p + 1 for s, p in zip(slots, pos.tolist()) if s != PAD_SLOT_ID)


@pytest.mark.parametrize("name", list(KERNELS))
def test_update_all_padding_touches_nothing(name: str) -> None:
    gen = torch.Generator().manual_seed(5)
    make, fast, _ = KERNELS[name]
    call, before = make(gen, 3, torch.float32)
    cache, sp = before.clone(), torch.full((SLOTS,), -5)
    y = call(fast, cache, torch.full((3,), PAD_SLOT_ID), torch.ones(3, dtype=torch.bool), sp, torch.arange(3))
    assert not y.any() and torch.equal(cache, before) and (sp == -5).all()


@pytest.mark.parametrize("name", list(KERNELS))
def test_update_bf16_smoke(name: str) -> None:
    """bf16 inputs and a bf16 cache (the fp32-copy path) track the fp32 kernel."""
    make, fast, _ = KERNELS[name]
    slots, init = [4, PAD_SLOT_ID, 9, 2, 17], [True, True, False, True, True]
    idx, init_t, pos = torch.tensor(slots), torch.tensor(init), torch.arange(5)
    call32, c32 = make(torch.Generator().manual_seed(9), 5, torch.float32)
    call16, c16 = make(torch.Generator().manual_seed(9), 5, torch.bfloat16)
    y32 = call32(fast, c32, idx, init_t, None, pos)
    y16 = call16(fast, c16, idx, init_t, None, pos)
    assert y16.dtype == torch.bfloat16 and c16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), y32, rtol=0.1, atol=0.15)
    torch.testing.assert_close(c16.float(), c32, rtol=0.1, atol=0.15)


def _decode_rows(gen: torch.Generator, tokens: Callable[[int], dict[str, torch.Tensor]]) -> list[Row]:
    """Seven one-token rows: checkpoints on some, a padding row, a row without initial state (context 0)."""
    rows = []
    for r, (ctx, slot) in enumerate([(5, 1), (0, 2), (9, 3), (3, 4), (0, PAD_SLOT_ID), (12, 6), (7, 7)]):
        cps = [(ctx + 1, 10 + r)] if r in (0, 2, 5) else []
        rows.append(Row(tokens(1), ctx, slot, cps, padding=slot == PAD_SLOT_ID))
    return rows


def _cat(rows: list[Row], key: str) -> torch.Tensor:
    return torch.cat([r.inputs[key] for r in rows])


@pytest.mark.parametrize("name", ["conv1d", "mamba1", "mamba2"])
def test_decode_batch_with_checkpoints_matches_varlen_reference(name: str) -> None:
    """A decode batch as the layers run it (update kernel + copy_decode_checkpoints) vs the varlen reference."""
    gen = torch.Generator().manual_seed(11)
    if name == "conv1d":
        d, k = 9, 4
        w, bias = torch.randn(d, k, generator=gen), torch.randn(d, generator=gen)
        rows = _decode_rows(gen, lambda n: {"x": torch.randn(n, d, generator=gen)})
        cache = torch.randn(SLOTS, d, k - 1, generator=gen)
        meta = build_meta(rows, 8)
        x = _cat(rows, "x")

        def fast(c: torch.Tensor, sp: torch.Tensor) -> torch.Tensor:
            y = causal_conv1d_update(x, c, w, bias, meta.state_indices, "silu", meta.has_initial_state)
            copy_decode_checkpoints(c, meta, None)
            return y

        def ref(c: torch.Tensor, sp: torch.Tensor) -> torch.Tensor:
            return causal_conv1d_ref(x, w, bias, c, meta)
    elif name == "mamba1":
        i, n = 7, 5
        A, D, bias = -torch.rand(i, n, generator=gen) * 3, torch.randn(i, generator=gen), torch.randn(i, generator=gen)
        keys = {"u": (i,), "dt": (i,), "z": (i,), "B": (n,), "C": (n,)}
        rows = _decode_rows(gen, lambda m: {k: torch.randn(m, *s, generator=gen) for k, s in keys.items()})
        cache = torch.randn(SLOTS, i, n, generator=gen)
        meta = build_meta(rows, 8)
        u, dt, z, B, C = (_cat(rows, k) for k in keys)
        pos = meta.chunk_end_positions - 1

        def fast(c: torch.Tensor, sp: torch.Tensor) -> torch.Tensor:
            idx, init = meta.state_indices, meta.has_initial_state
            y = selective_state_update(c, u, dt, A, B, C, D, z, bias, True, idx, sp, pos, init)
            copy_decode_checkpoints(c, meta, sp)
            return y

        def ref(c: torch.Tensor, sp: torch.Tensor) -> torch.Tensor:
            return selective_scan_ref(u, dt, A, B, C, D, z, bias, True, c, meta, sp)
    else:
        h, p, g, n = 4, 3, 2, 5
        A, D, bias = -torch.rand(h, generator=gen) * 3, torch.randn(h, generator=gen), torch.randn(h, generator=gen)
        keys = {"x": (h, p), "dt": (h,), "B": (g, n), "C": (g, n)}
        rows = _decode_rows(gen, lambda m: {k: torch.randn(m, *s, generator=gen) for k, s in keys.items()})
        cache = torch.randn(SLOTS, h, p, n, generator=gen)
        meta = build_meta(rows, 8)
        x, dt, B, C = (_cat(rows, k) for k in keys)
        pos = meta.chunk_end_positions - 1

        def fast(c: torch.Tensor, sp: torch.Tensor) -> torch.Tensor:
            idx, init = meta.state_indices, meta.has_initial_state
            y = ssd_state_update(c, x, dt, A, B, C, D, bias, True, DT_LIMIT, idx, sp, pos, init)
            copy_decode_checkpoints(c, meta, sp)
            return y

        def ref(c: torch.Tensor, sp: torch.Tensor) -> torch.Tensor:
            return ssd_ref(x, dt, A, B, C, D, bias, True, DT_LIMIT, c, meta, sp)

    assert meta.is_decode
    got, want = cache.clone(), cache.clone()
    sp_got, sp_want = torch.full((SLOTS,), -2), torch.full((SLOTS,), -2)
    assert_close(fast(got, sp_got), ref(want, sp_want))
    assert_close(got, want)
    written = {1, 2, 3, 4, 6, 7, 10, 12, 15}
    for s in range(SLOTS):
        if s not in written:
            assert torch.equal(got[s], cache[s]), f"slot {s} changed"
    for s in (10, 12, 15):  # each checkpoint holds its row's new running state
        assert torch.equal(got[s], got[{10: 1, 12: 3, 15: 6}[s]])
    if name != "conv1d":
        assert torch.equal(sp_got, sp_want)
