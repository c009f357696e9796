"""Triton causal attention over a paged KV cache: the GPU twin of recap/kernels/paged_attention.py.

Glossary (as in the reference)
- q [T, Hq, Dh], k / v [T, Hkv, Dh]: the new tokens' projections; Hq = Hkv * group (GQA).
- k_cache / v_cache [NB, block_size, Hkv, Dh]: the block pool; token slot = block_id * block_size + offset.
- row b: its new queries sit at absolute positions [context_len, seq_len) and attend every key at a
  position <= their own (and > position - sliding_window), read through block_tables[b].
- padding row: its table is all PAD_SLOT_ID (a real row owns at least one block); it outputs zeros and
  reads nothing.

Kernel layout. One program per (q tile, kv head): its BLOCK_M rows are BLOCK_Q consecutive queries of one
row times the GROUP_PAD query heads that share the kv head (row m = query m // GROUP_PAD, head
m % GROUP_PAD), so a K/V tile read through the block table serves the whole GQA group in one tl.dot.
Flash-attention online softmax over key tiles of BLOCK_N positions, fp32 accumulation. Prefill and mixed
batches: tiles never cross rows; tile j belongs to the row r with qsl[r] // BLOCK_Q + r <= j, found by a
binary search over query_start_loc (the grid is T // BLOCK_Q + B tiles, known without a host sync; the
tiles past a row's queries exit). Decode batches (every row one query): BLOCK_Q = 1 and one program per
(row, kv head). Key tiles start at the tile's first visible key (its first query's window), so blocks
out of the window (the null block in the window group's tables) and positions past seq_len are never
loaded: every load is masked to [first visible key, last query's position].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from recap.kernels.metadata import AttentionMetadata

LOG2E = 1.4426950408889634


@triton.jit
def _store_rows_kernel(
    x_ptr, cache_ptr, slot_ptr,
    stride_xt, stride_xh, stride_xd, stride_cs, stride_ch, stride_cd,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program t: store token t's [H, D] at its slot (cache viewed as [slots, H, D]); PAD slots skipped."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < H) & (d < D)
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d * stride_xd, mask=mask)
    dst = cache_ptr + slot * stride_cs + h * stride_ch + d * stride_cd
    tl.store(dst, x, mask=mask)


def _store_rows(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """x [T, H, D] into cache [NB, block_size, H, D] at slot_mapping (PAD_SLOT_ID skipped)."""
    t, h, d = x.shape
    assert cache.shape[2:] == (h, d), f"token shape {tuple(x.shape[1:])} vs cache {tuple(cache.shape)}"
    assert cache.stride(0) == cache.shape[1] * cache.stride(1), "the cache's blocks must be slot-contiguous"
    assert slot_mapping.shape == (t,)
    if t == 0:
        return
    x = x.to(cache.dtype)  # on the host, as the reference rounds (the interpreter's bf16 cast truncates)
    _store_rows_kernel[(t,)](
        x, cache, slot_mapping,
        x.stride(0), x.stride(1), x.stride(2), cache.stride(1), cache.stride(2), cache.stride(3),
        H=h, D=d, BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d),
    )  # fmt: skip


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V at its slot; tokens with slot PAD_SLOT_ID are skipped."""
    _store_rows(k, k_cache, slot_mapping)
    _store_rows(v, v_cache, slot_mapping)


