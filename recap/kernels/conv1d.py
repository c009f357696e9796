"""Depthwise causal conv1d over packed rows, with a rolling conv state per slot (the Mamba short conv).

Glossary
- x: conv input [T, D] (D channels); weight [D, K]: tap k of channel d multiplies input t - (K-1) + k.
- conv_state [S, D, K-1]: the last K-1 *inputs* of a row, oldest first. A row without initial state
  starts from zeros.
- window at a chunk end e: the K-1 inputs ending at relative position e - 1 (it may reach back into the
  initial conv state). Written to the running slot at the row end and to every checkpoint slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recap.core.output import PAD_SLOT_ID
from recap.kernels.metadata import SSMMetadata
from recap.kernels.varlen import decode_rows, read_initial, token_rows, write_slots


def _activate(y: torch.Tensor, activation: str | None, inplace: bool = False) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y, inplace=inplace)
    raise ValueError(f"unsupported activation {activation!r}")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    meta: SSMMetadata,
    activation: str | None = "silu",
    slot_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv of every row; updates the running and checkpoint slots of conv_state.

    slot_positions (optional): record the position of every slot written (a layer whose whole state is
    the conv window, e.g. LFM2's short conv, reports provenance from here)."""
    t, d = x.shape
    k = weight.shape[1]
    nb = meta.state_indices.numel()
    qsl = meta.query_start_loc
    init = read_initial(conv_state, meta.state_indices, meta.has_initial_state)  # (b, d, k-1)
    # One buffer with every row laid out as [its K-1 initial inputs, its tokens]: row b's input at relative
    # position r sits at qsl[b] + (b+1)(K-1) + r, so all taps are plain slices of one tensor.
    rows = token_rows(qsl, t)  # (t,)
    tok_at = torch.arange(t, device=x.device) + (rows + 1) * (k - 1)  # (t,)
    init_at = (qsl[:-1] + torch.arange(nb, device=x.device) * (k - 1))[:, None] + torch.arange(k - 1, device=x.device)
    buf = torch.empty(t + nb * (k - 1), d, dtype=torch.float32, device=x.device)
    if nb == 1:  # one row: [initial inputs, tokens] are two plain slices
        buf[k - 1 :] = x
        buf[: k - 1] = init[0].T
    else:
        buf.index_copy_(0, tok_at, x.float())
        buf.index_copy_(0, init_at.flatten(), init.transpose(1, 2).reshape(nb * (k - 1), d))
    w = weight.float().T.contiguous()  # (k, d): each tap's weights contiguous (a strided tap is ~2x slower)
    m = buf.shape[0] - (k - 1)
    full = buf[k - 1 :] * w[k - 1]  # (m, d): the conv at every buffer position past the first K-1
    for j in range(k - 1):
        full.addcmul_(buf[j : j + m], w[j])
    y = full if nb == 1 else full.index_select(0, tok_at - (k - 1))  # (t, d)
    if bias is not None:
        y += bias.float()
    y = _activate(y, activation, inplace=True)
    if PAD_SLOT_ID in meta.state_indices_list:
        y.masked_fill_((meta.state_indices[rows] == PAD_SLOT_ID)[:, None], 0.0)  # padding rows: zeros

    if k > 1:
        crow = meta.chunk_seq_idx
        # window after a chunk: the K-1 inputs ending there, at buffer offsets cu[c+1] + row * (K-1) + 0..K-2
        start = meta.cu_chunk_seqlens[1:] + crow * (k - 1)  # (c,)
        windows = buf[start[:, None] + torch.arange(k - 1, device=x.device)].transpose(1, 2)  # (c, d, k-1)
        last = meta.last_chunk_indices
        write_slots(conv_state, meta.chunk_dest_slots, windows, slot_positions, meta.chunk_end_positions)
        write_slots(conv_state, meta.state_indices, windows[last], slot_positions, meta.chunk_end_positions[last])
    return y.to(x.dtype)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row: y = conv(state ++ x); the slot's window rolls by one. PAD rows output zeros.

    has_initial_state (optional [B] bool): rows marked False start from a zero window instead of the slot.
    Reference: causal_conv1d_update_ref. One gather of the windows, one scatter back; the window sum is
    a plain multiply-add per tap (no [B, D, K] temporaries beyond the new window).
    """
    b, d = x.shape
    k = weight.shape[1]
    rows = decode_rows(state_indices, has_initial_state)
    if not rows:
        return torch.zeros(b, d, dtype=x.dtype, device=x.device)
    w = weight.float().T.contiguous()  # (k, d)
    y = x.float() * w[k - 1]  # (b, d): the newest tap (then the older ones, then the bias: varlen's order)
    if k > 1:
        if len(rows) == b and all(init for _, _, init in rows):
            prev = conv_state.index_select(0, state_indices)  # (b, d, k-1)
        else:
            prev = torch.zeros(b, d, k - 1, dtype=conv_state.dtype, device=x.device)
            read = [(r, s) for r, s, init in rows if init]
            if read:
                src = torch.tensor([s for _, s in read], device=x.device)
                prev[torch.tensor([r for r, _ in read], device=x.device)] = conv_state.index_select(0, src)
        for j in range(k - 1):
            y.addcmul_(prev[:, :, j].float(), w[j])
        # the rolled window (b, d, k-1): one contiguous shift of the flattened windows, then the new inputs
        # over the last column (a cat along the size-(k-1) dim is ~2x slower)
        window = torch.empty_like(prev)
        window.view(b, -1)[:, :-1] = prev.view(b, -1)[:, 1:]
        window[:, :, -1] = x
        if len(rows) == b:
            conv_state.index_copy_(0, state_indices, window)
        else:
            keep = torch.tensor([r for r, _, _ in rows], device=x.device)
            conv_state.index_copy_(0, state_indices[keep], window[keep])
    if bias is not None:
        y += bias.float()
    y = _activate(y, activation, inplace=True)
    if len(rows) < b:
        y.masked_fill_((state_indices == PAD_SLOT_ID)[:, None], 0.0)
    return y.to(x.dtype)


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain per-row reference of causal_conv1d_update (same signature and side effects)."""
    d, k = weight.shape
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    for row, slot in enumerate(state_indices.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        prev = torch.zeros(d, k - 1, device=x.device)
        if has_initial_state is None or bool(has_initial_state[row]):
            prev = conv_state[slot].float()
        win = torch.cat([prev, x[row].float()[:, None]], dim=1)  # (d, k): oldest input first
        acc = (win * weight.float()).sum(-1)
        if bias is not None:
            acc = acc + bias.float()
        out[row] = _activate(acc, activation).to(x.dtype)
        if k > 1:
            conv_state[slot] = win[:, 1:].to(conv_state.dtype)
    return out


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    meta: SSMMetadata,
    activation: str | None = "silu",
    slot_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain per-row, per-token reference of causal_conv1d (same signature and side effects)."""
    d, k = weight.shape
    w = weight.float()
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    qsl = meta.query_start_loc_list
    for row, slot in enumerate(meta.state_indices_list):
        if slot == PAD_SLOT_ID:
            continue
        start, end = qsl[row], qsl[row + 1]
        init = torch.zeros(d, k - 1, device=x.device)
        if meta.has_initial_state_list[row]:
            init = conv_state[slot].float()
        xp = torch.cat([init, x[start:end].float().T], dim=1)  # (d, k-1+l); input r sits at column r+k-1
        for r in range(end - start):
            acc = (xp[:, r : r + k] * w).sum(-1)
            if bias is not None:
                acc = acc + bias.float()
            y[start + r] = acc
        for c, crow in enumerate(meta.chunk_seq_idx_list):
            if crow != row or k == 1:
                continue
            e = meta.cu_chunk_seqlens_list[c + 1] - start
            window = xp[:, e : e + k - 1]
            if meta.chunk_dest_slots_list[c] != PAD_SLOT_ID:
                conv_state[meta.chunk_dest_slots_list[c]] = window.to(conv_state.dtype)
                if slot_positions is not None:
                    slot_positions[meta.chunk_dest_slots_list[c]] = meta.chunk_end_positions_list[c]
        if k > 1:
            conv_state[slot] = xp[:, end - start : end - start + k - 1].to(conv_state.dtype)
            if slot_positions is not None:
                slot_positions[slot] = meta.chunk_end_positions_list[int(meta.last_chunk_indices[row])]
    return _activate(y, activation).to(x.dtype)
