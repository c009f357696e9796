"""xLSTM's mLSTM recurrence (the matrix-memory cell, arXiv 2405.04517 / xLSTM-7B) over packed rows.

Glossary (code name: paper symbol)
- q, k [T, H, K], v [T, H, V]: queries, keys, values per head; q is scaled by K^-1/2 inside.
- i, f [T, H]: the input and forget gate pre-activations (already soft-capped by the layer); lf = logsigmoid(f).
- state [S, H, K*V + K + 1] fp32, one per head: the memory C [K, V] (flattened), the normalizer n [K] and the
  stabilizer m (a scalar), kept as transformers keeps them: C and n divided by e^m. An empty state is all zeros
  (m = 0, as transformers starts a sequence).
- one step: m_t = max(lf_t + m_{t-1}, i_t); C_t = e^{lf_t + m_{t-1} - m_t} C_{t-1} + e^{i_t - m_t} k_t v_t^T (n_t
  alike with k_t); h_t = q_t C_t / (max(|q_t n_t|, e^{-m_t}) + eps). m is not only numerical: the eps term is
  eps e^{m_t} against the unscaled state, so m follows transformers' definition exactly. Unrolled, m_t is the
  max over the tokens j <= t of i_j + (lf_{j+1} + ... + lf_t), and of m_start + (lf_1 + ... + lf_t): that is
  also what transformers' chunkwise kernel computes, so one definition serves both of its paths.

Fast form (mlstm_scan): chunkwise-parallel inside the metadata's chunks (which already end at every checkpoint
position, the grid and each row's end): each chunk's own end state from zero and its in-chunk outputs are
batched matrix products over all chunks at once (b = cumsum(lf) inside the chunk); then one short loop over
chunk ranks (the k-th chunk of every row together) chains the chunk states, and the outputs add each chunk's
start state through q. Every chunk end with a destination slot is written (DESIGN invariant 3). Decode batches
take mlstm_update. mlstm_scan_ref / mlstm_update_ref: transformers' per-token step, token by token, on the
shared reference drivers (recurrence_ref.py).

Measured (one thread, one row with a checkpoint every 16 tokens, so 16-token chunks, 8 heads of K = V = 64,
medians of 3 on a loaded 2-core shared machine, so rough): T = 512 ~110 ms vs ~395 ms for the per-token
reference; T = 2048 ~386 ms vs ~1540 ms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recap.kernels.metadata import SSMMetadata
from recap.kernels.recurrence_ref import Step, scan_ref, update_ref
from recap.kernels.varlen import (
    chunk_view,
    copy_decode_checkpoints,
    decode_rows,
    read_initial,
    record_decode_positions,
    write_ssm_states,
    zero_pad_tokens,
)

NEG = -1e30  # the input gate of a chunk's padding positions: no weight, and no inf - inf anywhere
EPS = 1e-6  # transformers' default backend eps (xLSTMConfig.eps)


def state_width(k: int, v: int) -> int:
    """One head's packed state: C [K, V], n [K], m."""
    return k * v + k + 1


def _unpack(s: torch.Tensor, k: int, v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., K*V + K + 1] -> C [..., K, V], n [..., K], m [...]."""
    return s[..., : k * v].unflatten(-1, (k, v)), s[..., k * v : k * v + k], s[..., -1]


def _pack(c: torch.Tensor, n: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.cat((c.flatten(-2), n, m[..., None]), dim=-1)


def _merge(prev: torch.Tensor, c_loc, n_loc, m_loc, g, k: int, v: int) -> torch.Tensor:  # noqa: ANN001
    """The state after a chunk: prev [N, H, P] decayed by e^g [N, H] plus the chunk's own state (from zero, held
    divided by e^m_loc)."""
    c0, n0, m0 = _unpack(prev, k, v)
    m = torch.maximum(g + m0, m_loc)
    d0, dl = torch.exp(g + m0 - m), torch.exp(m_loc - m)
    c = d0[..., None, None] * c0 + dl[..., None, None] * c_loc
    return _pack(c, d0[..., None] * n0 + dl[..., None] * n_loc, m)


def _chunk_ranks(meta: SSMMetadata) -> list[list[int]]:
    """The chunks of each rank (the k-th chunk of every row), rank by rank."""
    ranks: list[list[int]] = []
    prev_row, r = -1, 0
    for c, row in enumerate(meta.chunk_seq_idx_list):
        r = r + 1 if row == prev_row else 0
        prev_row = row
        if r == len(ranks):
            ranks.append([])
        ranks[r].append(c)
    return ranks


def _chain(init: torch.Tensor, local: tuple, meta: SSMMetadata, k: int, v: int) -> tuple[torch.Tensor, ...]:
    """Each chunk's start and end state [C, H, P] from the rows' initial states and the chunks' own states."""
    starts = torch.empty((len(meta.chunk_seq_idx_list), *init.shape[1:]), dtype=init.dtype, device=init.device)
    ends = torch.empty_like(starts)
    dev = init.device
    for r, chunks in enumerate(_chunk_ranks(meta)):
        sel = torch.tensor(chunks, device=dev)
        prev = (
            init.index_select(0, meta.chunk_seq_idx.index_select(0, sel)) if r == 0 else ends.index_select(0, sel - 1)
        )
        starts.index_copy_(0, sel, prev)
        ends.index_copy_(0, sel, _merge(prev, *(t.index_select(0, sel) for t in local), k, v))
    return starts, ends


