"""MiniMax's lightning attention is SSD with dt = 1, A = -slope, B = k, C = q, x = v (layers/lightning.py): the
SSD kernels against the plain recurrence S_t = lam S_{t-1} + k_t^T v_t, o_t = q_t S_t, with block-boundary
checkpoints and a continuation from a nonzero state (random sizes, fresh seeds)."""

from __future__ import annotations

import math

import pytest
import torch

from recap.kernels.ssd import ssd, ssd_ref

from .cases import Row, build_meta

NO_LIMIT = (0.0, math.inf)


def _recurrence(q, k, v, lam, s0):  # noqa: ANN001, ANN202
    """o [T, H, d], states after each token [T, H, dk, dv] of S_t = lam S_{t-1} + k_t^T v_t, o_t = q_t S_t."""
    s, outs, states = s0.clone(), [], []
    for t in range(q.shape[0]):
        s = lam[:, None, None] * s + k[t][:, :, None] * v[t][:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], s))
        states.append(s)
    return torch.stack(outs), torch.stack(states)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kernel", [ssd, ssd_ref])
def test_lightning_recurrence_is_ssd(seed: int, kernel) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(seed)
    heads, d = 3, 5 + seed
    ctx, n = 16 * seed, 37 + 16 * seed  # a continuation (seed > 0) over several blocks, odd length
    q, k, v = (torch.randn(n, heads, d, generator=gen) for _ in range(3))
    slope = torch.rand(heads, generator=gen) * 0.5 + 0.01
    s0 = torch.randn(heads, d, d, generator=gen) if ctx else torch.zeros(heads, d, d)
    cps = [p for p in range(16 * (ctx // 16 + 1), ctx + n + 1, 16)]  # every block boundary
    state = torch.zeros(2 + len(cps), heads, d, d)  # SSD's [H, P = dv, N = dk]: S transposed
    state[1] = s0.transpose(1, 2)
    rows = [Row({"x": torch.zeros(n)}, ctx, 1, [(p, 2 + j) for j, p in enumerate(cps)])]
    slot_positions = torch.full((state.shape[0],), -1, dtype=torch.long)
    y = kernel(v, torch.ones(n, heads), -slope, k, q, None, None, False, NO_LIMIT, state, build_meta(rows, 64),
               slot_positions=slot_positions)  # fmt: skip
    want, states = _recurrence(q, k, v, torch.exp(-slope), s0)
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state[1], states[-1].transpose(1, 2), atol=1e-4, rtol=1e-4)
    for j, p in enumerate(cps):
        torch.testing.assert_close(state[2 + j], states[p - ctx - 1].transpose(1, 2), atol=1e-4, rtol=1e-4)
        assert int(slot_positions[2 + j]) == p