@triton.jit
def _row_of_tile(qsl_ptr, j, num_rows, BLOCK_Q: tl.constexpr):
    """The row r whose tiles hold tile j: the largest r with qsl[r] // BLOCK_Q + r <= j (binary search)."""
    lo = 0
    hi = num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        go_right = first <= j
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    return lo - 1


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, ctx_ptr, seq_ptr, qsl_ptr,
    num_rows, block_size, window, qk_scale,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_tb,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DECODE: tl.constexpr, USE_WINDOW: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (tile j, kv head): attention of one row's BLOCK_Q queries x GROUP heads over its keys."""
    j = tl.program_id(0)
    kvh = tl.program_id(1)
    if DECODE:
        r = j
        t0 = 0
    else:
        r = _row_of_tile(qsl_ptr, j, num_rows, BLOCK_Q)
        t0 = (j - (tl.load(qsl_ptr + r) // BLOCK_Q + r)) * BLOCK_Q  # the tile's first query, row-relative
    q_begin = tl.load(qsl_ptr + r)
    n = tl.load(qsl_ptr + r + 1) - q_begin
    if t0 >= n:
        return
    ctx = tl.load(ctx_ptr + r)
    table = tables_ptr + r * stride_tb
    padding = tl.load(table) < 0

    m = tl.arange(0, BLOCK_M)
    tok = m // GROUP_PAD
    head = kvh * GROUP + m % GROUP_PAD
    row_ok = (tok < BLOCK_Q) & (t0 + tok < n) & (m % GROUP_PAD < GROUP)
    qpos = ctx + t0 + tok  # (m,) absolute positions
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_off = (q_begin + t0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd
    qv = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (m, d)
    if UPCAST:
        qv = qv.to(tl.float32)

    hi = ctx + tl.minimum(t0 + BLOCK_Q, n)  # one past the last query's position (<= seq_len)
    lo = hi * 0
    if USE_WINDOW:
        lo = tl.maximum(lo, ctx + t0 - window + 1)  # the first query's first visible key
    hi = tl.where(padding, lo, hi)  # a padding row reads nothing (and outputs zeros)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked key tile leaves rows unchanged
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = (kpos >= lo) & (kpos < hi)
        blk = tl.load(table + kpos // block_size, mask=k_ok, other=0)
        kv_off = blk * stride_kb + (kpos % block_size) * stride_ks + kvh * stride_kh  # (n,)
        kv_off = kv_off[:, None] + d[None, :] * stride_kd  # (n, d)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        kt = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        vt = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(qv, tl.trans(kt), input_precision=PRECISION) * qk_scale  # (m, n), log2 units
        seen = k_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        if USE_WINDOW:
            seen = seen & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = (q_begin + t0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _tiles(group: int, decode: bool) -> tuple[int, int, int]:
    """(BLOCK_Q, BLOCK_M, BLOCK_N): queries per tile, tile rows (queries x padded group, >= 16 for tl.dot),
    keys per step."""
    group_pad = triton.next_power_of_2(group)
    if decode:
        return 1, max(16, group_pad), 64
    block_m = max(64, group_pad)
    return block_m // group_pad, block_m, 64


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    native: bool = False,
) -> torch.Tensor:
    """Write the new K/V, then causal attention of every row's new queries over its whole sequence
    (over the last `sliding_window` positions of each query, if given).

    Padding rows output zeros and read nothing. `native` (the CPU reference's C decode switch) is accepted
    for the signature and ignored.
    """
    del native
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    t, hq, dh = q.shape
    hkv = k_cache.shape[2]
    assert hq % hkv == 0 and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[3] == dh and (sliding_window is None or sliding_window > 0)
    out = torch.empty((t, hq, dh), dtype=q.dtype, device=q.device)  # every token is some row's: all written
    num_rows = len(meta.seq_lens_list)
    group = hq // hkv
    block_q, block_m, block_n = _tiles(group, meta.is_decode)
    grid = (num_rows if meta.is_decode else t // block_q + num_rows, hkv)
    upcast = q.dtype != k_cache.dtype
    precision = "ieee" if upcast or q.dtype == torch.float32 else "tf32"
    _attention_kernel[grid](
        q, k_cache, v_cache, out, meta.block_tables, meta.context_lens, meta.seq_lens, meta.query_start_loc,
        num_rows, meta.block_size, sliding_window or 0, scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3), meta.block_tables.stride(0),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=dh,
        BLOCK_D=max(16, triton.next_power_of_2(dh)), BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        DECODE=meta.is_decode, USE_WINDOW=sliding_window is not None, UPCAST=upcast, PRECISION=precision,
    )  # fmt: skip
    return out
