"""The native Mamba2 SSD prefill (kernels/ssd_walk.py, csrc/ssd_walk.c) against the torch chunked op and the
per-token reference: random packed steps with odd lengths straddling 16-token blocks and the chunk grid,
checkpoints inside chunks, rows with and without initial state, padding rows (their slots untouched, bit for bit),
one and two groups, gentle and steep decays (pieces of many tokens, of one, and decays below the floor), the dt
bias / softplus / limit and D variants; outputs, every slot's state and slot_positions asserted."""

from __future__ import annotations

import random

import pytest
import torch

from recap.kernels import ssd_walk
from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import SeqSpec, SSMMetadata
from recap.kernels.native import _cpu_flags
from recap.kernels.ssd import ssd, ssd_ref
from recap.kernels.ssd_walk import ssd_native, ssd_walk_available
from tests.kernels import walk_steps
from tests.kernels.walk_steps import SLOTS, assert_step

pytestmark = pytest.mark.skipif(not ssd_walk_available(), reason="the native kernels do not build here")

NO_LIMIT = (0.0, float("inf"))


def random_step(rnd: random.Random, chunk_size: int, rows: int, max_len: int = 90) -> tuple[SSMMetadata, set[int]]:
    """walk_steps.random_step with checkpoints at block boundaries too."""
    return walk_steps.random_step(rnd, chunk_size, rows, max_len, block_checkpoints=True)


