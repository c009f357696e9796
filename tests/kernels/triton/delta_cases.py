"""Shared checks of the Triton gated delta rule kernels (GDN and KDA) against their torch references: one
packed step (outputs, every slot, slot_positions; slots not written bit-identical) and one decode update.
Everything is made on the test device (device_rows.DEVICE, torch's default in these tests: the GPU where there
is one, as Triton's compiled kernels need CUDA tensors; without one the interpreter runs them on CPU tensors)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.gdn import gated_delta_rule_ref, gdn_gates, l2_normalize
from recap.kernels.gdn_decode import gated_delta_rule_update_ref
from recap.kernels.kda import kda_ref, kda_state_update_ref
from recap.kernels.triton.gdn import gated_delta_rule, gated_delta_rule_update
from recap.kernels.triton.kda import kda, kda_state_update

from ..cases import Row, Tensors, build_meta
from .device_rows import DEVICE


@dataclass
class Delta:
    """One kernel family: how to draw per-token inputs, and its fast and reference forms."""

    token_inputs: Callable[[int, torch.Generator], Tensors]
    cache_shape: tuple[int, ...]  # (Hv, Dk, Dv)
    varlen: Callable[..., torch.Tensor]  # (inputs, cache, meta, slot_positions) -> y
    varlen_ref: Callable[..., torch.Tensor]
    update: Callable[..., torch.Tensor]  # (inputs, cache, state_indices, slot_positions, positions, has_init) -> y
    update_ref: Callable[..., torch.Tensor]


def _args(x: Tensors) -> tuple[torch.Tensor, ...]:
    return x["q"], x["k"], x["v"], x["g"], x["beta"]


def gdn_delta(
    hk: int, hv: int, dk: int, dv: int, piece: int = 16, normalize_qk: bool = False, chunk: int | None = None
) -> Delta:
    """GDN: q, k L2-normalised (q scaled) before the op, or raw and normalised by it (`normalize_qk`, as the
    layer calls it); g = the log decay per value head. `chunk`: the chunk-parallel form in chunks of that size
    (None: the op's choice by token count, the piece kernel on these short steps)."""

    def token_inputs(n: int, gen: torch.Generator) -> Tensors:
        g, beta = gdn_gates(torch.randn(n, hv, generator=gen), torch.randn(n, hv, generator=gen),
                            torch.rand(hv, generator=gen) * 2 - 1, torch.randn(hv, generator=gen))  # fmt: skip
        q, k = torch.randn(n, hk, dk, generator=gen) * 2, torch.randn(n, hk, dk, generator=gen) * 2
        if not normalize_qk:
            q, k = l2_normalize(q) * dk**-0.5, l2_normalize(k)
        return {"q": q, "k": k, "v": torch.randn(n, hv, dv, generator=gen), "g": g, "beta": beta}

    return Delta(
        token_inputs=token_inputs,
        cache_shape=(hv, dk, dv),
        varlen=lambda x, cache, meta, sp: gated_delta_rule(*_args(x), cache, meta, sp, piece=piece,
                                                           normalize_qk=normalize_qk, chunk=chunk),  # fmt: skip
        varlen_ref=lambda x, cache, meta, sp: gated_delta_rule_ref(*_args(x), cache, meta, sp,
                                                                   normalize_qk=normalize_qk),  # fmt: skip
        update=lambda x, cache, *rest: gated_delta_rule_update(cache, *_args(x), *rest),
        update_ref=lambda x, cache, *rest: gated_delta_rule_update_ref(cache, *_args(x), *rest),
    )


def kda_delta(h: int, dk: int, dv: int, decay: float = 2.0, chunk: int | None = None) -> Delta:
    """KDA as its layer calls it: raw q, k; g [n, H, K] the per-channel log decay in (-decay, 0]. `chunk`: the
    chunk-parallel form in chunks of that size (None: kda's choice by token count)."""

    def token_inputs(n: int, gen: torch.Generator) -> Tensors:
        return {
            "q": torch.randn(n, h, dk, generator=gen),
            "k": torch.randn(n, h, dk, generator=gen),
            "v": torch.randn(n, h, dv, generator=gen),
            "g": -torch.rand(n, h, dk, generator=gen) * decay,
            "beta": torch.rand(n, h, generator=gen),
        }

    return Delta(
        token_inputs=token_inputs,
        cache_shape=(h, dk, dv),
        varlen=lambda x, cache, meta, sp: (
            kda(*_args(x), cache, meta, sp)
            if chunk is None
            else gated_delta_rule(*_args(x), cache, meta, sp, normalize_qk=True, chunk=chunk)
        ),
        varlen_ref=lambda x, cache, meta, sp: kda_ref(*_args(x), cache, meta, sp),
        update=lambda x, cache, *rest: kda_state_update(*_args(x), cache, *rest),
        update_ref=lambda x, cache, *rest: kda_state_update_ref(*_args(x), cache, *rest),
    )


def check_step(
    delta: Delta,
    rows: list[Row],
    chunk_size: int,
    num_slots: int,
    gen: torch.Generator,
    dtype: torch.dtype = torch.float32,
    tol: float = 5e-5,
    layout: Callable[[Tensors], Tensors] = dict,
) -> None:
    """fast = reference on one packed step of rows (inputs in dtype, then laid out by `layout`; states fp32)."""
    meta = build_meta(rows, chunk_size)  # on the test device (torch's default)
    inputs = layout({k: torch.cat([r.inputs[k] for r in rows]).to(DEVICE, dtype) for k in rows[0].inputs})
    before = torch.randn(num_slots, *delta.cache_shape, generator=gen).to(DEVICE)
    ys, caches, sps = [], [], []
    for fn in (delta.varlen, delta.varlen_ref):
        cache, sp = before.clone(), torch.full((num_slots,), -5, device=DEVICE)
        ys.append(fn(inputs, cache, meta, sp).float())
        caches.append(cache)
        sps.append(sp)
    torch.testing.assert_close(ys[0], ys[1], rtol=tol, atol=tol)
    torch.testing.assert_close(caches[0], caches[1], rtol=tol, atol=tol)
    assert torch.equal(sps[0], sps[1])
    written = {r.slot for r in rows if not r.padding} | {s for r in rows for _, s in r.checkpoints}
    for slot in set(range(num_slots)) - written:
        assert torch.equal(caches[0][slot], before[slot]), slot
    qsl = meta.query_start_loc_list
    for i, r in enumerate(rows):
        if r.padding:
            assert not ys[0][qsl[i] : qsl[i + 1]].any()


def check_update(delta: Delta, seed: int, num_slots: int, tol: float = 2e-5) -> None:
    """The decode update = its reference: pad rows, rows without initial state, positions recorded."""
    rng, gen = random.Random(seed), torch.Generator(DEVICE).manual_seed(seed)
    b = rng.randint(1, 6)
    slots = [PAD_SLOT_ID if rng.random() < 0.25 else s for s in rng.sample(range(num_slots), b)]
    idx, pos = torch.tensor(slots, device=DEVICE), torch.tensor([rng.randint(0, 90) for _ in slots], device=DEVICE)
    init = torch.tensor([rng.random() > 0.25 for _ in slots], device=DEVICE)
    inputs = {k: v.to(DEVICE) for k, v in delta.token_inputs(b, gen).items()}
    before = torch.randn(num_slots, *delta.cache_shape, generator=gen).to(DEVICE)
    ys, caches, sps = [], [], []
    for fn in (delta.update, delta.update_ref):
        cache, sp = before.clone(), torch.full((num_slots,), -5, device=DEVICE)
        ys.append(fn(inputs, cache, idx, sp, pos, init))
        caches.append(cache)
        sps.append(sp)
    torch.testing.assert_close(ys[0], ys[1], rtol=tol, atol=tol)
    torch.testing.assert_close(caches[0], caches[1], rtol=tol, atol=tol)
    assert torch.equal(sps[0], sps[1])
    for slot in set(range(num_slots)) - set(slots):
        assert torch.equal(caches[0][slot], before[slot])
    for r, s in enumerate(slots):
        if s == PAD_SLOT_ID:
            assert not ys[0][r].any()


def fixed_rows(delta: Delta, gen: torch.Generator) -> list[Row]:
    """Rows that straddle 16-token pieces and a 32-token chunk grid, checkpoints inside pieces, a pad row,
    a one-token row, a row from scratch: slots 0-3 running, 4-7 checkpoints."""
    x = delta.token_inputs
    return [
        Row(x(37, gen), 5, 0, [(10, 4), (21, 5), (27, 6)]),  # grid cut at 32: pieces 5-16, 16-21, 21-27, ...
        Row(x(16, gen), 0, 1, [(16, 7)]),
        Row(x(3, gen), 0, PAD_SLOT_ID, padding=True),
        Row(x(1, gen), 40, 2),
        Row(x(19, gen), 0, 3),
    ]


def fused_views(x: Tensors) -> Tensors:
    """q, k, v as views of one fused projection row (token stride > row width), g and beta head-major."""
    t = x["v"].shape[0]
    fused = torch.cat([x[n].flatten(1) for n in ("q", "k", "v")] + [torch.zeros_like(x["v"].flatten(1))], 1)
    views, at = {}, 0
    for n in ("q", "k", "v"):
        width = x[n][0].numel()
        views[n] = fused[:, at : at + width].view(t, *x[n].shape[1:])
        at += width
    views["g"], views["beta"] = x["g"].t().contiguous().t(), x["beta"].t().contiguous().t()
    assert not views["q"].is_contiguous() and views["g"].stride(0) == 1
    return views
