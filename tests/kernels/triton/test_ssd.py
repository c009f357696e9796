"""Triton Mamba2 SSD (recap/kernels/triton/ssd.py, ssd_decode.py) against the torch references ssd_ref and
ssd_state_update_ref: outputs, every written state, slot_positions, and every other slot bit for bit.

Random packed steps: odd lengths, rows from a slot state or from zeros, a checkpoint at every 16-token block
boundary (inside the 64-token chunks) plus random ones, padding rows, groups G < H, D absent, per head or
per channel, finite dt_limit. Under the interpreter (no GPU) on CPU tensors; on a GPU on CUDA tensors.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import SeqSpec, SSMMetadata
from recap.kernels.ssd import ssd_ref
from recap.kernels.ssd_decode import ssd_state_update_ref
from recap.kernels.triton.ssd import ssd
from recap.kernels.triton.ssd_decode import ssd_state_update

from .device_rows import DEVICE

ON_GPU = DEVICE.type == "cuda"
H, P, N = 4, 16, 16
SLOTS = 32
UNWRITTEN = -7
NO_LIMIT = (0.0, float("inf"))
TOL = 1e-4 if ON_GPU else 2e-5  # compiled exp / dot ordering differ a little from the CPU reference


@dataclass
class Step:
    """One packed step: the rows' metadata and the kernels' arguments (the cache comes separately)."""

    meta: SSMMetadata
    args: tuple  # x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit


def _tensors(gen: torch.Generator, t: int, groups: int, d_shape: tuple[int, ...] | None, limit, bias: bool) -> tuple:
    x = torch.randn(t, H, P, generator=gen)
    dt = torch.randn(t, H, generator=gen) * 1.5
    a = -torch.rand(H, generator=gen) * 3 - torch.tensor([0.0, 0.0, 0.0, 30.0])  # one fast-decaying head
    b = torch.randn(t, groups, N, generator=gen)
    c = torch.randn(t, groups, N, generator=gen)
    d = None if d_shape is None else torch.randn(*d_shape, generator=gen).to(DEVICE)
    dt_bias = torch.randn(H, generator=gen).to(DEVICE) if bias else None
    return (*(v.to(DEVICE) for v in (x, dt, a, b, c)), d, dt_bias, True, limit)


def _meta(specs: list[SeqSpec], chunk_size: int) -> SSMMetadata:
    fb = build_forward_batch(specs, block_size=16, chunk_size=chunk_size, with_attention=False, with_ssm=True,
                             device=DEVICE)  # fmt: skip
    assert fb.ssm is not None
    return fb.ssm


def _random_specs(rng: random.Random, max_len: int = 45) -> list[SeqSpec]:
    """2-4 rows: odd lengths, contexts 0 or random, a checkpoint at every block boundary plus random ones,
    maybe a padding row. Distinct slots."""
    free = list(range(SLOTS))
    rng.shuffle(free)
    specs = []
    for i in range(rng.randint(2, 4)):
        n = rng.randrange(1, max_len, 2)
        if i > 0 and rng.random() < 0.25:
            specs.append(SeqSpec([0] * n, padding=True))
            continue
        ctx = rng.choice([0, rng.randint(1, 40)])
        blocks = set(range((ctx // 16 + 1) * 16, ctx + n + 1, 16))
        cps = sorted(blocks | set(rng.sample(range(ctx + 1, ctx + n + 1), k=min(n, rng.randint(0, 2)))))
        slot = free.pop()
        specs.append(SeqSpec([0] * n, context_len=ctx, state_slot=slot, checkpoints=[(p, free.pop()) for p in cps]))
    return specs


def _written(meta: SSMMetadata) -> list[int]:
    slots = [s for s in meta.state_indices_list if s != PAD_SLOT_ID]
    return slots + [d for d in meta.chunk_dest_slots_list if d != PAD_SLOT_ID]


def _check_step(step: Step, cache: torch.Tensor, sub_chunk: int | None = None) -> None:
    """Run the Triton kernel and the reference on copies of cache; compare everything they leave behind."""
    fast, ref = cache.clone(), cache.clone()
    sp = torch.full((cache.shape[0],), UNWRITTEN, device=DEVICE)
    sp_ref = sp.clone()
    kw = {} if sub_chunk is None else {"sub_chunk": sub_chunk}
    y = ssd(*step.args, fast, step.meta, sp, **kw)
    y_ref = ssd_ref(*step.args, ref, step.meta, sp_ref)
    torch.testing.assert_close(y, y_ref, rtol=TOL, atol=TOL)
    written = _written(step.meta)
    torch.testing.assert_close(fast[written], ref[written], rtol=TOL, atol=TOL)
    others = [s for s in range(cache.shape[0]) if s not in written]
    assert torch.equal(fast[others], cache[others]), "a slot no row writes was changed"
    assert torch.equal(sp, sp_ref)


@pytest.mark.parametrize("seed", range(6))
def test_ssd_varlen_matches_reference(seed: int) -> None:
    rng, gen = random.Random(seed), torch.Generator(DEVICE).manual_seed(seed)
    specs = _random_specs(rng)
    meta = _meta(specs, rng.choice([32, 64, 128]))
    d_shape = [None, (H,), (H, P)][seed % 3]
    limit = (0.0, 2.5) if seed % 2 else NO_LIMIT
    step = Step(meta, _tensors(gen, meta.query_start_loc_list[-1], [1, 2, 4][seed % 3], d_shape, limit, seed != 4))
    _check_step(step, torch.randn(SLOTS, H, P, N, generator=gen).to(DEVICE), sub_chunk=[64, 16, 64, 7, 64, 32][seed])


def test_ssd_varlen_long_row_in_64_token_chunks() -> None:
    """One row over several 64-token chunks of a 128 grid, from a slot, checkpoints at every block."""
    gen = torch.Generator(DEVICE).manual_seed(11)
    spec = SeqSpec([0] * 75, context_len=9, state_slot=3, checkpoints=[(p, 4 + p // 16) for p in range(16, 85, 16)])
    meta = _meta([spec, SeqSpec([0] * 3, context_len=0, state_slot=1)], 128)
    step = Step(meta, _tensors(gen, 78, 2, (H,), (0.0, 4.0), True))
    _check_step(step, torch.randn(SLOTS, H, P, N, generator=gen).to(DEVICE))


def test_chunked_prefill_continues_from_the_slot() -> None:
    """A row in two steps (the second from the running slot) equals the row in one step, states included."""
    gen = torch.Generator(DEVICE).manual_seed(5)
    args = _tensors(gen, 53, 2, (H,), (0.0, 3.0), True)
    cache = torch.randn(SLOTS, H, P, N, generator=gen).to(DEVICE)
    whole = cache.clone()
    cps = [(16, 7), (32, 8), (48, 9)]
    y_whole = ssd_ref(*args, whole, _meta([SeqSpec([0] * 53, state_slot=2, checkpoints=cps)], 64))
    split = cache.clone()
    ys = []
    for lo, hi in [(0, 21), (21, 53)]:
        part = (*(v[lo:hi] for v in args[:2]), args[2], *(v[lo:hi] for v in args[3:5]), *args[5:])
        meta = _meta([SeqSpec([0] * (hi - lo), lo, state_slot=2, checkpoints=[c for c in cps if lo < c[0] <= hi])], 64)
        _check_step(Step(meta, part), split)  # against the reference, from the same cache
        ys.append(ssd(*part, split, meta))
    torch.testing.assert_close(torch.cat(ys), y_whole, rtol=TOL, atol=TOL)
    torch.testing.assert_close(split, whole, rtol=TOL, atol=TOL)


def _decode_case(seed: int) -> tuple[tuple, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """5 one-token rows (a padding row, a row from zeros): (args, cache, slots, positions, has_initial_state)."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    args = _tensors(gen, 5, [1, 2][seed % 2], [(H,), (H, P)][seed % 2], (0.0, 2.0), True)
    idx = torch.tensor([6, PAD_SLOT_ID, 0, 11, 3], device=DEVICE)
    positions = torch.tensor([15, 4, 0, 31, 7], device=DEVICE)
    init = torch.tensor([True, False, False, True, True], device=DEVICE)
    return args, torch.randn(SLOTS, H, P, N, generator=gen).to(DEVICE), idx, positions, init


