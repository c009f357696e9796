"""The gated delta rule (Gated DeltaNet, arXiv 2412.06464) over packed rows, with states at any chunk end.

Glossary (code name: paper symbol)
- q, k [T, Hk, Dk]: queries and keys, already L2-normalized (q also scaled by Dk^-1/2); v [T, Hv, Dv].
  Value head h reads key head h // (Hv // Hk) (GQA of k vs v heads; Hv a multiple of Hk).
- g [T, Hv]: log of the per-token decay alpha_t (<= 0); beta [T, Hv]: the write strength in (0, 1).
- S [Hv, Dk, Dv]: the matrix state; state [S_slots, Hv, Dk, Dv] holds one per slot (fp32).
- recurrence: S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T;  o_t = S_t^T q_t.
- chunk: a metadata chunk (rows are cut at the chunk grid and at every checkpoint position), padded here
  to Q, the longest chunk of the step; padded positions get g = 0, beta = 0, k = v = 0 (no effect).

Chunk form (the WY / UT-transform form of the GDN paper, section 3.3, in the layout of fla's
chunk_gated_delta_rule), per chunk and value head, with cum = cumsum(g) inside the chunk and
L[i, j] = exp(cum_i - cum_j) for i >= j (0 above):
1. T = (I + strictly_lower((beta k) k^T * L))^-1, by a unit-lower triangular solve;
   U = T (beta v) (pseudo-values), W = T (beta k exp(cum)) (decayed keys that read the old state);
   A = (q k^T) * L (causal, diagonal included).
2. sequentially over a row's chunks, from the slot state S0:
   V' = U - W S0;  o = (q exp(cum)) S0 + A V';  S1 = exp(cum_last) S0 + (k exp(cum_last - cum))^T V'.
Every chunk end's state is exact, so a checkpoint is a chunk end with a destination slot: its state is
computed straight into that slot (fp32 cache) and its position recorded (DESIGN invariants 2-3).
Decode batches (one token per row) go to gdn_decode.gated_delta_rule_update.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recap.core.output import PAD_SLOT_ID
from recap.kernels.gdn_decode import expand_heads, gated_delta_rule_update
from recap.kernels.metadata import SSMMetadata
from recap.kernels.varlen import chunk_view, copy_decode_checkpoints, pad_tokens, read_initial, write_slots


def gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunked gated delta rule of every row from its slot state; writes running and checkpoint slots.

    Returns o [T, Hv, Dv] in v's dtype; padding rows output zeros and touch no slot. Reference:
    gated_delta_rule_ref (same signature and side effects).
    """
    if meta.is_decode:
        y = gated_delta_rule_update(
            state, q, k, v, g, beta, meta.state_indices, slot_positions, meta.chunk_end_positions - 1,
            meta.has_initial_state,
        )  # fmt: skip
        copy_decode_checkpoints(state, meta, slot_positions)
        return y
    t, hv, dv = v.shape
    dk = k.shape[-1]
    cu = meta.cu_chunk_seqlens
    lens = cu.diff()
    qlen = int(lens.max())
    idx, mask = chunk_view(cu, qlen)  # (c, Q)
    nc = idx.shape[0]
    flat = idx.flatten()

    def chunked(x: torch.Tensor) -> torch.Tensor:  # (t, h, ...) -> (c, h, Q, ...) in fp32, zero past chunk ends
        y = x.float().index_select(0, flat).view(nc, qlen, *x.shape[1:])
        y = y * mask.view(nc, qlen, *([1] * (x.dim() - 1)))
        return y.movedim(1, 2).contiguous()

    qc, kc = chunked(expand_heads(q, hv)), chunked(expand_heads(k, hv))  # (c, h, Q, dk)
    vc, gc, bc = chunked(v), chunked(g), chunked(beta)  # (c, h, Q, dv), (c, h, Q), (c, h, Q)
    cum = gc.cumsum(-1)  # (c, h, Q)
    causal = torch.ones(qlen, qlen, dtype=torch.bool, device=q.device).tril_()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill_(~causal, -torch.inf).exp_()  # (c, h, Q, Q): L
    kb = kc * bc[..., None]
    system = (kb @ kc.transpose(-1, -2)).mul_(decay)  # only its strictly lower part is read (unitriangular)
    rhs = torch.cat([vc * bc[..., None], kb * cum.exp()[..., None]], dim=-1)  # [beta v | beta k exp(cum)]
    uw = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = uw.split([dv, dk], dim=-1)  # (c, h, Q, dv), (c, h, Q, dk)
    attn = (qc @ kc.transpose(-1, -2)).mul_(decay)  # (c, h, Q, Q): A
    q_dec = qc * cum.exp()[..., None]
    k_dec = kc * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # (c, h, 1, 1)

    h0 = read_initial(state, meta.state_indices, meta.has_initial_state)  # (b, h, dk, dv)
    out = torch.empty(nc, hv, qlen, dv, dtype=torch.float32, device=q.device)
    in_place = state.dtype == torch.float32 and state.is_contiguous()
    dest, rows = meta.chunk_dest_slots_list, meta.chunk_seq_idx_list
    last_chunk = {c: r for r, c in enumerate(meta.last_chunk_indices.tolist())}
    prev: torch.Tensor | None = None
    staged: list[tuple[int, int, torch.Tensor]] = []  # (slot, position, state) not written in place
    for c in range(nc):
        row = rows[c]
        s0 = h0[row] if c == 0 or rows[c - 1] != row else prev
        assert s0 is not None
        if meta.state_indices_list[row] == PAD_SLOT_ID:
            prev = s0
            continue
        v_new = torch.baddbmm(u[c], w[c], s0, alpha=-1.0)  # (h, Q, dv): U - W S0
        torch.baddbmm(torch.bmm(q_dec[c], s0), attn[c], v_new, out=out[c])
        d = dest[c]
        target = state[d] if in_place and d != PAD_SLOT_ID else torch.empty_like(s0)
        torch.baddbmm(s0 * chunk_decay[c], k_dec[c].transpose(-1, -2), v_new, out=target)
        pos = meta.chunk_end_positions_list[c]
        if d != PAD_SLOT_ID:
            if in_place and slot_positions is not None:
                slot_positions[d] = pos
            elif not in_place:
                staged.append((d, pos, target))
        if c in last_chunk:
            staged.append((meta.state_indices_list[row], pos, target))
        prev = target
    if staged:  # running slots after every checkpoint (a row's chunks never read a slot written this step)
        slots, positions, states = zip(*staged)
        dev = q.device
        write_slots(state, torch.tensor(slots, device=dev), torch.stack(states), slot_positions,
                    torch.tensor(positions, device=dev))  # fmt: skip
    y = out.movedim(2, 1).reshape(nc * qlen, hv, dv)
    y = y.index_select(0, _token_index(cu, qlen, t))  # (t, h, dv)
    if PAD_SLOT_ID in meta.state_indices_list:
        y.masked_fill_(pad_tokens(meta, t)[:, None, None], 0.0)
    return y.to(v.dtype)