def mlstm_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    f: torch.Tensor,
    state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
    eps: float = EPS,
) -> torch.Tensor:
    """h [T, H, V] for packed rows; each row starts from its running slot (if it has context) or the empty state,
    its state at every chunk end with a destination slot goes there, its final state to the running slot (decode
    batches included). Padding rows output zeros and touch no slot. Reference: mlstm_scan_ref."""
    if meta.is_decode:
        out = mlstm_update(q, k, v, i, f, state, meta.state_indices, slot_positions, meta.chunk_end_positions - 1,
                           meta.has_initial_state, eps)  # fmt: skip
        copy_decode_checkpoints(state, meta, slot_positions)
        return out
    kd, vd = q.shape[-1], v.shape[-1]
    width = int(max(meta.cu_chunk_seqlens_list[c + 1] - meta.cu_chunk_seqlens_list[c]
                    for c in range(len(meta.chunk_seq_idx_list))))  # fmt: skip
    idx, mask = chunk_view(meta.cu_chunk_seqlens, width)  # [C, Q]
    qc, kc, vc = (q.float() * kd**-0.5)[idx], k.float()[idx], v.float()[idx]  # [C, Q, H, .]
    pad = ~mask[..., None]
    b = F.logsigmoid(f.float())[idx].masked_fill(pad, 0.0).cumsum(1)  # [C, Q, H]
    ig = i.float()[idx].masked_fill(pad, NEG)
    a = b[:, -1:] - b + ig  # each token's log weight at its chunk's end
    m_loc = a.max(1).values  # [C, H]
    kw = kc * torch.exp(a - m_loc[:, None])[..., None]
    local = (torch.einsum("cqhk,cqhv->chkv", kw, vc), kw.sum(1), m_loc, b[:, -1])
    init = read_initial(state, meta.state_indices, meta.has_initial_state)  # [B, H, P]
    starts, ends = _chain(init, local, meta, kd, vd)
    out = _chunk_outputs(qc, kc, vc, b, ig, starts, eps)[mask]  # [T, H, V]: chunks tile the tokens in order
    write_ssm_states(state, ends, meta, slot_positions)
    zero_pad_tokens(out, meta)
    return out.to(q.dtype)


def _chunk_outputs(qc, kc, vc, b, ig, starts, eps: float) -> torch.Tensor:  # noqa: ANN001
    """h [C, Q, H, V]: each position's output from its chunk's start state and the chunk's tokens up to it."""
    kd, vd = qc.shape[-1], vc.shape[-1]
    c0, n0, m0 = _unpack(starts, kd, vd)
    width = b.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=b.device).tril()
    log_d = (b[:, :, None] - b[:, None] + ig[:, None]).masked_fill(~causal[None, :, :, None], NEG)  # [C, t, j, H]
    m_inter = b + m0[:, None]  # [C, Q, H]
    m = torch.maximum(m_inter, log_d.max(2).values)
    s = torch.einsum("cthk,cjhk->ctjh", qc, kc) * torch.exp(log_d - m[:, :, None])
    inter = torch.exp(m_inter - m)
    num = torch.einsum("ctjh,cjhv->cthv", s, vc) + inter[..., None] * torch.einsum("cthk,chkv->cthv", qc, c0)
    den = s.sum(2) + inter * torch.einsum("cthk,chk->cth", qc, n0)
    return num / (torch.maximum(den.abs(), torch.exp(-m)) + eps)[..., None]


