"""The native Gated DeltaNet decode step (kernels/gdn_step.py) against the module path's torch ops (gdn_step_ref),
gated attention's small decode ops (kernels/decode_ops.py's split_gate and mul_) against torch, and the zero-centred
RMS norm's native kernel against OffsetRMSNorm."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from recap.kernels import decode_ops
from recap.kernels.gdn_step import GdnStep, gdn_step_available, gdn_step_ref
from recap.kernels.native import load_library
from recap.kernels.rms_norm import rms_norm_offset_rows
from recap.model.layers.norm import OffsetRMSNorm

pytestmark = pytest.mark.skipif(
    not (gdn_step_available() and decode_ops.decode_ops_available()), reason="no C compiler for native kernels"
)


def _step(g: torch.Generator, heads: tuple[int, int, int, int], k: int) -> GdnStep:
    hk, hv, dk, dv = heads
    conv_dim = 2 * hk * dk + hv * dv
    return GdnStep(torch.randn(conv_dim, k, generator=g) * 0.5, torch.randn(hv, generator=g),
                   torch.randn(hv, generator=g), torch.randn(dv, generator=g), 1e-6, heads)  # fmt: skip


def _inputs(g: torch.Generator, step: GdnStep, rows: int) -> list[torch.Tensor]:
    _, hv, _, dv = step.heads
    return [torch.randn(rows, w, generator=g) for w in (step.conv_dim, hv * dv, hv, hv)]


@pytest.mark.parametrize(("rows", "heads", "k", "threads"), [
    (1, (1, 1, 4, 3), 2, 1), (3, (2, 6, 12, 10), 4, 1), (8, (2, 4, 16, 8), 4, 2), (5, (3, 3, 7, 33), 5, 2),
    (2, (2, 4, 128, 128), 4, 2),
])  # fmt: skip
def test_gdn_step_matches_the_module_path(rows: int, heads: tuple[int, int, int, int], k: int, threads: int) -> None:
    """Outputs, matrix states and slot positions against the module path's ops on random slots (the conv windows
    bit for bit), over odd head sizes and GQA; slots outside the batch untouched, bit for bit."""
    g = torch.Generator().manual_seed(rows * 100 + k)
    step = _step(g, heads, k)
    slots_n = rows + 3
    conv = torch.randn(slots_n, step.conv_dim, k - 1, generator=g)
    state = torch.randn(slots_n, heads[1], heads[2], heads[3], generator=g) * 0.3
    slots = torch.randperm(slots_n, generator=g)[:rows]
    positions = torch.randint(0, 999, (rows,), generator=g)
    qkv, z, b, a = _inputs(g, step, rows)
    conv_ref, state_ref, conv0, state0 = conv.clone(), state.clone(), conv.clone(), state.clone()
    sp, sp_ref = torch.full((slots_n,), -1), torch.full((slots_n,), -1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = step(qkv, z, b, a, conv, state, slots, positions, sp)
    finally:
        torch.set_num_threads(before)
    want = gdn_step_ref(step, qkv, z, b, a, conv_ref, state_ref, slots, positions, sp_ref)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, state_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv, conv_ref, rtol=0, atol=0)
    torch.testing.assert_close(sp, sp_ref, rtol=0, atol=0)
    others = [s for s in range(slots_n) if s not in slots.tolist()]
    assert torch.equal(state[others], state0[others]) and torch.equal(conv[others], conv0[others])


def test_gdn_step_chain_equals_the_rows_one_at_a_time() -> None:
    """With destination slots (a verify graph's chain): row r reads what row r - 1 wrote; equal to the rows stepped
    one at a time, each from a copy of its source slot."""
    g = torch.Generator().manual_seed(7)
    rows, heads = 4, (2, 4, 9, 6)
    step = _step(g, heads, 4)
    conv = torch.randn(2 * rows, step.conv_dim, 3, generator=g)
    state = torch.randn(2 * rows, *heads[1:], generator=g)
    qkv, z, b, a = _inputs(g, step, rows)
    positions = torch.arange(rows) + 40
    src, dst = torch.tensor([0] + [rows + r for r in range(rows - 1)]), torch.arange(rows) + rows
    sp = torch.full((2 * rows,), -1)
    c1, s1 = conv.clone(), state.clone()
    out = step(qkv, z, b, a, conv, state, src, positions, sp, dst)
    for r in range(rows):
        c1[dst[r]], s1[dst[r]] = c1[src[r]], s1[src[r]]
        one = slice(r, r + 1)
        want = step(qkv[one], z[one], b[one], a[one], c1, s1, dst[one], positions[one], torch.full_like(sp, -1))
        torch.testing.assert_close(out[one], want, rtol=0, atol=0)
    torch.testing.assert_close(state, s1, rtol=0, atol=0)
    torch.testing.assert_close(conv, c1, rtol=0, atol=0)
    assert sp[dst].tolist() == (positions + 1).tolist()


def test_gdn_step_refuses_bad_slots_and_shapes() -> None:
    g = torch.Generator().manual_seed(3)
    step = _step(g, (1, 2, 4, 4), 3)
    conv, state = torch.zeros(3, step.conv_dim, 2), torch.zeros(3, 2, 4, 4)
    qkv, z, b, a = _inputs(g, step, 2)
    for bad in ([0, 3], [-1, 0]):
        with pytest.raises(ValueError, match="outside the cache"):
            step(qkv, z, b, a, conv, state, torch.tensor(bad), torch.zeros(2, dtype=torch.int64),
                 torch.zeros(3, dtype=torch.int64))  # fmt: skip
    assert not conv.any() and not state.any(), "nothing written"
    with pytest.raises(ValueError, match="contiguous fp32"):
        step(qkv[:1], z, b, a, conv, state, torch.tensor([0, 1]), torch.zeros(2, dtype=torch.int64),
             torch.zeros(3, dtype=torch.int64))  # fmt: skip
    with pytest.raises(ValueError, match="does not run them"):
        GdnStep(torch.zeros(2 * 2 * 4 + 3 * 4, 3), torch.zeros(3), torch.zeros(3), torch.zeros(4), 1e-6, (2, 3, 4, 4))


@pytest.mark.parametrize("flags", [(), ("-mno-avx512f",), ("-mno-avx2",)])
@pytest.mark.parametrize(("rows", "heads", "dh"), [(1, 1, 1), (3, 4, 16), (2, 5, 37)])
def test_split_gate_and_mul_match_torch(rows: int, heads: int, dh: int, flags: tuple[str, ...]) -> None:
    """q_proj's [q | gate] per head split, sigmoid(gate) to fp32 rounding (built for AVX-512, AVX2 and neither:
    each its own exp), and the gate's product exactly."""
    if "-mno-avx512f" in flags and "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("no AVX2 here")
    g = torch.Generator().manual_seed(heads * dh)
    x = torch.randn(rows, heads * 2 * dh, generator=g) * 6
    q, gate = torch.empty(rows, heads * dh), torch.empty(rows, heads * dh)
    p = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    load_library("decode_ops", flags).recap_split_gate_f32(p(x), ctypes.c_int64(rows), ctypes.c_int64(heads),
                                                           ctypes.c_int64(dh), p(q), p(gate))  # fmt: skip
    q_ref, gate_ref = x.view(rows, heads, 2 * dh).chunk(2, dim=-1)
    torch.testing.assert_close(q, q_ref.reshape(rows, -1), rtol=0, atol=0)
    torch.testing.assert_close(gate, torch.sigmoid(gate_ref.reshape(rows, -1)), rtol=1e-6, atol=1e-7)
    if not flags:
        torch.testing.assert_close(decode_ops.split_gate(x, heads, dh)[1], gate, rtol=0, atol=0)
    h = torch.randn(rows, heads * dh, generator=g)
    torch.testing.assert_close(decode_ops.mul_(h.clone(), gate), h * gate, rtol=0, atol=0)


@pytest.mark.parametrize(("rows", "d"), [(1, 1), (3, 16), (2, 37), (8, 1024)])
def test_offset_rms_norm_matches_the_module(rows: int, d: int) -> None:
    """The zero-centred norm's native kernel (x / rms(x) * (1 + w)) against OffsetRMSNorm's torch ops, to fp32
    rounding (the sum of squares in another order)."""
    g = torch.Generator().manual_seed(d)
    norm = OffsetRMSNorm(d, 1e-6, torch.float32)
    norm.weight.data = torch.randn(d, generator=g) * 0.3
    x = torch.randn(rows, d, generator=g) * 3
    torch.testing.assert_close(rms_norm_offset_rows(x, norm.weight, 1e-6), norm(x), rtol=1e-5, atol=1e-6)
