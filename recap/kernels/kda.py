"""Kimi Delta Attention (KDA, Kimi Linear, arXiv 2510.26692): the gated delta rule with a per-channel decay.

Glossary (code name: symbol), per head
- q, k [T, H, K]: queries and keys (L2-normalised here, in fp32; q also scaled by K^-1/2); v [T, H, V].
- g [T, H, K]: log of the per-channel forget gate alpha_t (<= 0); beta [T, H]: the write strength in (0, 1).
- S [H, K, V]: the state; state [S, H, K, V] holds one per slot, fp32.
- recurrence:  S_t = Diag(exp g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t.
  (Gated DeltaNet is the special case of g constant across the K channels.)

Chunked form (the WY representation, as transformers' torch fallback computes it), per chunk of L tokens
starting from S with G = cumsum(g) inside the chunk, D[i, j] = exp(G_i - G_j) (j <= i, per channel):
1. N[i, j] = -sum_c (beta_i k_i)[c] k_j[c] D[i, j, c] for j < i;  W = (I - N)^-1 (unit lower triangular);
2. u = W (beta v);  w = W (beta k exp(G));  v_new = u - w S;
3. o = (q exp(G)) S + (sum_c q_i[c] k_j[c] D[i, j, c], j <= i) v_new;
4. S' = exp(G_L) S + (k exp(G_L - G))^T v_new.
Chunks are the metadata's (cut at the chunk grid and at every checkpoint position), so the state at each
checkpoint is a chunk end state, written straight into its slot (DESIGN invariant 3).
Decode batches (one token per row) go to kda_state_update, which updates the running slots in place.
"""

from __future__ import annotations

import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.gdn import l2_normalize
from recap.kernels.metadata import SSMMetadata
from recap.kernels.varlen import decode_rows, gather_decode_states, pad_tokens, record_decode_positions


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> tuple:
    """fp32 inputs; q and k L2-normalised, q scaled by K^-1/2."""
    qf, kf = l2_normalize(q), l2_normalize(k)
    return qf * q.shape[-1] ** -0.5, kf, v.float(), g.float(), beta.float()


