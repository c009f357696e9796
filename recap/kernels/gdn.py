"""The gated delta rule over packed rows, with states at any chunk end: one kernel for Gated DeltaNet (a
scalar decay per head, arXiv 2412.06464) and Kimi Delta Attention (a decay per key channel, arXiv 2510.26692).

Glossary (code name: paper symbol)
- q, k [T, Hk, Dk]: queries and keys, already L2-normalized (q also scaled by Dk^-1/2); v [T, Hv, Dv].
  Value head h reads key head h // (Hv // Hk) (GQA of k vs v heads; Hv a multiple of Hk).
- g: log of the decay alpha_t (<= 0), [T, Hv] (GDN: one per head) or [T, Hv, Dk] (KDA: one per key channel);
  beta [T, Hv]: the write strength in (0, 1).
- S [Hv, Dk, Dv]: the matrix state; state [S_slots, Hv, Dk, Dv] holds one per slot (fp32).
- recurrence: S_t = Diag(alpha_t) S_{t-1};  S_t += beta_t k_t (v_t - S_t^T k_t)^T;  o_t = S_t^T q_t.
- piece: the kernel's unit of work, a metadata chunk (rows are cut at the chunk grid and at every checkpoint
  position) cut again into pieces of at most PIECE tokens (kernels/tiling.py), padded to Q (the longest piece
  of the step); padded positions get g = 0, beta = 0, k = v = 0 (no effect).

Chunk form (the WY / UT-transform form of the GDN paper, section 3.3, in the layout of fla's
chunk_gated_delta_rule), per piece and value head, with cum = cumsum(g) inside the piece (per channel for
KDA) and L[i, j, c] = exp(cum_i[c] - cum_j[c]) for i >= j (0 above):
1. M[i, j] = sum_c (beta_i k_i)[c] k_j[c] L[i, j, c], A[i, j] = sum_c q_i[c] k_j[c] L[i, j, c] (j <= i);
   T = (I + strictly_lower(M))^-1 by a unit-lower triangular solve against I;
   [U | W] = T [beta v | beta k exp(cum)] (pseudo-values; decayed keys that read the old state).
2. sequentially over a row's pieces, from the slot state S0:
   V' = U - W S0;  o = (q exp(cum)) S0 + A V';  S1 = Diag(exp(cum_last)) S0 + (k exp(cum_last - cum))^T V'.
Every piece end's state is exact, so a checkpoint (a chunk end with a destination slot) has its state computed
straight into that slot, and each row's final state straight into its running slot (fp32 state; DESIGN
invariants 2-3). Exponents are floored at EXP_FLOOR (exp of it is ~1e-26: below fp32 resolution against the
terms it is added to) to keep exp off its slow underflow path. Decode batches (one token per row) go to
gdn_decode.gated_delta_rule_update, which updates the running slots in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recap.core.output import PAD_SLOT_ID
from recap.kernels.gdn_decode import decay_factor, expand_heads, gated_delta_rule_update
from recap.kernels.metadata import SSMMetadata
from recap.kernels.tiling import Piece, cut_pieces
from recap.kernels.varlen import chunk_view, copy_decode_checkpoints, read_initial

PIECE = 16  # tokens; benchmarks/bench_gated_delta.py measures 16, 32 and 64
EXP_FLOOR = -60.0
_CHANNEL_GROUP = 1 << 23  # elements of the per-channel [pieces, h, Q, Q, Dk] decay built at once (32 MiB)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
    piece: int = PIECE,
    normalize_qk: bool = False,
) -> torch.Tensor:
    """Chunked gated delta rule of every row from its slot state; writes running and checkpoint slots.

    Returns o [T, Hv, Dv] in v's dtype; padding rows output zeros and touch no slot. `normalize_qk`: q and k
    are L2-normalised here (q scaled by Dk^-1/2; normalize_qk_inputs), as the GDN layer needs; a fused kernel does
    it where it reads them. Reference: gated_delta_rule_ref (same signature and side effects).
    """
    if normalize_qk:
        q, k = normalize_qk_inputs(q, k)
    if meta.is_decode:
        y = gated_delta_rule_update(
            state, q, k, v, g, beta, meta.state_indices, slot_positions, meta.chunk_end_positions - 1,
            meta.has_initial_state,
        )  # fmt: skip
        copy_decode_checkpoints(state, meta, slot_positions)
        return y
    return _chunked(q, k, v, g, beta, state, meta, slot_positions, piece)


def _chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    meta: SSMMetadata, slot_positions: torch.Tensor | None, piece: int,
) -> torch.Tensor:
    """gated_delta_rule of a step that is not a decode batch: every chunk cut into pieces in the WY form."""
    t, hv, dv = v.shape
    pieces = cut_pieces(meta.chunks, piece)
    cu = [p.start for p in pieces] + [t]
    lens = [b - a for a, b in zip(cu, cu[1:])]
    qlen, n = max(lens), len(lens)
    full = all(x == qlen for x in lens)  # every piece full: the layout is a view of the packed tokens
    idx, mask = (None, None) if full else chunk_view(torch.tensor(cu, device=v.device), qlen)

    def pieced(x: torch.Tensor, heads: int = hv) -> torch.Tensor:  # (t, hx, ...) -> (n, heads, Q, ...) fp32
        x = x.float()
        y = x.view(n, qlen, *x.shape[1:]) if idx is None else x[idx]  # (n, Q, hx, ...)
        if mask is not None:
            y = y * mask.view(n, qlen, *([1] * (x.dim() - 1)))
        if x.shape[1] != heads:  # GQA: each key head serves heads // hx value heads
            y = y.unsqueeze(3).expand(*y.shape[:3], heads // x.shape[1], *y.shape[3:]).flatten(2, 3)
        return y.transpose(1, 2).contiguous()

    qc, kc, vc, bc, gc = (pieced(x) for x in (q, k, v, beta, g))  # (n, h, Q, dk), .., (n, h, Q, dv), (n, h, Q), ..
    cum = (gc if g.dim() == 3 else gc.unsqueeze(-1)).cumsum(2)  # (n, h, Q, dk or 1)
    kb = kc * bc[..., None]
    system, attn = _intra(qc, kc, kb, cum)  # (n, h, Q, Q) each: M and A
    eye = torch.eye(qlen, device=v.device).expand_as(system)
    tri = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)  # T
    decayed = cum.clamp(min=EXP_FLOOR).exp()
    u, w = tri @ (vc * bc[..., None]), tri @ (kb * decayed)  # (n, h, Q, dv), (n, h, Q, dk): U, W
    q_dec = qc * decayed
    last = cum[:, :, -1:, :]  # (n, h, 1, dk or 1)
    k_dec = kc * (last - cum).clamp_(min=EXP_FLOOR).exp_()
    piece_decay = last.clamp(min=EXP_FLOOR).exp_().transpose(-1, -2)  # (n, h, dk or 1, 1)

    h0 = read_initial(state, meta.state_indices, meta.has_initial_state)  # (b, h, dk, dv) copies
    alloc = torch.zeros if PAD_SLOT_ID in meta.state_indices_list else torch.empty  # PAD rows output zeros
    out = alloc(n, hv, qlen, dv, dtype=torch.float32, device=v.device)
    _carry(state, slot_positions, meta, h0, (u, w, q_dec, attn, k_dec, piece_decay), out, pieces)
    y = out.transpose(1, 2).reshape(n * qlen, hv, dv)
    if not full:
        y = y.index_select(0, _token_index(torch.tensor(cu, device=v.device), qlen, t))  # (t, h, dv)
    return y.to(v.dtype)


def _intra(
    qc: torch.Tensor, kc: torch.Tensor, kb: torch.Tensor, cum: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, A) [n, h, Q, Q] inside every piece: (beta k) k^T and q k^T weighted by the causal decay L."""
    qlen = qc.shape[2]
    if cum.shape[-1] == 1:  # one decay per head: L [n, h, Q, Q]
        c = cum[..., 0]
        decay = (c[..., :, None] - c[..., None, :]).clamp_(EXP_FLOOR, 0.0).exp_().tril_()  # >= 0 above: 1, then 0
        return (kb @ kc.transpose(-1, -2)).mul_(decay), (qc @ kc.transpose(-1, -2)).mul_(decay)
    n, h = qc.shape[:2]
    lower = torch.ones(qlen, qlen, device=qc.device).tril_()[..., None]  # (Q, Q, 1): j <= i
    system, attn = qc.new_empty(n, h, qlen, qlen), qc.new_empty(n, h, qlen, qlen)
    step = max(1, _CHANNEL_GROUP // max(1, h * qlen * qlen * qc.shape[-1]))
    for a in range(0, n, step):  # per channel: L [n, h, Q, Q, dk], built a group of pieces at a time
        c = cum[a : a + step]
        # cum_i - cum_j >= 0 above the diagonal: clamped to 0 there, then zeroed by the lower mask
        decay = (c[:, :, :, None, :] - c[:, :, None, :, :]).clamp_(EXP_FLOOR, 0.0).exp_().mul_(lower)
        weighted = decay.mul_(kc[a : a + step, :, None, :, :])  # L[i, j, c] k_j[c]
        both = weighted @ torch.stack([kb[a : a + step], qc[a : a + step]], dim=-1)  # (g, h, Q, Q, 2)
        system[a : a + step], attn[a : a + step] = both[..., 0], both[..., 1]
    return system, attn


def _carry(
    state: torch.Tensor,
    slot_positions: torch.Tensor | None,
    meta: SSMMetadata,
    h0: torch.Tensor,
    parts: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    pieces: list[Piece],
) -> None:
    """Step 2, sequential over each row's pieces: outputs into out, piece-end states into their slots."""
    u, w, q_dec, attn, k_dec, piece_decay = parts
    in_place = state.dtype == torch.float32 and state.is_contiguous()
    spare = torch.empty(2, *h0.shape[1:], device=h0.device)  # ping-pong for states that go to no slot
    ends = set(meta.last_chunk_indices.tolist())
    prev = h0[0]
    for i, (row, _, _, c) in enumerate(pieces):
        run = meta.state_indices_list[row]
        if run == PAD_SLOT_ID:
            continue
        s0 = h0[row] if i == 0 or pieces[i - 1].row != row else prev
        v_new = torch.baddbmm(u[i], w[i], s0, alpha=-1.0)  # (h, Q, dv): U - W S0
        torch.bmm(q_dec[i], s0, out=out[i]).baddbmm_(attn[i], v_new)
        slots = [] if c < 0 else [d for d in (meta.chunk_dest_slots_list[c], run if c in ends else -1) if d >= 0]
        target = state[slots[0]] if in_place and slots else spare[i % 2]
        torch.mul(s0, piece_decay[i], out=target).baddbmm_(k_dec[i].transpose(-1, -2), v_new)
        for d in slots:
            if d != slots[0] or not in_place:
                state[d].copy_(target)
            if slot_positions is not None:
                slot_positions[d] = meta.chunk_end_positions_list[c]
        prev = target


def _token_index(cu: torch.Tensor, qlen: int, t: int) -> torch.Tensor:
    """[T]: each token's row in the (P * Q) padded layout (piece p holds tokens cu[p]..cu[p+1])."""
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
    normalize_qk: bool = False,
) -> torch.Tensor:
    """Sequential per-token reference of gated_delta_rule (same signature and side effects)."""
    if normalize_qk:
        q, k = normalize_qk_inputs(q, k)
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
            s = s * decay_factor(g[tok], 0)
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
            slot_positions[slot] = meta.chunk_end_positions_list[int(meta.last_chunk_indices[row])]
    return y.to(v.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, in fp32 (the FLA / transformers form, eps inside the root)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def normalize_qk_inputs(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(l2_normalize(q) * Dk^-1/2, l2_normalize(k)) in fp32: the GDN layer's q and k as the recurrence takes them."""
    return l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(g, beta) in fp32: g = -exp(A_log) softplus(a + dt_bias) (the log decay), beta = sigmoid(b)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()
