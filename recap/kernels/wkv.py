"""RWKV-4's WKV recurrence (the time-mix "linear attention", arXiv 2305.13048) over packed rows.

Glossary (code name: paper symbol)
- k, v [T, A]: keys and values (A = attention_hidden_size channels); w [A]: the per-channel log decay
  (-exp(time_decay), < 0); u [A]: the bonus of the current token (time_first).
- state [S, 3, A] (fp32), one (num, den, max) per slot: num = a e^p, den = b e^p are the decayed sums
  sum_s e^{w (t - s) + k_s} v_s and sum_s e^{w (t - s) + k_s}, kept as (a, b, p) so nothing overflows
  (transformers' rwkv_linear_attention_cpu layout; an empty state has p = -1e38).
- out_t = (num_{t-1} + e^{u + k_t} v_t) / (den_{t-1} + e^{u + k_t}); state_t = e^w state_{t-1} + e^{k_t} (v_t, 1).

Fast form (wkv_scan): every token is a triple (v, 1, k) in (a, b, p) form and one step is
combine(state decayed by ld, token), ld = w, except at a row start, where the row's slot state (or the empty
state) is folded into the token and ld = -1e38, so nothing crosses from the row packed before it. It runs in
blocks of ~sqrt(T) tokens, as kernels/rglru.py does: one pass over the positions inside the blocks (vectorized
over blocks and channels) gives each position's local state and its block's summed log decay, then each block
merges the end state of the block before it. The states at the metadata's chunk ends are read off the result,
so every requested checkpoint position is written (DESIGN invariant 3). Decode batches take wkv_update.

Measured (one thread, one row with a checkpoint every 16 tokens, A = 768, medians of 3 on a loaded 2-core shared
machine, so rough): T = 2048 ~480 ms vs ~1020 ms for the per-token reference; T = 512 ~75 ms vs ~220 ms. As for
the RG-LRU, the CPU recurrence is bound by memory traffic (each step reads and writes three [blocks, A] planes).
"""

from __future__ import annotations

import functools
import math

import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.metadata import SSMMetadata
from recap.kernels.recurrence_ref import Step, scan_ref, update_ref
from recap.kernels.varlen import (
    copy_decode_checkpoints,
    decode_rows,
    read_initial,
    record_decode_positions,
    write_ssm_states,
    zero_pad_tokens,
)

NEG = -1e38  # the empty state's max exponent and a reset's log decay (finite: no inf - inf anywhere)


def _combine(a1, b1, p1, ld, a2, b2, p2):  # noqa: ANN001, ANN202 (tensors; one step of the recurrence)
    """(a1, b1, p1) decayed by e^ld, plus (a2, b2, p2): transformers' update written on triples."""
    decayed = p1 + ld
    p = torch.maximum(decayed, p2)
    e1, e2 = torch.exp(decayed - p), torch.exp(p2 - p)
    return e1 * a1 + e2 * a2, e1 * b1 + e2 * b2, p


def _initial(state: torch.Tensor, meta: SSMMetadata) -> torch.Tensor:
    """fp32 [B, 3, A]: each row's slot state, or the empty state (0, 0, -1e38) where it has none."""
    init = read_initial(state, meta.state_indices, meta.has_initial_state)
    use = meta.has_initial_state.to(torch.bool) & (meta.state_indices != PAD_SLOT_ID)
    init[:, 2].masked_fill_(~use[:, None], NEG)
    return init


