"""Shared checks of the Triton gated delta rule kernels (GDN and KDA) against their torch references: one
packed step (outputs, every slot, slot_positions; slots not written bit-identical) and one decode update."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from recap.core.output import PAD_SLOT_ID

from ..cases import Row, Tensors, assert_close, build_meta


@dataclass
class Delta:
    """One kernel family: how to draw per-token inputs, and its fast and reference forms."""

    token_inputs: Callable[[int, torch.Generator], Tensors]
    cache_shape: tuple[int, ...]  # (Hv, Dk, Dv)
    varlen: Callable[..., torch.Tensor]  # (inputs, cache, meta, slot_positions) -> y
    varlen_ref: Callable[..., torch.Tensor]
    update: Callable[..., torch.Tensor]  # (inputs, cache, state_indices, slot_positions, positions, has_init) -> y
    update_ref: Callable[..., torch.Tensor]


def check_step(delta: Delta, rows: list[Row], chunk_size: int, num_slots: int, gen: torch.Generator) -> None:
    """fast = reference on one packed step of rows (fp32)."""
    meta = build_meta(rows, chunk_size)
    inputs = {k: torch.cat([r.inputs[k] for r in rows]) for k in rows[0].inputs}
    before = torch.randn(num_slots, *delta.cache_shape, generator=gen)
    ys, caches, sps = [], [], []
    for fn in (delta.varlen, delta.varlen_ref):
        cache, sp = before.clone(), torch.full((num_slots,), -5)
        ys.append(fn(inputs, cache, meta, sp))
        caches.append(cache)
        sps.append(sp)
    assert_close(ys[0], ys[1], 5e-5)
    assert_close(caches[0], caches[1], 5e-5)
    assert torch.equal(sps[0], sps[1])
    written = {r.slot for r in rows if not r.padding} | {s for r in rows for _, s in r.checkpoints}
    for slot in set(range(num_slots)) - written:
        assert torch.equal(caches[0][slot], before[slot]), slot
    qsl = meta.query_start_loc_list
    for i, r in enumerate(rows):
        if r.padding:
            assert not ys[0][qsl[i] : qsl[i + 1]].any()


def check_update(delta: Delta, seed: int, num_slots: int) -> None:
    """The decode update = its reference: pad rows, rows without initial state, positions recorded."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    b = rng.randint(1, 6)
    slots = [PAD_SLOT_ID if rng.random() < 0.25 else s for s in rng.sample(range(num_slots), b)]
    idx, pos = torch.tensor(slots), torch.tensor([rng.randint(0, 90) for _ in slots])
    init = torch.tensor([rng.random() > 0.25 for _ in slots])
    inputs = delta.token_inputs(b, gen)
    before = torch.randn(num_slots, *delta.cache_shape, generator=gen)
    ys, caches, sps = [], [], []
    for fn in (delta.update, delta.update_ref):
        cache, sp = before.clone(), torch.full((num_slots,), -5)
        ys.append(fn(inputs, cache, idx, sp, pos, init))
        caches.append(cache)
        sps.append(sp)
    assert_close(ys[0], ys[1])
    assert_close(caches[0], caches[1])
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


def cuda_step(delta: Delta, dtype: torch.dtype, tol: float) -> None:
    """The fixed rows on CUDA tensors (device taken from the inputs), inputs in dtype, against the reference."""
    gen = torch.Generator().manual_seed(7)
    rows = fixed_rows(delta, gen)
    meta = build_meta(rows, 32)
    meta = type(meta)(**{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in vars(meta).items()})
    inputs = {k: torch.cat([r.inputs[k] for r in rows]).cuda().to(dtype) for k in rows[0].inputs}
    before = torch.randn(10, *delta.cache_shape, generator=gen).cuda()
    ys, caches = [], []
    for fn in (delta.varlen, delta.varlen_ref):
        cache, sp = before.clone(), torch.full((10,), -5, device="cuda")
        ys.append(fn(inputs, cache, meta, sp).float())
        caches.append(cache)
    torch.testing.assert_close(ys[0], ys[1], rtol=tol, atol=tol)
    torch.testing.assert_close(caches[0], caches[1], rtol=tol, atol=tol)
    assert torch.equal(caches[0][8:], before[8:])
