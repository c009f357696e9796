"""Triton causal attention over a paged KV cache: the GPU twin of recap/kernels/paged_attention.py.

Glossary (as in the reference)
- q [T, Hq, Dh], k / v [T, Hkv, Dh]: the new tokens' projections; Hq = Hkv * group (GQA).
- k_cache / v_cache [NB, block_size, Hkv, Dh]: the block pool; token slot = block_id * block_size + offset.
- row b: its new queries sit at absolute positions [context_len, seq_len) and attend every key at a
  position <= their own (and > position - sliding_window), read through block_tables[b].
- padding row: its table is all PAD_SLOT_ID (a real row owns at least one block); it outputs zeros and
  reads nothing.

Kernel layout. One program per (q tile, kv head x head block, key split): its BLOCK_M rows are BLOCK_Q
consecutive queries of one row times HEADS of the query heads that share the kv head (row m = query
m // HEADS, head m % HEADS; HEADS is the GQA group padded to a power of two, at most 16), so a K/V tile read
through the block table serves the group in one tl.dot. Flash-attention online softmax over key tiles of
BLOCK_N positions, fp32 accumulation. Prefill and mixed batches: tiles never cross rows; tile j belongs to
the row r with qsl[r] // BLOCK_Q + r <= j, found by a binary search over query_start_loc (the grid is
T // BLOCK_Q + B tiles, known without a host sync; the tiles past a row's queries exit). Decode batches
(every row one query): BLOCK_Q = 1, one program per (row, kv head x head block). Split-K: each split attends to
its share of its tile's key tiles and a second kernel merges the partial softmaxes; decode steps split, and so do
prefill steps of few programs over many keys (a cached prefix + a few new tokens, _splits). Key tiles
start at the tile's first visible key (its first query's window), so blocks out of the window (the null
block in the window group's tables) and positions past seq_len are never loaded: every load is masked to
[first visible key, last query's position].
MLA (triton/mla.py) runs the same kernel in its latent form: one kv head, the score adds a rope part, and
the value is the key tile itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from recap.kernels.metadata import AttentionMetadata

LOG2E = 1.4426950408889634


@triton.jit
def store_token(x_ptr, cache_ptr, t, slot, stride_xt, stride_xh, stride_cs, stride_ch,
                 H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Copy token t's [H, D] (last dim contiguous) to the cache's slot `slot` (viewed as [slots, H, D])."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < H) & (d < D)
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d, mask=mask)
    tl.store(cache_ptr + slot * stride_cs + h * stride_ch + d, x, mask=mask)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_kcs, stride_kch, stride_vcs, stride_vch,
    HK: tl.constexpr, DK: tl.constexpr, HV: tl.constexpr, DV: tl.constexpr,
    BLOCK_HK: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_HV: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Program t: store token t's K and V at its slot; PAD_SLOT_ID slots are skipped."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    store_token(k_ptr, kc_ptr, t, slot, stride_kt, stride_kh, stride_kcs, stride_kch,
                 HK, DK, BLOCK_HK, BLOCK_DK)  # fmt: skip
    store_token(v_ptr, vc_ptr, t, slot, stride_vt, stride_vh, stride_vcs, stride_vch,
                 HV, DV, BLOCK_HV, BLOCK_DV)  # fmt: skip


def check_devices(device: torch.device, **tensors: torch.Tensor | None) -> None:
    """ValueError naming the first tensor not on `device`: Triton's own error names only an argument index
    ("Pointer argument (at 2) cannot be accessed from Triton (cpu tensor?)"), and a torch op mixing devices
    fails further on. A few attribute reads a call."""
    for name, x in tensors.items():
        if x is not None and x.device != device:
            raise ValueError(f"{name} is on {x.device}, not {device}: the kernel needs every tensor on one device")


def _token_major(x: torch.Tensor, cache: torch.Tensor, t: int) -> torch.Tensor:
    """x [T, H, D] in the cache's dtype with a contiguous last dim, checked against the cache [NB, bs, H, D]."""
    assert x.shape == (t, *cache.shape[2:]), f"tokens {tuple(x.shape)} vs cache {tuple(cache.shape)}"
    assert cache.stride(0) == cache.shape[1] * cache.stride(1) and cache.stride(3) == 1, "slot-contiguous cache"
    x = x.to(cache.dtype)  # on the host, as the reference rounds (the interpreter's bf16 cast truncates)
    return x if x.stride(2) == 1 else x.contiguous()


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V at its slot; tokens with slot PAD_SLOT_ID are skipped."""
    check_devices(k_cache.device, k=k, v=v, v_cache=v_cache, slot_mapping=slot_mapping)
    t = slot_mapping.shape[0]
    k, v = _token_major(k, k_cache, t), _token_major(v, v_cache, t)
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        HK=k.shape[1], DK=k.shape[2], HV=v.shape[1], DV=v.shape[2],
        BLOCK_HK=triton.next_power_of_2(k.shape[1]), BLOCK_DK=triton.next_power_of_2(k.shape[2]),
        BLOCK_HV=triton.next_power_of_2(v.shape[1]), BLOCK_DV=triton.next_power_of_2(v.shape[2]),
    )  # fmt: skip


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
def _load_rows(ptr, rows, ok, DIM: tl.constexpr, BLOCK: tl.constexpr, UPCAST: tl.constexpr):
    """[len(rows), BLOCK] tile of vectors of DIM contiguous elements at element offsets `rows` (0 where not ok)."""
    d = tl.arange(0, BLOCK)
    x = tl.load(ptr + rows[:, None] + d[None, :], mask=ok[:, None] & (d < DIM)[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _online_softmax(s, vt, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold one key tile into the running max m_i, sum l_i and output acc (scores s in log2 units)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _tile_origin(qsl_ptr, num_rows, BLOCK_Q: tl.constexpr, DECODE: tl.constexpr):
    """(row, first query of the tile relative to the row) of this program's tile."""
    j = tl.program_id(0)
    if DECODE:
        r = j
        t0 = j * 0
    else:
        r = _row_of_tile(qsl_ptr, j, num_rows, BLOCK_Q)
        t0 = (j - (tl.load(qsl_ptr + r) // BLOCK_Q + r)) * BLOCK_Q
    return r, t0


@triton.jit
def _key_range(table, ctx, t0, n, window, BLOCK_Q: tl.constexpr, USE_WINDOW: tl.constexpr):
    """[lo, hi): the key positions the tile's queries see. hi: one past the last query's position (<= seq_len);
    lo: the first query's first visible key. Empty for a padding row (its table starts with PAD_SLOT_ID)."""
    hi = ctx + tl.minimum(t0 + BLOCK_Q, n)
    lo = hi * 0
    if USE_WINDOW:
        lo = tl.maximum(lo, ctx + t0 - window + 1)
    return lo, tl.where(tl.load(table) < 0, lo, hi)


@triton.jit
def _store_result(o_ptr, part_ptr, ml_ptr, tokens, head, ok, acc, m_i, l_i, stride_ot, stride_oh, num_heads,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):  # fmt: skip
    """The normalized output of rows (tokens, head), or with SPLITS > 1 this split's partial softmax."""
    d = tl.arange(0, BLOCK_D)
    if SPLITS > 1:
        part = (tokens * num_heads + head) * SPLITS + tl.program_id(2)  # (m,)
        tl.store(part_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=ok[:, None])
        tl.store(ml_ptr + part * 2, m_i, mask=ok)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=ok)
    else:
        o_ptrs = o_ptr + (tokens * stride_ot + head * stride_oh)[:, None] + d[None, :]
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=ok[:, None] & (d < HEAD_DIM)[None, :])


