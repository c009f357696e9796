"""The native gated delta rule prefill (kernels/gdn_walk.py, csrc/gdn_walk.c) against the torch chunk form and the
per-token reference: random packed steps with odd lengths straddling pieces and the chunk grid, checkpoints inside
chunks, rows with and without initial state, padding rows (their slots untouched, bit for bit), GQA, KDA's
per-channel decay; outputs, every slot's state and slot_positions asserted."""

from __future__ import annotations

import random

import pytest
import torch

from recap.kernels import gdn_walk
from recap.kernels.batch import build_forward_batch
from recap.kernels.gdn import gated_delta_rule, gated_delta_rule_ref, normalize_qk_inputs
from recap.kernels.gdn_walk import gated_delta_rule_native, gdn_walk_available, kda_native
from recap.kernels.kda import kda, kda_ref
from recap.kernels.metadata import SeqSpec, SSMMetadata
from recap.kernels.native import _cpu_flags
from tests.kernels import walk_steps
from tests.kernels.walk_steps import SLOTS, assert_step, random_step

pytestmark = pytest.mark.skipif(not gdn_walk_available(), reason="the native kernels do not build here")


def inputs(gen: torch.Generator, t: int, heads: tuple[int, int, int, int], per_channel: bool) -> tuple:
    hk, hv, dk, dv = heads
    q, k = (torch.randn(t, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, *((dk,) if per_channel else ()), generator=gen) * 1.5
    return q, k, v, g, torch.rand(t, hv, generator=gen)


def run_both(fast, slow, args: tuple, meta: SSMMetadata, heads: tuple[int, ...], gen: torch.Generator, **kw) -> tuple:
    """walk_steps.run_both with states of (Hv, Dk, Dv)."""
    return walk_steps.run_both(fast, slow, args, meta, tuple(heads[1:4]), 0.3, gen, **kw)


HEADS = [(1, 1, 8, 8), (2, 4, 16, 32), (2, 2, 32, 20), (1, 3, 64, 64)]  # (Hk, Hv, Dk, Dv): GQA; Dv off the 32 grid


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "x".join(map(str, h)))
@pytest.mark.parametrize("seed", range(3))
def test_matches_torch_chunk_form(per_channel: bool, heads: tuple[int, int, int, int], seed: int) -> None:
    rnd = random.Random(1000 * seed + sum(heads) + per_channel)
    gen = torch.Generator().manual_seed(rnd.randrange(1 << 30))
    meta, written = random_step(rnd, rnd.choice([16, 32, 64]), rnd.randint(1, 4))
    args = inputs(gen, meta.query_start_loc_list[-1], heads, per_channel)
    normalize = rnd.random() < 0.7
    if not normalize:  # the kernel takes them normalised (unnormalised keys make the delta rule diverge)
        args = (*normalize_qk_inputs(*args[:2]), *args[2:])
    fast, slow, before, pos = run_both(gated_delta_rule_native, gated_delta_rule, args, meta, heads, gen,
                                       normalize_qk=normalize)  # fmt: skip
    assert_step(fast, slow, before, pos, written, meta)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
@pytest.mark.parametrize("seed", range(2))
def test_matches_per_token_reference(per_channel: bool, seed: int) -> None:
    rnd = random.Random(seed + 77)
    gen = torch.Generator().manual_seed(rnd.randrange(1 << 30))
    heads = (2, 4, 16, 16)
    meta, written = random_step(rnd, 32, 3)
    args = inputs(gen, meta.query_start_loc_list[-1], heads, per_channel)
    fast, slow, before, pos = run_both(gated_delta_rule_native, gated_delta_rule_ref, args, meta, heads, gen,
                                       normalize_qk=True)  # fmt: skip
    assert_step(fast, slow, before, pos, written, meta, tol=1e-4)