def _token_index(cu: torch.Tensor, qlen: int, t: int) -> torch.Tensor:
    """[T]: each token's row in the (c * Q) padded layout (chunk c holds tokens cu[c]..cu[c+1])."""
    lens = cu.diff()
    chunk = torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens, output_size=t)
    return torch.arange(t, device=cu.device) + chunk * qlen - cu[chunk]


def gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sequential per-token reference of gated_delta_rule_varlen (same signature and side effects)."""
    t, hv, dv = v.shape
    qf, kf = expand_heads(q, hv).float(), expand_heads(k, hv).float()
    y = torch.zeros(t, hv, dv, dtype=torch.float32, device=v.device)
    cu = meta.cu_chunk_seqlens_list
    chunk_end = {cu[c + 1]: c for c in range(len(cu) - 1)}
    for row, slot in enumerate(meta.state_indices_list):
        if slot == PAD_SLOT_ID:
            continue
        s = torch.zeros(state.shape[1:], device=v.device)
        if meta.has_initial_state_list[row]:
            s = state[slot].float()
        for tok in range(meta.query_start_loc_list[row], meta.query_start_loc_list[row + 1]):
            s = s * g[tok].float().exp()[:, None, None]
            kt, vt = kf[tok], v[tok].float()  # (h, dk), (h, dv)
            delta = (vt - torch.einsum("hk,hkv->hv", kt, s)) * beta[tok].float()[:, None]
            s = s + kt[:, :, None] * delta[:, None, :]
            y[tok] = torch.einsum("hk,hkv->hv", qf[tok], s)
            c = chunk_end.get(tok + 1)
            if c is not None and meta.chunk_dest_slots_list[c] != PAD_SLOT_ID:
                state[meta.chunk_dest_slots_list[c]] = s.to(state.dtype)
                if slot_positions is not None:
                    slot_positions[meta.chunk_dest_slots_list[c]] = meta.chunk_end_positions_list[c]
        state[slot] = s.to(state.dtype)
        if slot_positions is not None:
            slot_positions[slot] = meta.chunk_end_positions_list[meta.last_chunk_indices[row]]
    return y.to(v.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, in fp32 (the FLA / transformers form, eps inside the root)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(g, beta) in fp32: g = -exp(A_log) softplus(a + dt_bias) (the log decay), beta = sigmoid(b)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()