@triton.jit
def _attention_kernel(
    q_ptr, q2_ptr, k_ptr, v_ptr, r_ptr, o_ptr, tables_ptr, ctx_ptr, qsl_ptr,
    num_rows, block_size, window, qk_scale,
    stride_qt, stride_qh, stride_q2t, stride_q2h, stride_ot, stride_oh,
    stride_ks, stride_kh, stride_rs, stride_tb, part_ptr, ml_ptr, num_heads,
    GROUP: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    ROPE_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DECODE: tl.constexpr, USE_WINDOW: tl.constexpr, V_IS_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """Program (tile, kv head x head block, split): one row's BLOCK_Q queries x HEADS of the kv head's
    GROUP query heads, over the row's keys (SPLITS > 1: over the split's share of them, whole key tiles;
    the unnormalized partial goes to part_ptr / ml_ptr for _merge_splits_kernel). MLA (ROPE_DIM > 0,
    V_IS_K): the score adds q2 . rope key, and the value is the key tile itself (the latent)."""
    r, t0 = _tile_origin(qsl_ptr, num_rows, BLOCK_Q, DECODE)
    q_begin = tl.load(qsl_ptr + r)
    n = tl.load(qsl_ptr + r + 1) - q_begin
    if t0 >= n:
        return
    kvh = tl.program_id(1) // tl.cdiv(GROUP, HEADS)
    g = tl.program_id(1) % tl.cdiv(GROUP, HEADS) * HEADS + tl.arange(0, BLOCK_M) % HEADS  # (m,) in the group
    tok = tl.arange(0, BLOCK_M) // HEADS
    row_ok = (tok < BLOCK_Q) & (t0 + tok < n) & (g < GROUP)
    ctx = tl.load(ctx_ptr + r)
    qpos = ctx + t0 + tok  # (m,) absolute positions
    tokens, head = q_begin + t0 + tok, kvh * GROUP + g
    qv = _load_rows(q_ptr, tokens * stride_qt + head * stride_qh, row_ok, HEAD_DIM, BLOCK_D, UPCAST)
    if ROPE_DIM > 0:
        q2 = _load_rows(q2_ptr, tokens * stride_q2t + head * stride_q2h, row_ok, ROPE_DIM, BLOCK_R, UPCAST)
    table = tables_ptr + r * stride_tb
    lo, hi = _key_range(table, ctx, t0, n, window, BLOCK_Q, USE_WINDOW)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked key tile leaves rows unchanged
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    share = tl.cdiv(tl.cdiv(hi - lo // BLOCK_N * BLOCK_N, SPLITS), BLOCK_N) * BLOCK_N  # keys per split
    first = lo // BLOCK_N * BLOCK_N + tl.program_id(2) * share
    for start in range(first, tl.minimum(first + share, hi), BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = (kpos >= lo) & (kpos < hi)
        slot = tl.load(table + kpos // block_size, mask=k_ok, other=0) * block_size + kpos % block_size  # (n,)
        kt = _load_rows(k_ptr, slot * stride_ks + kvh * stride_kh, k_ok, HEAD_DIM, BLOCK_D, UPCAST)
        s = tl.dot(qv, tl.trans(kt), input_precision=PRECISION)  # (m, n)
        if ROPE_DIM > 0:
            rt = _load_rows(r_ptr, slot * stride_rs, k_ok, ROPE_DIM, BLOCK_R, UPCAST)
            s += tl.dot(q2, tl.trans(rt), input_precision=PRECISION)
        if V_IS_K:  # noqa: SIM108 (a constexpr branch: one side is never compiled)
            vt = kt
        else:
            vt = _load_rows(v_ptr, slot * stride_ks + kvh * stride_kh, k_ok, HEAD_DIM, BLOCK_D, UPCAST)
        seen = k_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        if USE_WINDOW:
            seen = seen & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(seen, s * qk_scale, float("-inf"))  # log2 units
        m_i, l_i, acc = _online_softmax(s, vt, m_i, l_i, acc, PRECISION)
    _store_result(o_ptr, part_ptr, ml_ptr, tokens, head, row_ok, acc, m_i, l_i, stride_ot, stride_oh, num_heads,
                  HEAD_DIM, BLOCK_D, SPLITS)  # fmt: skip


@triton.jit
def _merge_splits_kernel(
    part_ptr, ml_ptr, o_ptr, stride_ot, stride_oh, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """Program (token, head): combine the SPLITS partial softmaxes (max m, sum l, unnormalized acc)."""
    part = (tl.program_id(0) * num_heads + tl.program_id(1)) * SPLITS + tl.arange(0, SPLITS)
    m = tl.load(ml_ptr + part * 2)
    l_sum = tl.load(ml_ptr + part * 2 + 1)
    w = tl.exp2(m - tl.max(m, 0))  # an empty split (m = -1e30, l = 0) weighs 0 beside a non-empty one
    d = tl.arange(0, BLOCK_D)
    acc = tl.sum(tl.load(part_ptr + part[:, None] * BLOCK_D + d[None, :]) * w[:, None], 0)
    total = tl.sum(w * l_sum, 0)
    out = acc / tl.where(total > 0, total, 1.0)
    o_ptrs = o_ptr + tl.program_id(0) * stride_ot + tl.program_id(1) * stride_oh + d
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=d < HEAD_DIM)


# Prefill tiles of 16-bit queries at head_dim 256 (Qwen3.5/3.6's attention): (BLOCK_M, BLOCK_N, num_warps).
# Measured on an H100 (gpu_check.py's tune section, 8k tokens, GQA 8, bf16): 2.65 ms against 10.1 ms for the
# 32-row tiles (208 vs 55 TFLOP/s); each K/V tile loaded serves 4x the query rows. fp32 operands of that size
# would not fit the shared memory; MLA's 512-wide latents keep the small tiles.
HD256_PREFILL_TILES = (128, 32, 8)


def _tiles(group: int, block_d: int, decode: bool, half: bool = False,
           prefill: tuple[int, int, int] | None = None) -> tuple[int, int, int, int, int]:  # fmt: skip
    """(HEADS, BLOCK_Q, BLOCK_M, BLOCK_N, num_warps): query heads per program (the GQA group, padded, up to
    16), queries per tile, tile rows (queries x heads, >= 16 for tl.dot), keys per step; smaller tiles and
    more warps for wide heads (MLA latents); `half`: 16-bit queries (HD256_PREFILL_TILES at head_dim 256);
    `prefill`: (BLOCK_M, BLOCK_N, num_warps) of a prefill step instead (attend's `tiles`)."""
    heads = min(triton.next_power_of_2(group), 16)
    wide = block_d > 128
    if decode:
        block_m = max(16, heads)
        return heads, 1, block_m, 32 if wide else 64, 8 if wide else 4
    if prefill is None and half and block_d == 256:
        prefill = HD256_PREFILL_TILES
    if prefill is not None:
        block_m, block_n, warps = prefill
        if block_m % heads or block_m < 16 or block_n < 16:
            raise ValueError(f"prefill tiles {prefill}: BLOCK_M a multiple of the {heads} heads per program, >= 16")
        return heads, block_m // heads, block_m, block_n, warps
    block_m = max(32 if wide else 64, heads)
    return heads, block_m // heads, block_m, 32 if wide else 64, 8 if wide else 4


# Key splits of a prefill step: at least this many keys per split, and the partial softmaxes kept within this
# many bytes (a step of many queries has programs enough without splitting).
PREFILL_SPLIT_KEYS = 1024
SPLIT_PARTIAL_BYTES = 64 << 20


def _splits(meta: AttentionMetadata, programs: int, tokens: int = 0, heads: int = 0, block_d: int = 0) -> int:
    """Key splits per program (a power of two): enough programs for ~2 waves on an H100 (132 SMs), at least 256
    keys per split in a decode step. A prefill step splits only where its programs are few and its rows' keys
    many (a few new tokens over a long cached prefix: 64 queries over 8k keys are ~5-40 programs, each walking
    every key alone otherwise), at least PREFILL_SPLIT_KEYS keys per split, its `tokens` x `heads` partials of
    `block_d` fp32 within SPLIT_PARTIAL_BYTES. Any count gives the same result up to rounding."""
    per_split = 256 if meta.is_decode else PREFILL_SPLIT_KEYS
    by_work = triton.next_power_of_2(triton.cdiv(max(meta.seq_lens_list), per_split))
    splits = min(by_work, triton.next_power_of_2(triton.cdiv(264, programs)), 32)
    if not meta.is_decode:
        while splits > 1 and tokens * heads * splits * block_d * 4 > SPLIT_PARTIAL_BYTES:
            splits //= 2
    return splits


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    splits: int | None = None,
    tiles: tuple[int, int, int] | None = None,
) -> None:
    """out[T, Hq, D] = causal attention of q [T, Hq, D] over the cached keys/values of every row (nothing
    is written to the caches). rope = (q2 [T, Hq, P], rope_cache [NB, bs, 1, P]): MLA's latent form, where
    the score adds q2 . rope key and v_cache is k_cache (the latents). splits: key splits per program of a
    step (a power of two; None: chosen from the shapes, _splits). tiles: (BLOCK_M, BLOCK_N, num_warps) of a
    prefill step instead of _tiles' (benchmarks/gpu_check.py's tile study; any tiling gives the same result
    up to rounding)."""
    check_devices(q.device, k_cache=k_cache, v_cache=v_cache, out=out, block_tables=meta.block_tables,
                  context_lens=meta.context_lens, query_start_loc=meta.query_start_loc,
                  q2=None if rope is None else rope[0], rope_cache=None if rope is None else rope[1])  # fmt: skip
    t, hq, dh = q.shape
    hkv = k_cache.shape[2]
    assert hq % hkv == 0 and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[3] == dh and out.shape == q.shape and (sliding_window is None or sliding_window > 0)
    assert rope is None or (v_cache is k_cache and hkv == 1 and rope[1].shape[:3] == k_cache.shape[:3])
    q2, r_cache = rope if rope is not None else (q, k_cache)
    q, q2 = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, q2))
    assert k_cache.stride(-1) == r_cache.stride(-1) == out.stride(-1) == 1
    for cache in (k_cache, r_cache):  # slots are read as block_id * block_size + offset
        assert cache.stride(0) == cache.shape[1] * cache.stride(1) and cache.shape[1] == meta.block_size
    num_rows, group = len(meta.seq_lens_list), hq // hkv
    block_d = max(16, triton.next_power_of_2(dh))
    # the measured tiles (HD256_PREFILL_TILES) for plain 16-bit heads only: MLA's latent form was not measured
    half = q.element_size() == 2 and rope is None
    heads, block_q, block_m, block_n, warps = _tiles(group, block_d, meta.is_decode, half, tiles)
    grid = (num_rows if meta.is_decode else t // block_q + num_rows, hkv * triton.cdiv(group, heads))
    splits = _splits(meta, grid[0] * grid[1], t, hq, block_d) if splits is None else splits
    assert splits == triton.next_power_of_2(splits)
    part = torch.empty((t, hq, splits, block_d) if splits > 1 else (1,), dtype=torch.float32, device=q.device)
    ml = torch.empty((t, hq, splits, 2) if splits > 1 else (1,), dtype=torch.float32, device=q.device)
    upcast = q.dtype != k_cache.dtype or q2.dtype != r_cache.dtype
    precision = "ieee" if upcast or q.dtype == torch.float32 else "tf32"
    _attention_kernel[(*grid, splits)](
        q, q2, k_cache, v_cache, r_cache, out, meta.block_tables, meta.context_lens, meta.query_start_loc,
        num_rows, meta.block_size, sliding_window or 0, scale * LOG2E,
        q.stride(0), q.stride(1), q2.stride(0), q2.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(1), k_cache.stride(2), r_cache.stride(1), meta.block_tables.stride(0), part, ml, hq,
        GROUP=group, HEADS=heads, HEAD_DIM=dh, BLOCK_D=block_d, ROPE_DIM=0 if rope is None else q2.shape[2],
        BLOCK_R=max(16, triton.next_power_of_2(q2.shape[2])), BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        DECODE=meta.is_decode, USE_WINDOW=sliding_window is not None, V_IS_K=v_cache is k_cache,
        UPCAST=upcast, PRECISION=precision, SPLITS=splits, num_warps=warps,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(t, hq)](
            part, ml, out, out.stride(0), out.stride(1), hq, HEAD_DIM=dh, BLOCK_D=block_d, SPLITS=splits
        )


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
    kv_written: bool = False,
) -> torch.Tensor:
    """Write the new K/V (unless `kv_written`: the caller's fused q/k preparation stored them, metadata.KVWrite),
    then causal attention of every row's new queries over its whole sequence (over the last `sliding_window`
    positions of each query, if given).

    Padding rows output zeros and read nothing. `native` (the CPU reference's C decode switch) is accepted
    for the signature and ignored.
    """
    del native
    if not kv_written:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # every token is some row's: all written
    attend(q, k_cache, v_cache, out, meta, scale, sliding_window)
    return out