def inputs(gen: torch.Generator, t: int, shape: tuple[int, int, int, int], steep: bool, d_kind: str) -> tuple:
    """(x, dt, A, B, C, D, dt_bias) of a step of t tokens. Gentle: dt_bias -4 (a trained model's few-per-chunk
    decays); steep: dt_bias 0 and heads with A down to -40 (one-token pieces, decays below exp(-60))."""
    h, p, g, n = shape
    x, dt = torch.randn(t, h, p, generator=gen), torch.randn(t, h, generator=gen)
    b, c = torch.randn(t, g, n, generator=gen), torch.randn(t, g, n, generator=gen)
    a = -torch.rand(h, generator=gen) * 3
    if steep:
        a[: h // 2] = -torch.tensor([40.0, 8.0, 0.2])[torch.arange(h // 2) % 3]
    bias = torch.randn(h, generator=gen) * 0.5 + (0.0 if steep else -4.0)
    d = {"none": None, "head": torch.randn(h, generator=gen), "channel": torch.randn(h, p, generator=gen)}[d_kind]
    return x, dt, a, b, c, d, bias


def run_both(fast, slow, args: tuple, meta: SSMMetadata, gen: torch.Generator) -> tuple:
    """walk_steps.run_both with states of the step's (H, P, N)."""
    h, p = args[0].shape[1:]
    return walk_steps.run_both(fast, slow, args, meta, (h, p, args[3].shape[-1]), 0.5, gen)


# (H, P, G, N): the register tiles (P a multiple of 32, N of 8), and the plain C walk (other P, N)
SHAPES = [(4, 32, 2, 16), (6, 64, 1, 24), (3, 5, 1, 7), (4, 16, 2, 12)]


@pytest.mark.parametrize("steep", [False, True], ids=["gentle", "steep"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("seed", range(3))
def test_matches_torch_op(steep: bool, shape: tuple[int, int, int, int], seed: int) -> None:
    rnd = random.Random(1000 * seed + sum(shape) + steep)
    gen = torch.Generator().manual_seed(rnd.randrange(1 << 30))
    meta, written = random_step(rnd, rnd.choice([16, 32, 64, 256]), rnd.randint(1, 4))
    x, dt, a, b, c, d, bias = inputs(gen, meta.query_start_loc_list[-1], shape, steep, rnd.choice(["head", "channel"]))
    limit = rnd.choice([NO_LIMIT, (0.0, 4.0), (0.01, 0.5)])
    args = (x, dt, a, b, c, d, bias, True, limit)
    fast, slow, before, pos = run_both(ssd_native, ssd, args, meta, gen)
    assert_step(fast, slow, before, pos, written, meta)


@pytest.mark.parametrize("steep", [False, True], ids=["gentle", "steep"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("seed", range(2))
def test_matches_per_token_reference(steep: bool, groups: int, seed: int) -> None:
    rnd = random.Random(seed + 77 + 10 * groups + steep)
    gen = torch.Generator().manual_seed(rnd.randrange(1 << 30))
    meta, written = random_step(rnd, 32, 3, max_len=70)
    args = (*inputs(gen, meta.query_start_loc_list[-1], (4, 32, groups, 16), steep, "head"), True, NO_LIMIT)
    fast, slow, before, pos = run_both(ssd_native, ssd_ref, args, meta, gen)
    assert_step(fast, slow, before, pos, written, meta, tol=1e-4)


def test_lightning_call_without_bias_softplus_or_d() -> None:
    """Lightning attention's call: dt = 1, no bias, no softplus, no D."""
    rnd = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    meta, written = random_step(rnd, 64, 3)
    x, _, a, b, c, _, _ = inputs(gen, meta.query_start_loc_list[-1], (4, 32, 4, 32), False, "none")
    args = (x, torch.ones(x.shape[:2]), a, b, c, None, None, False, NO_LIMIT)
    fast, slow, before, pos = run_both(ssd_native, ssd_ref, args, meta, gen)
    assert_step(fast, slow, before, pos, written, meta, tol=1e-4)


@pytest.mark.parametrize(("ctx", "n"), [(0, 512), (37, 333)])
def test_block_checkpoints_long_row(ctx: int, n: int) -> None:
    """A checkpoint at every block boundary of a long row at a real head shape (16 x 16 transposes, streamed)."""
    gen = torch.Generator().manual_seed(ctx + n)
    cps = [(p, 2 + k) for k, p in enumerate(range((ctx // 16 + 1) * 16, ctx + n + 1, 16))]
    meta = build_forward_batch([SeqSpec([0] * n, ctx, state_slot=1, checkpoints=cps)], block_size=16,
                               chunk_size=256, with_attention=False, with_ssm=True).ssm  # fmt: skip
    assert meta is not None
    h, p, nn = 4, 64, 128
    x, dt, a, b, c, d, bias = inputs(gen, n, (h, p, 1, nn), False, "head")
    state = torch.randn(3 + len(cps), h, p, nn, generator=gen)
    pos = torch.zeros(state.shape[0], dtype=torch.int64)
    outs = []
    for fn in (ssd_native, ssd):
        s, q = state.clone(), pos.clone()
        outs.append((fn(x, dt, a, b, c, d, bias, True, NO_LIMIT, s, meta, q), s, q))
    (y, s, q), (y_ref, s_ref, q_ref) = outs
    torch.testing.assert_close(y, y_ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(s, s_ref, rtol=2e-5, atol=2e-5)
    assert torch.equal(q, q_ref) and q[2 : 2 + len(cps)].tolist() == [p for p, _ in cps]
    assert torch.equal(s[0], state[0]) and torch.equal(s[-1], state[-1])


@pytest.mark.skipif(" avx512f" not in _cpu_flags(), reason="the AVX-512 build is the only one here")
def test_portable_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain C paths (the build without AVX-512) agree too."""
    lib = ssd_walk.ssd_walk_library(("-mno-avx512f",))
    monkeypatch.setattr(ssd_walk, "ssd_walk_library", lambda: lib)
    for steep in (False, True):
        rnd = random.Random(3 + steep)
        gen = torch.Generator().manual_seed(int(steep))
        meta, written = random_step(rnd, 32, 3)
        args = (*inputs(gen, meta.query_start_loc_list[-1], (4, 32, 2, 16), steep, "head"), True, NO_LIMIT)
        fast, slow, before, pos = run_both(ssd_native, ssd, args, meta, gen)
        assert_step(fast, slow, before, pos, written, meta)


def test_two_threads() -> None:
    """Heads split over torch's threads give the single thread's result."""
    rnd = random.Random(11)
    gen = torch.Generator().manual_seed(11)
    meta, written = random_step(rnd, 32, 3)
    args = (*inputs(gen, meta.query_start_loc_list[-1], (6, 32, 2, 16), True, "head"), True, NO_LIMIT)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        fast, slow, before, pos = run_both(ssd_native, ssd, args, meta, gen)
    finally:
        torch.set_num_threads(threads)
    assert_step(fast, slow, before, pos, written, meta)


@pytest.mark.parametrize("case", ["decode", "bf16", "growing"])
def test_what_the_kernel_does_not_take_runs_the_torch_op(case: str) -> None:
    """Decode batches, activations that are not fp32 and a decay that grows (Delta A > 0) give the torch op's
    result bit for bit."""
    gen = torch.Generator().manual_seed(0)
    specs = [SeqSpec([0], 5, state_slot=2), SeqSpec([0], 9, state_slot=4)] if case == "decode" else [
        SeqSpec([0] * 20, 3, state_slot=2, checkpoints=[(16, 5)])]  # fmt: skip
    meta = build_forward_batch(specs, block_size=16, chunk_size=16, with_attention=False, with_ssm=True).ssm
    assert meta is not None and meta.is_decode == (case == "decode")
    x, dt, a, b, c, d, bias = inputs(gen, meta.query_start_loc_list[-1], (2, 32, 1, 16), False, "head")
    if case == "bf16":
        x, b, c = x.bfloat16(), b.bfloat16(), c.bfloat16()
    if case == "growing":
        a[1] = 0.5
    fast, slow, _, _ = run_both(ssd_native, ssd, (x, dt, a, b, c, d, bias, True, NO_LIMIT), meta, gen)
    assert all(torch.equal(u, v) for u, v in zip(fast, slow))


def test_slot_outside_the_cache_writes_nothing() -> None:
    gen = torch.Generator().manual_seed(0)
    meta = build_forward_batch([SeqSpec([0] * 20, 0, state_slot=SLOTS + 3)], block_size=16, chunk_size=16,
                               with_attention=False, with_ssm=True).ssm  # fmt: skip
    assert meta is not None
    state = torch.randn(SLOTS, 2, 32, 16, generator=gen)
    before = state.clone()
    with pytest.raises(ValueError, match="outside"):
        ssd_native(*inputs(gen, 20, (2, 32, 1, 16), False, "head"), True, NO_LIMIT, state, meta)
    assert torch.equal(state, before)