def _output(prev: torch.Tensor, k: torch.Tensor, v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """out [N, A] from the states before each token (prev [N, 3, A]) and the tokens' k, v (fp32)."""
    uk = u + k
    p = torch.maximum(prev[:, 2], uk)
    e1, e2 = torch.exp(prev[:, 2] - p), torch.exp(uk - p)
    return (e1 * prev[:, 0] + e2 * v) / (e1 * prev[:, 1] + e2)


def _blocked_scan(s: torch.Tensor, ld: torch.Tensor) -> None:
    """Every position's state from its tokens s [blocks, span, 3, A] (in place) and log decays ld
    [blocks, span, A] (consumed: it becomes the block's summed log decay up to each position)."""
    for q in range(1, s.shape[1]):  # local states inside every block at once, from the empty state
        prev, tok = s[:, q - 1], s[:, q]
        a, b, p = _combine(prev[:, 0], prev[:, 1], prev[:, 2], ld[:, q], tok[:, 0], tok[:, 1], tok[:, 2])
        tok[:, 0], tok[:, 1], tok[:, 2] = a, b, p
        ld[:, q].add_(ld[:, q - 1]).clamp_(min=NEG)
    for blk in range(1, s.shape[0]):  # each block merges the previous block's end state, decayed to each position
        carry, loc = s[blk - 1, -1], s[blk]
        a, b, p = _combine(carry[0], carry[1], carry[2], ld[blk], loc[:, 0], loc[:, 1], loc[:, 2])
        loc[:, 0], loc[:, 1], loc[:, 2] = a, b, p


def wkv_scan(
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [T, A] for packed rows; each row starts from its running slot (if it has context) or the empty state,
    its state at every chunk end with a destination slot goes there, its final state to the running slot (decode
    batches included). Padding rows output zeros and touch no slot. Reference: wkv_scan_ref."""
    if meta.is_decode:
        out = wkv_update(k, v, w, u, state, meta.state_indices, slot_positions, meta.chunk_end_positions - 1,
                         meta.has_initial_state)  # fmt: skip
        copy_decode_checkpoints(state, meta, slot_positions)
        return out
    t, a = k.shape
    span = math.isqrt(t - 1) + 1  # blocks of ~sqrt(T): as many block passes as position passes
    blocks = -(-t // span)
    kf, vf, wf = k.float(), v.float(), w.float()
    s = torch.zeros(blocks * span, 3, a, dtype=torch.float32, device=k.device)
    s[:, 2] = NEG  # positions past T: empty tokens
    s[:t, 0], s[:t, 1], s[:t, 2] = vf, 1.0, kf
    ld = wf.expand(blocks * span, a).clone()
    starts = meta.query_start_loc[:-1]
    init = _initial(state, meta)  # (b, 3, a)
    first = s.index_select(0, starts)  # each row's first token, with its initial state folded in
    fa, fb, fp = _combine(init[:, 0], init[:, 1], init[:, 2], wf, first[:, 0], first[:, 1], first[:, 2])
    s.index_copy_(0, starts, torch.stack((fa, fb, fp), dim=1))
    ld.index_fill_(0, starts, NEG)  # nothing from the row packed before it
    _blocked_scan(s.view(blocks, span, 3, a), ld.view(blocks, span, a))
    prev = torch.cat((s[:1], s[: t - 1]))  # the state before each token: the one after the token before it
    prev.index_copy_(0, starts, init)  # ... or, at a row start, the row's initial state
    out = _output(prev, kf, vf, u.float())
    write_ssm_states(state, s.index_select(0, meta.cu_chunk_seqlens[1:] - 1), meta, slot_positions)
    zero_pad_tokens(out, meta)
    return out.to(k.dtype)


def wkv_update(
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    slot_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per row: the output from state[slot], then the slot steps once, in place; PAD rows output
    zeros. positions ([B], the tokens' absolute positions) is required with slot_positions, which records
    positions + 1 for every slot written. has_initial_state ([B] bool, optional): rows marked False start from the
    empty state. Running slots must be distinct. Reference: wkv_update_ref."""
    out = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    rows = decode_rows(state_indices, has_initial_state)
    if rows:
        dev = k.device
        keep = torch.tensor([r for r, _, _ in rows], device=dev)
        slots = torch.tensor([s for _, s, _ in rows], device=dev)
        prev = state.index_select(0, slots).float()
        fresh = torch.tensor([not init for _, _, init in rows], device=dev)
        prev[fresh] = torch.tensor([0.0, 0.0, NEG], device=dev)[:, None]
        kf, vf = k.index_select(0, keep).float(), v.index_select(0, keep).float()
        out.index_copy_(0, keep, _output(prev, kf, vf, u.float()))
        na, nb, np_ = _combine(prev[:, 0], prev[:, 1], prev[:, 2], w.float(), vf, torch.ones_like(kf), kf)
        state.index_copy_(0, slots, torch.stack((na, nb, np_), dim=1).to(state.dtype))
    record_decode_positions(slot_positions, state_indices, positions)
    return out.to(k.dtype)


def _step_ref(h: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor):  # noqa: ANN202
    """One token as transformers' CPU loop writes it: (output, next state), h = (num, den, max)."""
    num, den, mx = h
    m_out = torch.maximum(mx, k + u)
    e1, e2 = torch.exp(mx - m_out), torch.exp(k + u - m_out)
    y = (e1 * num + e2 * v) / (e1 * den + e2)
    m_state = torch.maximum(mx + w, k)
    e1, e2 = torch.exp(mx + w - m_state), torch.exp(k - m_state)
    return y, torch.stack((e1 * num + e2 * v, e1 * den + e2, m_state))


def _empty(a: int, device: torch.device) -> torch.Tensor:
    """The empty state (0, 0, -1e38) as transformers starts a sequence."""
    z = torch.zeros(a, device=device)
    return torch.stack((z, z, torch.full((a,), NEG, device=device)))


def wkv_update_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    slot_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain per-row reference of wkv_update (same signature and side effects)."""
    out = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    empty = functools.partial(_empty, k.shape[1], k.device)
    update_ref(_stepper(k, v, w, u), empty, out, state, state_indices, slot_positions, positions, has_initial_state)
    return out.to(k.dtype)


def _stepper(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor) -> Step:
    wf, uf = w.float(), u.float()
    return lambda h, t: _step_ref(h, k[t].float(), v[t].float(), wf, uf)


def wkv_scan_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sequential per-token reference of wkv_scan (same signature and side effects)."""
    out = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    scan_ref(_stepper(k, v, w, u), functools.partial(_empty, k.shape[1], k.device), out, state, meta, slot_positions)
    return out.to(k.dtype)
