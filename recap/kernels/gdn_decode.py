"""Gated delta rule decode: one token per row, the matrix state updated in its slot (glossary: gdn.py).

    S = Diag(alpha) S;  S += k (beta (v - S^T k))^T;  o = S^T q      (per value head; S is [Dk, Dv])

alpha = exp(g) is one decay per head (GDN, g [B, Hv]) or per key channel (KDA, g [B, Hv, Dk]).
gated_delta_rule_update is the fast path (called by gated_delta_rule on decode batches): rows whose
running slots are consecutive are updated as one batch straight in their slice of the state tensor (no
gather, no scatter). gated_delta_rule_update_ref is its plain per-row twin, same signature and side effects.
"""

from __future__ import annotations

import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.varlen import decode_rows, record_decode_positions


def expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[T, Hk, D] -> [T, heads, D]: each key head serves heads // Hk consecutive value heads."""
    hk = x.shape[1]
    if heads % hk:
        raise ValueError(f"{heads} value heads are not a multiple of {hk} key heads")
    return x if hk == heads else x.repeat_interleave(heads // hk, dim=1)


def decay_factor(g: torch.Tensor, heads_dim: int) -> torch.Tensor:
    """exp(g) shaped to scale states [..., H, Dk, Dv]: g [..., H] (per head) or [..., H, Dk] (per channel),
    where heads_dim is g's head dimension."""
    a = g.float().exp()
    return a[..., None, None] if g.dim() == heads_dim + 1 else a[..., None]


def slot_runs(rows: list[tuple[int, int, bool]]) -> list[tuple[int, int, int]]:
    """(first row, first slot, length) of each run of consecutive rows on consecutive slots (decode_rows' rows)."""
    runs: list[list[int]] = []
    for r, s, _ in rows:
        if runs and r == runs[-1][0] + runs[-1][2] and s == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([r, s, 1])
    return [(r, s, n) for r, s, n in runs]


def gated_delta_rule_update(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_indices: torch.Tensor,
    slot_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per row: q, k [B, Hk, Dk], v [B, Hv, Dv], g [B, Hv] or [B, Hv, Dk], beta [B, Hv];
    state [S, Hv, Dk, Dv].

    Updates state[slot] of every valid row in place and returns o [B, Hv, Dv] (zeros for PAD rows).
    positions ([B], the token's absolute position) is required with slot_positions, which records
    positions + 1. has_initial_state (optional [B] bool): rows marked False start from a zero state.
    Running slots must be distinct.
    """
    b, hv, dv = v.shape
    if hv % k.shape[1]:
        raise ValueError(f"{hv} value heads are not a multiple of {k.shape[1]} key heads")
    y = torch.zeros(b, hv, dv, dtype=torch.float32, device=v.device)
    rows = decode_rows(state_indices, has_initial_state)
    in_place = state.dtype == torch.float32 and state.is_contiguous()
    fresh = {r for r, _, init in rows if not init}
    for r, s, n in slot_runs(rows):
        view = state[s : s + n]  # (n, h, dk, dv), the slots themselves
        work = view if in_place else view.float()
        for j in range(n):
            if r + j in fresh:
                work[j].zero_()
        rs = slice(r, r + n)
        y[rs] = _step(work, q[rs], k[rs], v[rs], g[rs], beta[rs])
        if not in_place:
            view.copy_(work)
    record_decode_positions(slot_positions, state_indices, positions)
    return y.to(v.dtype)


def _step(
    s: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """One token on states s [n, Hv, Dk, Dv] (contiguous fp32, updated in place) -> o [n, Hv, Dv]."""
    n, hv, dk, dv = s.shape
    hk = k.shape[1]
    s.mul_(decay_factor(g, 1))
    flat = s.view(n * hv, dk, dv)

    def heads(x: torch.Tensor) -> torch.Tensor:  # (n, hk, dk) -> (n * hv, 1, dk) fp32, GQA expanded
        return x.float()[:, :, None, :].expand(n, hk, hv // hk, dk).reshape(n * hv, 1, dk)

    kf = heads(k)
    delta = torch.baddbmm(v.float().reshape(n * hv, 1, dv), kf, flat, alpha=-1.0)  # v - S^T k
    delta.mul_(beta.float().reshape(n * hv, 1, 1))
    flat.baddbmm_(kf.transpose(1, 2), delta)  # S += k delta^T
    return torch.bmm(heads(q), flat).view(n, hv, dv)


def gated_delta_rule_update_ref(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_indices: torch.Tensor,
    slot_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain per-row reference of gated_delta_rule_update (same signature and side effects)."""
    b, hv, dv = v.shape
    out = torch.zeros(b, hv, dv, dtype=v.dtype, device=v.device)
    qf, kf = expand_heads(q, hv).float(), expand_heads(k, hv).float()
    for row, slot in enumerate(state_indices.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        s = torch.zeros(state.shape[1:], device=v.device)
        if has_initial_state is None or bool(has_initial_state[row]):
            s = state[slot].float()
        alpha = decay_factor(g[row], 0)  # (h, 1, 1) or (h, dk, 1)
        for h in range(hv):
            sh = s[h] * alpha[h]  # (dk, dv)
            delta = (v[row, h].float() - kf[row, h] @ sh) * beta[row, h].float()
            sh = sh + torch.outer(kf[row, h], delta)
            out[row, h] = (qf[row, h] @ sh).to(v.dtype)
            s[h] = sh
        state[slot] = s.to(state.dtype)
        if slot_positions is not None:
            if positions is None:
                raise ValueError("slot_positions needs positions")
            slot_positions[slot] = positions[row] + 1
    return out
