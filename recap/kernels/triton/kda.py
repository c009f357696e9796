"""Triton kernels for Kimi Delta Attention (GPU twins of recap/kernels/kda.py; glossary there): the gated
delta rule kernel of triton/gdn.py with the decay per key channel (g [T, H, K]), and KDA's input preparation
(q and k L2-normalised, q scaled by K^-1/2) done in the kernel on each loaded tile. Like GDN, steps of
CHUNK_MIN_TOKENS tokens or more (not decode batches) take the chunk-parallel form (triton/gdn_chunk.py).
"""

from __future__ import annotations

import torch

from recap.kernels.metadata import SSMMetadata
from recap.kernels.triton.gdn import gated_delta_rule, run_update


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
    return gated_delta_rule(q, k, v, g, beta, state, meta, slot_positions, normalize_qk=True)


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
    return run_update(q, k, v, g, beta, state, state_indices, slot_positions, positions, has_initial_state, True)