@pytest.mark.parametrize("seed", range(2))
def test_kda_matches_reference(seed: int) -> None:
    rnd = random.Random(seed + 5)
    gen = torch.Generator().manual_seed(rnd.randrange(1 << 30))
    heads = (3, 3, 16, 24)
    meta, written = random_step(rnd, 16, 3)
    args = inputs(gen, meta.query_start_loc_list[-1], heads, True)
    fast, slow, before, pos = run_both(kda_native, kda_ref, args, meta, heads, gen)
    assert_step(fast, slow, before, pos, written, meta, tol=1e-4)
    fast, slow, before, pos = run_both(kda_native, kda, args, meta, heads, gen)
    assert_step(fast, slow, before, pos, written, meta)


@pytest.mark.parametrize("piece", [1, 7, 16, 64])
def test_piece_sizes(piece: int) -> None:
    rnd = random.Random(piece)
    gen = torch.Generator().manual_seed(piece)
    heads = (2, 2, 8, 32)
    meta, written = random_step(rnd, 64, 3)
    args = inputs(gen, meta.query_start_loc_list[-1], heads, False)
    fast, slow, before, pos = run_both(gated_delta_rule_native, gated_delta_rule, args, meta, heads, gen,
                                       piece=piece, normalize_qk=True)  # fmt: skip
    assert_step(fast, slow, before, pos, written, meta)


@pytest.mark.skipif(" avx512f" not in _cpu_flags(), reason="the AVX-512 build is the only one here")
def test_portable_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain C paths (the build without AVX-512) agree too."""
    lib = gdn_walk.gdn_walk_library(("-mno-avx512f",))
    monkeypatch.setattr(gdn_walk, "gdn_walk_library", lambda: lib)
    for per_channel in (False, True):
        rnd = random.Random(3 + per_channel)
        gen = torch.Generator().manual_seed(int(per_channel))
        heads = (2, 4, 16, 64)
        meta, written = random_step(rnd, 32, 3)
        args = inputs(gen, meta.query_start_loc_list[-1], heads, per_channel)
        fast, slow, before, pos = run_both(gated_delta_rule_native, gated_delta_rule, args, meta, heads, gen,
                                           normalize_qk=True)  # fmt: skip
        assert_step(fast, slow, before, pos, written, meta)


def test_decode_batch_runs_the_torch_op() -> None:
    gen = torch.Generator().manual_seed(0)
    specs = [SeqSpec([0], 5, state_slot=2), SeqSpec([0], 9, state_slot=4)]
    meta = build_forward_batch(specs, block_size=16, chunk_size=16, with_attention=False, with_ssm=True).ssm
    assert meta is not None and meta.is_decode
    heads = (1, 2, 8, 8)
    fast, slow, before, pos = run_both(gated_delta_rule_native, gated_delta_rule, inputs(gen, 2, heads, False), meta,
                                       heads, gen)  # fmt: skip
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1]) and torch.equal(fast[2], slow[2])


def test_slot_outside_the_cache_writes_nothing() -> None:
    gen = torch.Generator().manual_seed(0)
    meta = build_forward_batch([SeqSpec([0] * 20, 0, state_slot=SLOTS + 3)], block_size=16, chunk_size=16,
                               with_attention=False, with_ssm=True).ssm  # fmt: skip
    assert meta is not None
    heads = (1, 1, 8, 8)
    state = torch.randn(SLOTS, 1, 8, 8, generator=gen)
    before = state.clone()
    with pytest.raises(ValueError, match="outside"):
        gated_delta_rule_native(*inputs(gen, 20, heads, False), state, meta)
    assert torch.equal(state, before)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
def test_two_threads(per_channel: bool) -> None:
    """Value heads split over torch's threads give the single thread's result."""
    rnd = random.Random(11 + per_channel)
    gen = torch.Generator().manual_seed(int(per_channel))
    heads = (2, 6, 16, 32)
    meta, written = random_step(rnd, 32, 3)
    args = inputs(gen, meta.query_start_loc_list[-1], heads, per_channel)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        fast, slow, before, pos = run_both(gated_delta_rule_native, gated_delta_rule, args, meta, heads, gen,
                                           normalize_qk=True)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert_step(fast, slow, before, pos, written, meta)
