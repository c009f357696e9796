"""Triton attention input preparation, one launch per layer: per-head q/k RMS norms, RoPE and the output gate's
sigmoid, the GPU twin of the attention layers' torch ops (model/layers/qk_rope.py holds them, the reference).

On an H100 a batch-1 decode step of a Qwen3.5-like hybrid replayed ~20 launches per attention layer for these
few hundred values: the q/k norms, the cos/sin of the positions (an fp32 product, fp64 cos and sin, casts, a
cat), the rotation (slices, a negation, a cat, products, a sum, a cat for the unrotated dims), the gate's split
and sigmoid. One program per token does all of it in registers.

Per token t, for q's heads and then k's (each [H, D], any token and head strides, unit stride along D):
- optional per-head RMS norm over D (fp32): `NORM` 1 rounds y to the output dtype and multiplies by the weight
  in that dtype (RMSNorm's `weight * y.to(dtype)`), 2 multiplies by (1 + w) in fp32 (OffsetRMSNorm, Qwen3.5's
  zero-centred norm); the normed head is rounded to the dtype, as the module returns it;
- RoPE on the leading R = 2 * len(inv_freq) dims, "rotate half" pairs (c, c + R/2) (layers/rotary.py): the angle
  pos * inv_freq is an fp32 product, its cos and sin are taken in fp64 and rounded to the dtype (through fp32, as
  torch's cast does), and out = x * cos + rotate_half(x) * sin with each product and the sum rounded to the dtype
  and no fused multiply-add (enable_fp_fusion=False), as the module's separate torch ops do; dims >= R pass.
- optional gate [T, Hq, D] (Qwen3.5's q_proj half): sigmoid(gate) rounded to the dtype, written as [T, Hq * D].
Each token's result depends on that token alone (batch-invariant): a prefill row and the decode step of the same
token give the same bits.

Optionally (`kv_write`, metadata.KVWrite) the same program also stores its prepared k and its v row into the
paged KV cache at the token's slot, as triton/paged_attention.py's write_kv does (same layout, same dtype: the
caches' must be q's), and nothing for a PAD_SLOT_ID row: the attention op then skips its own write (its
`kv_written`), one launch fewer per attention layer and step (vLLM fuses RoPE with reshape_and_cache, SGLang the
q/k norms, RoPE and the cache set, the same way: one program per token, the slot read once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from recap.kernels.metadata import KVWrite
from recap.kernels.triton.paged_attention import check_devices, store_token

NORM_NONE, NORM_WEIGHT_IN_DTYPE, NORM_OFFSET = 0, 1, 2


@triton.jit
def _normed(x, w, inv, o_ptr, NORM: tl.constexpr):
    """x * inv times the weight as the norm modules take it, rounded to o_ptr's dtype (returned in fp32)."""
    dt = o_ptr.dtype.element_ty
    y = x * inv
    y = w * y.to(dt).to(tl.float32) if NORM == 1 else y * (1.0 + w)
    return y.to(dt).to(tl.float32)


@triton.jit
def _heads(x_ptr, w_ptr, o_ptr, t, stride_t, stride_h, cos, sin, eps, c_ptr, slot, stride_cs, stride_ch,
           H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
           NORM: tl.constexpr, WRITE: tl.constexpr):  # fmt: skip
    """Token t's H heads of x: normed and rotated into o [T, H, D] (contiguous); with WRITE, also into the cache
    c at `slot` (viewed as [slots, H, D]) unless the slot is PAD_SLOT_ID."""
    dt = o_ptr.dtype.element_ty
    h = tl.arange(0, BLOCK_H)[:, None]
    c = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < H) & (c < D)
    base = x_ptr + t * stride_t + h * stride_h
    x = tl.load(base + c, mask=mask, other=0.0).to(tl.float32)
    half = R // 2
    partner = tl.where(c < half, c + half, c - half)  # the other dim of c's rotated pair (c < R)
    pmask = mask & (c < R)
    xp = tl.load(base + partner, mask=pmask, other=0.0).to(tl.float32)
    if NORM != 0:
        inv = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]  # (h, 1)
        w = tl.load(w_ptr + c, mask=c < D, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=c < R, other=0.0).to(tl.float32)
        x = _normed(x, w, inv, o_ptr, NORM)
        xp = _normed(xp, wp, inv, o_ptr, NORM)
    if R > 0:
        rotated = tl.where(c < half, -xp, xp)  # rotate_half: (-x2, x1)
        out = (x * cos).to(dt).to(tl.float32) + (rotated * sin).to(dt).to(tl.float32)
        x = tl.where(c < R, out, x)
    tl.store(o_ptr + t * (H * D) + h * D + c, x.to(dt), mask=mask)
    if WRITE and slot >= 0:
        tl.store(c_ptr + slot * stride_cs + h * stride_ch + c, x.to(dt), mask=mask)


