"""Gated delta rule decode: one token per row, the matrix state updated in its slot (glossary: gdn.py).

    S = alpha S;  S += k (beta (v - S^T k))^T;  o = S^T q      (per value head; S is [Dk, Dv])

gated_delta_rule_update is the fast path (called by the GDN layer and by gated_delta_rule_varlen on decode
batches); gated_delta_rule_update_ref is its plain per-row twin, with the same signature and side effects.
"""

from __future__ import annotations

import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.varlen import decode_rows, gather_decode_states, record_decode_positions


def expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[T, Hk, D] -> [T, heads, D]: each key head serves heads // Hk consecutive value heads."""
    hk = x.shape[1]
    if heads % hk:
        raise ValueError(f"{heads} value heads are not a multiple of {hk} key heads")
    return x if hk == heads else x.repeat_interleave(heads // hk, dim=1)


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
    """One decode token per row: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv]; state [S, Hv, Dk, Dv].

    Updates state[slot] of every valid row in place and returns o [B, Hv, Dv] (zeros for PAD rows).
    positions ([B], the token's absolute position) is required with slot_positions, which records
    positions + 1. has_initial_state (optional [B] bool): rows marked False start from a zero state.
    Running slots must be distinct. Fast path: the valid rows' states gathered once, updated with batched
    GEMVs over (row, head), scattered back with one index_copy_.
    """
    b, hv, dv = v.shape
    y = torch.zeros(b, hv, dv, dtype=torch.float32, device=v.device)
    rows = decode_rows(state_indices, has_initial_state)
    if rows:
        keep, slots, s = gather_decode_states(state, rows)  # s: (n, h, dk, dv)
        n = len(rows)
        qf = expand_heads(q, hv).float().index_select(0, keep)  # (n, h, dk)
        kf = expand_heads(k, hv).float().index_select(0, keep)
        s.mul_(g.float().index_select(0, keep).exp()[..., None, None])
        flat = s.view(n * hv, -1, dv)
        kv_mem = torch.bmm(kf.view(n * hv, 1, -1), flat).view(n, hv, dv)  # S^T k
        delta = (v.float().index_select(0, keep) - kv_mem).mul_(beta.float().index_select(0, keep)[..., None])
        flat.baddbmm_(kf.view(n * hv, -1, 1), delta.view(n * hv, 1, dv))  # S += k delta^T
        o = torch.bmm(qf.view(n * hv, 1, -1), flat).view(n, hv, dv)
        y.index_copy_(0, keep, o)
        state.index_copy_(0, slots, s.to(state.dtype))
    record_decode_positions(slot_positions, state_indices, positions)
    return y.to(v.dtype)


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
        for h in range(hv):
            sh = s[h] * g[row, h].float().exp()  # (dk, dv)
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