def _step(c, n, m, q, k, v, i, f, eps: float):  # noqa: ANN001, ANN202 (tensors: one token, transformers' order)
    """One token per head: (h, C, n, m), q already scaled; transformers' mlstm_recurrent_step_native."""
    lf = F.logsigmoid(f)
    m_new = torch.maximum(lf + m, i)
    fa, ia = torch.exp(lf + m - m_new), torch.exp(i - m_new)
    c = fa[..., None, None] * c + ia[..., None, None] * (k[..., :, None] * v[..., None, :])
    n = fa[..., None] * n + ia[..., None] * k
    num = (q[..., None, :] @ c).squeeze(-2)
    qn = (q[..., None, :] @ n[..., :, None]).squeeze(-1)
    return num / (torch.maximum(qn.abs(), torch.exp(-m_new)[..., None]) + eps), c, n, m_new


def mlstm_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    f: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    slot_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    eps: float = EPS,
) -> torch.Tensor:
    """One decode token per row: the slot steps once, in place, and the output reads the new state; PAD rows
    output zeros. positions ([B], the tokens' absolute positions) is required with slot_positions, which records
    positions + 1 for every slot written. has_initial_state ([B] bool, optional): rows marked False start from the
    empty state. Running slots must be distinct. Reference: mlstm_update_ref."""
    kd, vd = q.shape[-1], v.shape[-1]
    out = torch.zeros((*q.shape[:2], vd), dtype=torch.float32, device=q.device)
    rows = decode_rows(state_indices, has_initial_state)
    if rows:
        dev = q.device
        keep = torch.tensor([r for r, _, _ in rows], device=dev)
        slots = torch.tensor([s for _, s, _ in rows], device=dev)
        prev = state.index_select(0, slots).float()
        prev[torch.tensor([not init for _, _, init in rows], device=dev)] = 0.0
        pick = [x.index_select(0, keep).float() for x in (q, k, v, i, f)]
        pick[0] = pick[0] * kd**-0.5
        h, c, n, m = _step(*_unpack(prev, kd, vd), *pick, eps)
        out.index_copy_(0, keep, h)
        state.index_copy_(0, slots, _pack(c, n, m).to(state.dtype))
    record_decode_positions(slot_positions, state_indices, positions)
    return out.to(q.dtype)


def _packed_step(q, k, v, i, f, eps: float) -> Step:  # noqa: ANN001 (the packed inputs)
    """The reference's step on a packed state [H, P]: token `tok` of the inputs, q scaled as transformers does."""
    kd, vd = q.shape[-1], v.shape[-1]

    def step(h: torch.Tensor, tok: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = [t[tok].float() for t in (q, k, v, i, f)]
        out, c, n, m = _step(*_unpack(h, kd, vd), x[0] * kd**-0.5, *x[1:], eps)
        return out, _pack(c, n, m)

    return step


def mlstm_update_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    f: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    slot_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    eps: float = EPS,
) -> torch.Tensor:
    """Plain per-row reference of mlstm_update (same signature and side effects)."""
    out = torch.zeros((*q.shape[:2], v.shape[-1]), dtype=torch.float32, device=q.device)
    empty = lambda: torch.zeros(state.shape[1:], device=q.device)  # noqa: E731
    update_ref(_packed_step(q, k, v, i, f, eps), empty, out, state, state_indices, slot_positions, positions,
               has_initial_state)  # fmt: skip
    return out.to(q.dtype)


def mlstm_scan_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    f: torch.Tensor,
    state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
    eps: float = EPS,
) -> torch.Tensor:
    """Sequential per-token reference of mlstm_scan (same signature and side effects)."""
    out = torch.zeros((*q.shape[:2], v.shape[-1]), dtype=torch.float32, device=q.device)
    empty = lambda: torch.zeros(state.shape[1:], device=q.device)  # noqa: E731
    scan_ref(_packed_step(q, k, v, i, f, eps), empty, out, state, meta, slot_positions)
    return out.to(q.dtype)
