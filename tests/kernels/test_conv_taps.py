"""The native causal conv taps (kernels/conv_taps.py, csrc/conv_taps.c) against the torch op and the per-token
reference: random packed steps with odd lengths, rows shorter than the window, checkpoints inside chunks, rows with
and without initial state, padding rows (their slots untouched, bit for bit), bias or none, K from 1 to 5; outputs,
every slot's window (bit-exact copies of inputs) and slot_positions asserted."""

from __future__ import annotations

import random

import pytest
import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels import conv_taps
from recap.kernels.batch import build_forward_batch
from recap.kernels.conv1d import causal_conv1d, causal_conv1d_ref
from recap.kernels.conv_taps import causal_conv1d_native, conv_taps_available
from recap.kernels.metadata import SeqSpec
from recap.kernels.native import _cpu_flags

from .test_gdn_walk import SLOTS, random_step

pytestmark = pytest.mark.skipif(not conv_taps_available(), reason="the native kernels do not build here")


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("seed", range(4))
def test_matches_torch_op_and_reference(k: int, seed: int) -> None:
    check_step(k, seed)


@pytest.mark.skipif(" avx512f" not in _cpu_flags(), reason="the AVX-512 build is the only one here")
def test_portable_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain C paths (the build without AVX-512: its silu among them) agree too."""
    lib = conv_taps.conv_taps_library(("-mno-avx512f",))
    monkeypatch.setattr(conv_taps, "conv_taps_library", lambda: lib)
    for seed in range(4):
        check_step(4, 50 + seed)


def check_step(k: int, seed: int) -> None:
    """One random step through the native op, the torch op and the reference, from the same slots."""
    rnd = random.Random(100 * k + seed)
    gen = torch.Generator().manual_seed(rnd.randrange(1 << 30))
    meta, written = random_step(rnd, rnd.choice([16, 32, 64]), rnd.randint(1, 4))
    t, d = meta.query_start_loc_list[-1], rnd.choice([1, 7, 40, 300])
    x, w = torch.randn(t, d, generator=gen), torch.randn(d, k, generator=gen)
    bias = torch.randn(d, generator=gen) if rnd.random() < 0.5 else None
    act = rnd.choice(["silu", "silu", None])
    state = torch.randn(SLOTS, d, k - 1, generator=gen)
    pos = torch.randint(0, 50, (SLOTS,), generator=gen)
    runs = []
    for fn in (causal_conv1d_native, causal_conv1d, causal_conv1d_ref):
        s, p = state.clone(), pos.clone()
        runs.append((fn(x, w, bias, s, meta, act, p), s, p))
    (y, s, p), (y_op, s_op, p_op), (y_ref, s_ref, p_ref) = runs
    torch.testing.assert_close(y, y_op, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(s, s_op) and torch.equal(s, s_ref)  # windows are copies of inputs: bit for bit
    assert torch.equal(p, p_op) and torch.equal(p, p_ref)
    untouched = [i for i in range(SLOTS) if i not in written]
    assert torch.equal(s[untouched], state[untouched]) and torch.equal(p[untouched], pos[untouched])
    qsl = meta.query_start_loc_list
    for r in (meta.state_indices == PAD_SLOT_ID).nonzero().flatten().tolist():
        assert not y[qsl[r] : qsl[r + 1]].any()


def test_bf16_state_runs_the_torch_op() -> None:
    gen = torch.Generator().manual_seed(0)
    meta = build_forward_batch([SeqSpec([0] * 9, 3, state_slot=1)], block_size=16, chunk_size=16,
                               with_attention=False, with_ssm=True).ssm  # fmt: skip
    assert meta is not None
    x, w = torch.randn(9, 5, generator=gen).bfloat16(), torch.randn(5, 4, generator=gen).bfloat16()
    a, b = (torch.randn(3, 5, 3, generator=gen).bfloat16() for _ in range(2))
    b.copy_(a)
    assert torch.equal(causal_conv1d_native(x, w, None, a, meta), causal_conv1d(x, w, None, b, meta))
    assert torch.equal(a, b)


def test_slot_outside_the_cache_writes_nothing() -> None:
    gen = torch.Generator().manual_seed(0)
    meta = build_forward_batch([SeqSpec([0] * 9, 3, state_slot=SLOTS + 1)], block_size=16, chunk_size=16,
                               with_attention=False, with_ssm=True).ssm  # fmt: skip
    assert meta is not None
    state = torch.randn(SLOTS, 5, 3, generator=gen)
    before = state.clone()
    with pytest.raises(ValueError, match="outside"):
        causal_conv1d_native(torch.randn(9, 5, generator=gen), torch.randn(5, 4, generator=gen), None, state, meta)
    assert torch.equal(state, before)


def test_two_threads() -> None:
    """A long row's tokens split over torch's threads give the torch op's result."""
    gen = torch.Generator().manual_seed(3)
    specs = [SeqSpec([0] * 200, 5, state_slot=1, checkpoints=[(64, 2), (133, 3)]), SeqSpec([0] * 70, 0, state_slot=4)]
    meta = build_forward_batch(specs, block_size=16, chunk_size=64, with_attention=False, with_ssm=True).ssm
    assert meta is not None
    x, w, bias = torch.randn(270, 96, generator=gen), torch.randn(96, 4, generator=gen), torch.randn(96, generator=gen)
    state = torch.randn(SLOTS, 96, 3, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        runs = []
        for fn in (causal_conv1d_native, causal_conv1d):
            s, p = state.clone(), torch.zeros(SLOTS, dtype=torch.int64)
            runs.append((fn(x, w, bias, s, meta, "silu", p), s, p))
    finally:
        torch.set_num_threads(threads)
    (y, s, p), (y_op, s_op, p_op) = runs
    torch.testing.assert_close(y, y_op, rtol=1e-5, atol=1e-5)
    assert torch.equal(s, s_op) and torch.equal(p, p_op)
