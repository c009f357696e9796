"""Kimi Delta Attention (KDA, Kimi Linear, arXiv 2510.26692): the gated delta rule with a per-channel decay.

Glossary (code name: symbol), per head
- q, k [T, H, K]: queries and keys (L2-normalised here, in fp32; q also scaled by K^-1/2); v [T, H, V].
- g [T, H, K]: log of the per-channel forget gate alpha_t (<= 0); beta [T, H]: the write strength in (0, 1).
- S [H, K, V]: the state; state [S, H, K, V] holds one per slot, fp32.
- recurrence:  S_t = Diag(exp g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t.
  (Gated DeltaNet is the special case of g constant across the K channels.)

The kernels are Gated DeltaNet's (kernels/gdn.py: chunked prefill with states at every chunk end, written
straight into their slots; kernels/gdn_decode.py: the in-place decode update), which take the decay per
channel; this module adds KDA's input preparation (the L2 norms and the query scale) in front of each.
"""

from __future__ import annotations

import torch

from recap.kernels.gdn import gated_delta_rule, gated_delta_rule_ref, l2_normalize
from recap.kernels.gdn_decode import gated_delta_rule_update, gated_delta_rule_update_ref
from recap.kernels.metadata import SSMMetadata


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> tuple:
    """fp32 inputs; q and k L2-normalised, q scaled by K^-1/2."""
    qf, kf = l2_normalize(q), l2_normalize(k)
    return qf * q.shape[-1] ** -0.5, kf, v.float(), g.float(), beta.float()


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed rows: o [T, H, V]; each row starts from its running slot (if it has context) or zeros, its
    state at every chunk end with a destination slot goes there, its final state to the running slot (decode
    batches included). Padding rows output zeros and touch no slot. Reference: kda_ref."""
    return gated_delta_rule(*_prepare(q, k, v, g, beta), state, meta, slot_positions).to(v.dtype)


def kda_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sequential per-token reference of kda (same signature and side effects)."""
    return gated_delta_rule_ref(*_prepare(q, k, v, g, beta), state, meta, slot_positions).to(v.dtype)


def kda_state_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    slot_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per row [B, ...], in state[slot] in place; PAD rows output zeros. positions ([B], the
    token's absolute position) is required with slot_positions, which records positions + 1. Reference:
    kda_state_update_ref."""
    args = _prepare(q, k, v, g, beta)
    return gated_delta_rule_update(state, *args, state_indices, slot_positions, positions, has_initial_state).to(
        v.dtype
    )


def kda_state_update_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    slot_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain per-row reference of kda_state_update (same signature and side effects)."""
    args = _prepare(q, k, v, g, beta)
    return gated_delta_rule_update_ref(state, *args, state_indices, slot_positions, positions, has_initial_state).to(
        v.dtype
    )