@pytest.mark.parametrize("seed", range(2))
def test_ssd_state_update_matches_reference(seed: int) -> None:
    args, cache, idx, positions, init = _decode_case(seed)
    for has_init, sp in [(init, torch.full((SLOTS,), UNWRITTEN, device=DEVICE)), (None, None)]:
        fast, ref = cache.clone(), cache.clone()
        sp_ref = None if sp is None else sp.clone()
        y = ssd_state_update(fast, *args, idx, sp, positions, has_init)
        y_ref = ssd_state_update_ref(ref, *args, idx, sp_ref, positions, has_init)
        torch.testing.assert_close(y, y_ref, rtol=TOL, atol=TOL)
        torch.testing.assert_close(fast, ref, rtol=TOL, atol=TOL)
        others = [s for s in range(SLOTS) if s not in idx.tolist()]
        assert torch.equal(fast[others], cache[others])
        if sp is not None:
            assert torch.equal(sp, sp_ref)
    with pytest.raises(ValueError, match="positions"):
        ssd_state_update(cache.clone(), *args, idx, torch.zeros(SLOTS, dtype=torch.int64, device=DEVICE))


def test_ssd_varlen_decode_batch_copies_block_checkpoints() -> None:
    """A decode batch (one token per row) through ssd: a row completing a block checkpoints."""
    args, cache, _, _, _ = _decode_case(3)
    specs = [
        SeqSpec([0], context_len=15, state_slot=6, checkpoints=[(16, 9)]),
        SeqSpec([0], padding=True),
        SeqSpec([0], context_len=0, state_slot=0),
        SeqSpec([0], context_len=31, state_slot=11, checkpoints=[(32, 13)]),
        SeqSpec([0], context_len=7, state_slot=3),
    ]
    meta = _meta(specs, 64)
    assert meta.is_decode
    _check_step(Step(meta, args), cache)