@triton.jit
def _rope_qk_kernel(
    q_ptr, k_ptr, g_ptr, pos_ptr, inv_ptr, qw_ptr, kw_ptr, qo_ptr, ko_ptr, go_ptr,
    v_ptr, kc_ptr, vc_ptr, slot_ptr,
    sq_t, sq_h, sk_t, sk_h, sg_t, sg_h, sv_t, sv_h, s_cs, s_ch, eps,
    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr, GATE: tl.constexpr,
    WRITE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t) if WRITE else -1  # the token's cache slot (PAD_SLOT_ID: none)
    dt = qo_ptr.dtype.element_ty
    c = tl.arange(0, BLOCK_D)[None, :]
    cos = tl.zeros((1, BLOCK_D), dtype=tl.float32)
    sin = tl.zeros((1, BLOCK_D), dtype=tl.float32)
    if R > 0:
        pos = tl.load(pos_ptr + t).to(tl.float32)
        freq = tl.load(inv_ptr + c % (R // 2), mask=c < R, other=0.0).to(tl.float32)
        angle = (pos * freq).to(tl.float64)  # the fp32 angle, its cos and sin in fp64 (RotaryEmbedding.cos_sin)
        cos = tl.cos(angle).to(tl.float32).to(dt).to(tl.float32)
        sin = tl.sin(angle).to(tl.float32).to(dt).to(tl.float32)
    _heads(q_ptr, qw_ptr, qo_ptr, t, sq_t, sq_h, cos, sin, eps, qo_ptr, slot, 0, 0,
           HQ, D, R, BLOCK_HQ, BLOCK_D, NORM, False)  # fmt: skip
    _heads(k_ptr, kw_ptr, ko_ptr, t, sk_t, sk_h, cos, sin, eps, kc_ptr, slot, s_cs, s_ch,
           HK, D, R, BLOCK_HK, BLOCK_D, NORM, WRITE)  # fmt: skip
    if WRITE and slot >= 0:
        store_token(v_ptr, vc_ptr, t, slot, sv_t, sv_h, s_cs, s_ch, HK, D, BLOCK_HK, BLOCK_D)
    if GATE:
        h = tl.arange(0, BLOCK_HQ)[:, None]
        mask = (h < HQ) & (c < D)
        g = tl.load(g_ptr + t * sg_t + h * sg_h + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(go_ptr + t * (HQ * D) + h * D + c, tl.sigmoid(g).to(dt), mask=mask)


def _check(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor | None,
           weights: tuple[torch.Tensor, torch.Tensor] | None, gate: torch.Tensor | None) -> None:  # fmt: skip
    t, _, d = q.shape
    if k.dim() != 3 or k.shape[0] != t or k.shape[2] != d or k.dtype != q.dtype:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, H, D] of one T, D and dtype")
    if q.stride(2) != 1 or k.stride(2) != 1 or (gate is not None and gate.stride(2) != 1):
        raise ValueError("q, k and the gate need adjacent channels within a head (unit stride along D)")
    if positions.shape != (t,):
        raise ValueError(f"positions {tuple(positions.shape)} must be [T] for T = {t}")
    if inv_freq is not None and not 0 < 2 * inv_freq.numel() <= d:
        raise ValueError(f"a rotary dim of {2 * inv_freq.numel()} does not fit heads of {d} dims")
    if weights is not None and any(w.shape != (d,) for w in weights):
        raise ValueError(f"the per-head norm weights must have {d} entries")
    if gate is not None and gate.shape != q.shape:
        raise ValueError(f"the gate's shape {tuple(gate.shape)} is not q's {tuple(q.shape)}")


def _check_kv_write(k: torch.Tensor, kv: KVWrite) -> None:
    """The caches take k and v as they are: k's shape and dtype, slot-contiguous, one slot per token."""
    v, kc, vc, slots = kv
    check_devices(k.device, v=v, k_cache=kc, v_cache=vc, slot_mapping=slots)
    if v.shape != k.shape or v.stride(2) != 1:
        raise ValueError(f"v {tuple(v.shape)} must be shaped as k {tuple(k.shape)}, with unit stride along D")
    if kc.dim() != 4 or kc.shape[2:] != k.shape[1:] or kc.shape != vc.shape or kc.stride() != vc.stride():
        raise ValueError(f"caches {tuple(kc.shape)}, {tuple(vc.shape)} must be [NB, bs, Hk, D] of k's heads, alike")
    if not kc.dtype == vc.dtype == v.dtype == k.dtype:
        raise ValueError(f"the caches ({kc.dtype}, {vc.dtype}) and v ({v.dtype}) must have q/k's dtype {k.dtype}")
    if kc.stride(0) != kc.shape[1] * kc.stride(1) or kc.stride(3) != 1:
        raise ValueError("the caches' slots must be block_id * block_size + offset with unit stride along D")
    if slots.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping {tuple(slots.shape)} must be [T] for T = {k.shape[0]}")


def rope_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor | None, *,
            weights: tuple[torch.Tensor, torch.Tensor] | None = None, eps: float = 1e-6, offset: bool = False,
            gate: torch.Tensor | None = None,
            kv_write: KVWrite | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """q [T, Hq, D] and k [T, Hk, D] at `positions` [T]: per-head RMS-normed with `weights` (q's, k's; `offset`:
    zero-centred) when given, then rotated on their leading 2 * len(inv_freq) dims (none: None), as new
    contiguous tensors of q's dtype; and sigmoid(gate) [T, Hq * D] for a gate [T, Hq, D] (None without).
    With `kv_write`, the prepared k and kv_write.v are also stored at each token's slot of its caches
    (PAD_SLOT_ID rows: nothing), as paged_attention's write_kv would."""
    _check(q, k, positions, inv_freq, weights, gate)
    if kv_write is not None:
        _check_kv_write(k, kv_write)
    t, hq, d = q.shape
    hk = k.shape[1]
    qo = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((t, hk, d), dtype=q.dtype, device=q.device)
    go = None if gate is None else torch.empty((t, hq * d), dtype=q.dtype, device=q.device)
    if t:
        norm = NORM_NONE if weights is None else NORM_OFFSET if offset else NORM_WEIGHT_IN_DTYPE
        qw, kw = (q, q) if weights is None else weights  # unread without a norm
        g = q if gate is None else gate
        v, kc, vc, slots = (k, k, k, positions) if kv_write is None else kv_write  # unread without a write
        block_d = triton.next_power_of_2(d)
        block_hq, block_hk = triton.next_power_of_2(hq), triton.next_power_of_2(hk)
        _rope_qk_kernel[(t,)](
            q, k, g, positions, q if inv_freq is None else inv_freq, qw, kw, qo, ko, q if go is None else go,
            v, kc, vc, slots, q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0), g.stride(1),
            v.stride(0), v.stride(1), kc.stride(1), kc.stride(2), eps,
            HQ=hq, HK=hk, D=d, R=0 if inv_freq is None else 2 * inv_freq.numel(),
            BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d, NORM=norm, GATE=gate is not None,
            WRITE=kv_write is not None,
            num_warps=max(1, min(8, block_hq * block_d // 512)), enable_fp_fusion=False,
        )  # fmt: skip
    return qo, ko, go