def _chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of one row, head-major: q, k, g (h, l, K), v (h, l, V), beta (h, l), s (h, K, V) -> (o, s')."""
    n = q.shape[1]
    G = g.cumsum(1)  # (h, l, K)
    lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()  # j <= i
    # D[i, j] = exp(G_i - G_j) for j <= i, 0 above the diagonal (the difference is >= 0 there: never exp'd)
    diff = (G[:, :, None, :] - G[:, None, :, :]).masked_fill(~lower[None, :, :, None], float("-inf"))
    decay = diff.exp()  # (h, l, l, K)
    kb = k * beta[..., None]
    nmat = -torch.einsum("hic,hjc,hijc->hij", kb, k, decay).tril(-1)  # (h, l, l), strictly lower
    eye = torch.eye(n, device=q.device).expand_as(nmat)
    w_inv = torch.linalg.solve_triangular(eye - nmat, eye, upper=False, unitriangular=True)  # W = (I - N)^-1
    u = w_inv @ (v * beta[..., None])  # (h, l, V)
    w = w_inv @ (kb * G.exp())  # (h, l, K)
    v_new = u - w @ s
    intra = torch.einsum("hic,hjc,hijc->hij", q, k, decay)  # (h, l, l), lower incl. the diagonal
    o = (q * G.exp()) @ s + intra @ v_new
    g_last = G[:, -1:, :]  # (h, 1, K)
    s_new = s * g_last.transpose(1, 2).exp() + (k * (g_last - G).exp()).transpose(1, 2) @ v_new
    return o, s_new


def kda_varlen(
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
    state at every chunk end with a destination slot goes there, its final state to the running slot.

    Padding rows output zeros and touch no slot. Reference: kda_ref (same signature and side effects).
    """
    qf, kf, vf, gf, bf = (x.transpose(0, 1) for x in _prepare(q, k, v, g, beta))  # head-major (h, t, ..)
    out = torch.zeros(v.shape[1], v.shape[0], v.shape[2], dtype=torch.float32, device=v.device)  # (h, t, V)
    cu, rows = meta.cu_chunk_seqlens_list, meta.chunk_seq_idx_list
    last_chunk = meta.last_chunk_indices.tolist()
    running: dict[int, torch.Tensor] = {}
    for c in range(len(rows)):
        row = rows[c]
        slot = meta.state_indices_list[row]
        if slot == PAD_SLOT_ID:
            continue
        s = running.get(row)
        if s is None:
            init = meta.has_initial_state_list[row]
            s = state[slot].float() if init else state.new_zeros(state.shape[1:], dtype=torch.float32)
        a, b = cu[c], cu[c + 1]
        o, s = _chunk(qf[:, a:b], kf[:, a:b], vf[:, a:b], gf[:, a:b], bf[:, a:b], s)
        out[:, a:b] = o
        running[row] = s
        dest = meta.chunk_dest_slots_list[c]
        writes = [dest] if dest != PAD_SLOT_ID else []
        if last_chunk[row] == c:
            writes.append(slot)
        for d in writes:
            state[d] = s.to(state.dtype)
            if slot_positions is not None:
                slot_positions[d] = meta.chunk_end_positions_list[c]
    return out.transpose(0, 1).to(v.dtype)


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
    """Sequential per-token reference of kda_varlen (same signature and side effects)."""
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta)
    t = q.shape[0]
    out = torch.zeros(vf.shape, device=v.device)
    cu = meta.cu_chunk_seqlens_list
    chunk_end = {cu[c + 1]: c for c in range(len(cu) - 1)}
    for row, slot in enumerate(meta.state_indices_list):
        if slot == PAD_SLOT_ID:
            continue
        s = torch.zeros(state.shape[1:], device=v.device)
        if meta.has_initial_state_list[row]:
            s = state[slot].float()
        for tok in range(meta.query_start_loc_list[row], meta.query_start_loc_list[row + 1]):
            s, out[tok] = _token(qf[tok], kf[tok], vf[tok], gf[tok], bf[tok], s)
            c = chunk_end.get(tok + 1)
            if c is not None and meta.chunk_dest_slots_list[c] != PAD_SLOT_ID:
                state[meta.chunk_dest_slots_list[c]] = s.to(state.dtype)
                if slot_positions is not None:
                    slot_positions[meta.chunk_dest_slots_list[c]] = meta.chunk_end_positions_list[c]
        state[slot] = s.to(state.dtype)
        if slot_positions is not None:
            slot_positions[slot] = meta.chunk_end_positions_list[int(meta.last_chunk_indices[row])]
    return out.masked_fill_(pad_tokens(meta, t)[:, None, None], 0.0).to(v.dtype)


def _token(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the recurrence for one token: q, k, g (h, K), v (h, V), beta (h,), s (h, K, V) -> (s', o)."""
    s = s * g.exp()[..., None]
    delta = (v - (s * k[..., None]).sum(-2)) * beta[:, None]  # (h, V)
    s = s + k[..., None] * delta[:, None, :]
    return s, (s * q[..., None]).sum(-2)


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
    """One decode token per row [B, ...]: the recurrence in state[slot], batched over rows. PAD rows: zeros.

    positions ([B], the token's absolute position) is required with slot_positions, which records
    positions + 1 for every slot written. has_initial_state (optional [B] bool): rows marked False start
    from zeros. Running slots must be distinct. Reference: kda_state_update_ref.
    """
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    rows = decode_rows(state_indices, has_initial_state)
    if rows:
        qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta)
        idx, slots, s = gather_decode_states(state, rows)  # s: (b, h, K, V)
        s.mul_(gf[idx].exp()[..., None])
        kk = kf[idx]
        delta = (vf[idx] - torch.einsum("bhkv,bhk->bhv", s, kk)) * bf[idx][..., None]
        s.add_(kk[..., None] * delta[:, :, None, :])
        out[idx] = torch.einsum("bhkv,bhk->bhv", s, qf[idx])
        state.index_copy_(0, slots, s.to(state.dtype))
    record_decode_positions(slot_positions, state_indices, positions)
    return out.to(v.dtype)


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
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta)
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    for row, slot in enumerate(state_indices.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        s = torch.zeros(state.shape[1:], device=v.device)
        if has_initial_state is None or bool(has_initial_state[row]):
            s = state[slot].float()
        s, o = _token(qf[row], kf[row], vf[row], gf[row], bf[row], s)
        out[row] = o.to(v.dtype)
        state[slot] = s.to(state.dtype)
        if slot_positions is not None:
            if positions is None:
                raise ValueError("slot_positions needs positions")
            slot_positions[slot] = positions[row] + 1
    return out