def test_strided_inputs_as_the_layer_passes_them() -> None:
    """x, B, C as views into one projection (the Mamba2 layer splits xBC), dt_bias None, no softplus."""
    gen = torch.Generator(DEVICE).manual_seed(8)
    meta = _meta([SeqSpec([0] * 23, context_len=4, state_slot=1, checkpoints=[(16, 2)])], 64)
    xbc = torch.randn(23, H * P + 2 * N, generator=gen).to(DEVICE)
    x, b, c = xbc.split([H * P, N, N], dim=-1)
    dt = torch.rand(23, H, generator=gen).to(DEVICE)
    a = -torch.rand(H, generator=gen).to(DEVICE)
    args = (x.reshape(23, H, P), dt, a, b.reshape(23, 1, N), c.reshape(23, 1, N), None, None, False, NO_LIMIT)
    assert not args[0].is_contiguous()
    _check_step(Step(meta, args), torch.randn(SLOTS, H, P, N, generator=gen).to(DEVICE))


@pytest.mark.skipif(not ON_GPU, reason="bf16 products need the compiled kernels (a GPU)")
def test_bf16_inputs_on_the_gpu() -> None:
    """bf16 activations on CUDA tensors (tf32/bf16 products): within bf16 tolerance of the fp32 reference."""
    gen = torch.Generator(DEVICE).manual_seed(21)
    meta = _meta(_random_specs(random.Random(21), max_len=200), 64)
    args = _tensors(gen, meta.query_start_loc_list[-1], 2, (H,), (0.0, 4.0), True)
    low = tuple(v.to(torch.bfloat16) if i in (0, 3, 4) else v for i, v in enumerate(args))
    exact = tuple(v.float() if i in (0, 3, 4) else v for i, v in enumerate(low))
    cache = torch.randn(SLOTS, H, P, N, generator=gen).to(DEVICE)
    fast, ref = cache.clone(), cache.clone()
    y = ssd(*low, fast, meta)
    y_ref = ssd_ref(*exact, ref, meta)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), y_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fast, ref, rtol=1e-2, atol=1e-2)
