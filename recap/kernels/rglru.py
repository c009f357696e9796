"""The RG-LRU's diagonal linear recurrence (Griffin / RecurrentGemma, arXiv 2402.19427) over packed rows.

Glossary (code name: paper symbol)
- x [T, W]: the gated, normalized input sqrt(1 - a_t^2) (i_t * x_t) (W = lru_width channels; the layer
  prepares it, layers/rglru.py); a [T, W]: the decay a_t in [0, 1] (0 at a sequence start: a reset).
- h [W]: the state; state [S, W] holds one per slot, fp32.
- recurrence: h_t = a_t * h_{t-1} + x_t (in fp32); the output is h_t itself, in x's dtype.

Fast form (rglru_scan): the packed batch is one recurrence once each row's start is fixed up: there a = 0
(nothing crosses from the row before) and x += a h_init (the row's slot state, if it has context). It runs in
blocks of ~sqrt(T) tokens: one pass over the positions inside the blocks (vectorized over blocks and channels,
in place) gives each position's local state l_t and its block's decay product P_t = a_1 ... a_t (products of
numbers in [0, 1]: nothing overflows whatever the decay, where a cumulative-log form would need range guards);
then each block adds P_t times the end state of the block before it. The states at the metadata's chunk ends
are read off the result, so every requested checkpoint position is written (DESIGN invariant 3). Decode
batches take rglru_update (in place).

Measured (T = 2048, W = 2560, one thread, medians of 5 on a loaded 2-core shared machine, so rough): this form
~95-220 ms, about the per-token reference loop (~125-235 ms) and a one-op-per-token loop (~125-140 ms): on a
CPU the recurrence is bound by memory traffic, not by arithmetic. The same blocked scan over the metadata chunks
padded to [C, Q, W] took ~540 ms (its gather into padded chunks and scatter back cost more than the scan).
"""

from __future__ import annotations

import math

import torch

from recap.kernels.metadata import SSMMetadata
from recap.kernels.recurrence_ref import Empty, Step, scan_ref, update_ref
from recap.kernels.varlen import (
    copy_decode_checkpoints,
    decode_rows,
    read_initial,
    record_decode_positions,
    write_ssm_states,
    zero_pad_tokens,
)


def _blocked_scan(x: torch.Tensor, a: torch.Tensor) -> None:
    """h_t = a_t h_{t-1} + x_t from h_0 = 0 over the flattened (blocks, span, w), in place on x (a is consumed)."""
    for q in range(1, x.shape[1]):  # local states and decay products inside every block at once
        x[:, q].addcmul_(a[:, q], x[:, q - 1])
        a[:, q].mul_(a[:, q - 1])
    for b in range(1, x.shape[0]):  # each block continues from the previous block's end state
        x[b].addcmul_(a[b], x[b - 1, -1])


def rglru_scan(
    x: torch.Tensor,
    a: torch.Tensor,
    state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """h [T, W] for packed rows; each row starts from its running slot (if it has context) or zeros, its
    state at every chunk end with a destination slot goes there, its final state to the running slot (decode
    batches included). Padding rows output zeros and touch no slot. Reference: rglru_scan_ref."""
    if meta.is_decode:
        h = rglru_update(x, a, state, meta.state_indices, slot_positions, meta.chunk_end_positions - 1,
                         meta.has_initial_state)  # fmt: skip
        copy_decode_checkpoints(state, meta, slot_positions)
        return h
    t, w = x.shape
    span = math.isqrt(t - 1) + 1  # blocks of ~sqrt(T): as many block passes as position passes
    blocks = -(-t // span)
    hs = torch.zeros(blocks * span, w, dtype=torch.float32, device=x.device)
    decay = torch.ones(blocks * span, w, dtype=torch.float32, device=x.device)
    hs[:t].copy_(x)
    decay[:t].copy_(a)
    starts = meta.query_start_loc[:-1]
    h_rows = read_initial(state, meta.state_indices, meta.has_initial_state)  # (b, w); pad rows: zeros
    hs.index_add_(0, starts, decay.index_select(0, starts).mul_(h_rows))  # x += a h_init at each row start
    decay.index_fill_(0, starts, 0.0)  # and nothing from the row packed before it
    _blocked_scan(hs.view(blocks, span, w), decay.view(blocks, span, w))
    write_ssm_states(state, hs.index_select(0, meta.cu_chunk_seqlens[1:] - 1), meta, slot_positions)
    out = hs[:t]
    zero_pad_tokens(out, meta)
    return out.to(x.dtype)


def rglru_update(
    x: torch.Tensor,
    a: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    slot_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per row: h = a h + x in state[slot], in place (an fp32 cache); PAD rows output zeros.

    positions ([B], the token's absolute position) is required with slot_positions, which records positions + 1
    for every slot written. has_initial_state ([B] bool, optional): rows marked False start from zeros.
    Running slots must be distinct. Reference: rglru_update_ref."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf, af = x.float(), a.float()
    for r, slot, init in decode_rows(state_indices, has_initial_state):
        h = state[slot]
        if init:
            h.mul_(af[r]).add_(xf[r])
        else:
            h.copy_(xf[r])
        out[r] = h
    record_decode_positions(slot_positions, state_indices, positions)
    return out.to(x.dtype)


def rglru_update_ref(
    x: torch.Tensor,
    a: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    slot_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain per-row reference of rglru_update (same signature and side effects)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    update_ref(_stepper(x, a), _zeros(x), out, state, state_indices, slot_positions, positions, has_initial_state)
    return out.to(x.dtype)


def _stepper(x: torch.Tensor, a: torch.Tensor) -> Step:
    def step(h: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        h = a[t].float() * h + x[t].float()
        return h, h

    return step


def _zeros(x: torch.Tensor) -> Empty:
    return lambda: torch.zeros(x.shape[1], device=x.device)


def rglru_scan_ref(
    x: torch.Tensor,
    a: torch.Tensor,
    state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sequential per-token reference of rglru_scan (same signature and side effects)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    scan_ref(_stepper(x, a), _zeros(x), out, state, meta, slot_positions)
    return out.to(x.dtype)
