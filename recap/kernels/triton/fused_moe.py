"""Routed experts in fixed shapes (GPU twin of the MoE modules' per-expert loops, model/layers/moe.py, their
reference): the kernel set's `moe_experts`.

The loops read the host mid-step (which experts got tokens), so a CUDA graph could not hold a MoE layer. Here
the token-expert pairs are aligned into blocks of one expert each on the device (one launch, moe_align.py; its
reference kernels/moe.py), then two grouped GEMMs run over every block the bound allows, each block multiplying
its rows by its own expert's weights (vLLM's fused_moe design): gate/up with the activation into h [T*k, I],
then down times the routing weight into y [T*k, D]; the combine sums each token's k rows (deterministic: no
atomics). Unused blocks return at once, so the grid's size follows the token count only.

Weights: w_in [E, 2I, D] (gate rows first, or alternating gate/up rows when `interleaved`; [E, I, D] when not
gated) and w_out [E, D, I], in the activations' float dtype (fp32/bf16/fp16). Quantized experts are refused.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from recap.kernels.moe import MOE_ACTIVATIONS, align_pairs
from recap.kernels.triton.moe_align import align_pairs_triton, covers

BLOCK_M = 16  # rows of one block: tl.dot's least, and decode steps route few tokens to each expert
ACT_CODES = {"silu": 0, "swish": 0, "relu": 1, "relu2": 2, "gelu_pytorch_tanh": 3, "gelu_new": 3}
assert set(ACT_CODES) == set(MOE_ACTIVATIONS)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == 0:
        return x * tl.sigmoid(x)
    elif ACT == 1:
        return tl.maximum(x, 0.0)
    elif ACT == 2:
        r = tl.maximum(x, 0.0)
        return r * r
    else:  # gelu, tanh form: tanh(u) = 2 sigmoid(2u) - 1
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return 0.5 * x * (2.0 * tl.sigmoid(2.0 * u))


@triton.jit
def _up_kernel(x_ptr, w_ptr, h_ptr, pair_ptr, block_expert_ptr, n_pairs, top_k, D, I, stride_x, stride_we,
               stride_wn, stride_h, limit, ACT: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
               HAS_LIMIT: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):  # fmt: skip
    """h[pair, n] = act(gate) * up (or act(up)) for one block's pairs and BLOCK_N intermediate channels."""
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    if e < 0:
        return
    pair = tl.load(pair_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < n_pairs
    tok = (pair // top_k).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    if INTERLEAVED:
        gate_rows, up_rows = 2 * offs_n, 2 * offs_n + 1
    else:
        gate_rows, up_rows = offs_n, I + offs_n
    w = w_ptr + e * stride_we
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < D
        a = tl.load(x_ptr + tok[:, None] * stride_x + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        wmask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w + gate_rows[None, :] * stride_wn + offs_k[:, None], mask=wmask, other=0.0)
        acc_g += tl.dot(a, wg, input_precision=PREC)
        if GATED:
            wu = tl.load(w + up_rows[None, :] * stride_wn + offs_k[:, None], mask=wmask, other=0.0)
            acc_u += tl.dot(a, wu, input_precision=PREC)
    # The reference rounds the projections to the activations' dtype before the activation: so do we.
    dt = h_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    if GATED:
        u = acc_u.to(dt).to(tl.float32)
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        h = _act(g, ACT).to(dt).to(tl.float32) * u
    else:
        h = _act(g, ACT)
    tl.store(h_ptr + pair[:, None].to(tl.int64) * stride_h + offs_n[None, :], h.to(dt),
             mask=row_ok[:, None] & n_ok[None, :])  # fmt: skip


@triton.jit
def _down_kernel(h_ptr, w_ptr, y_ptr, pair_ptr, block_expert_ptr, weight_ptr, n_pairs, D, I, stride_h, stride_we,
                 stride_wn, stride_y, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
    """y[pair, n] = routing weight * (h[pair] . w_out[e, n]) for one block's pairs and BLOCK_N output channels."""
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    if e < 0:
        return
    pair = tl.load(pair_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < n_pairs
    rows = pair.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < D
    w = w_ptr + e * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < I
        a = tl.load(h_ptr + rows[:, None] * stride_h + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        wd = tl.load(w + offs_n[None, :] * stride_wn + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.dot(a, wd, input_precision=PREC)
    # The reference rounds each expert's output to the activations' dtype, then weighs it.
    acc = acc.to(h_ptr.dtype.element_ty).to(tl.float32)
    acc = acc * tl.load(weight_ptr + rows, mask=row_ok, other=0.0)[:, None]
    tl.store(y_ptr + rows[:, None] * stride_y + offs_n[None, :], acc, mask=row_ok[:, None] & n_ok[None, :])


def _check(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
           activation: str, gated: bool) -> None:  # fmt: skip
    if activation not in ACT_CODES:
        raise ValueError(f"the fused MoE has no activation {activation!r}; it has {MOE_ACTIVATIONS}")
    for name, t in (("x", x), ("w_in", w_in), ("w_out", w_out)):
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"the fused MoE takes fp32/bf16/fp16 {name}, got {t.dtype} (quantized experts run "
                            "the module's loop)")  # fmt: skip
    if w_in.dtype != x.dtype or w_out.dtype != x.dtype:
        raise TypeError(f"the fused MoE takes weights of x's dtype {x.dtype}: got {w_in.dtype}, {w_out.dtype}")
    e, n_in, d = w_in.shape
    i = n_in // 2 if gated else n_in
    if x.dim() != 2 or x.shape[1] != d or w_out.shape != (e, d, i) or (gated and n_in % 2):
        raise ValueError(f"the fused MoE needs x [T, D], w_in [E, 2I or I, D], w_out [E, D, I]: got {tuple(x.shape)}, "
                         f"{tuple(w_in.shape)}, {tuple(w_out.shape)}")  # fmt: skip
    if experts.shape != weights.shape or experts.dim() != 2 or experts.shape[0] != x.shape[0]:
        raise ValueError(f"experts and weights must be [T, k]: got {tuple(experts.shape)}, {tuple(weights.shape)}")


def fused_moe(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, experts: torch.Tensor,
              weights: torch.Tensor, activation: str = "silu", gated: bool = True, interleaved: bool = False,
              swiglu_limit: float | None = None) -> torch.Tensor:  # fmt: skip
    """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]) -> [T, D] in x's dtype (module docstring)."""
    _check(x, w_in, w_out, experts, weights, activation, gated)
    t, d = x.shape
    num_experts, inter = w_in.shape[0], w_out.shape[2]
    k = experts.shape[1]
    x = x if x.stride(1) == 1 else x.contiguous()
    w_in, w_out = w_in.contiguous(), w_out.contiguous()
    # One launch where the one-program alignment serves the size (decode steps), the torch ops past it (prefill)
    align = align_pairs_triton if covers(t * k, num_experts) else align_pairs
    aligned = align(experts, num_experts, BLOCK_M)
    blocks = aligned.block_expert.numel()
    h = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    y = torch.zeros(t * k, d, dtype=torch.float32, device=x.device)
    if blocks == 0:
        return y.view(t, k, d).sum(1).to(x.dtype)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    bk_in = min(64, max(16, triton.next_power_of_2(d)))
    bn_in = min(64, max(16, triton.next_power_of_2(inter)))
    _up_kernel[(blocks, triton.cdiv(inter, bn_in))](
        x, w_in, h, aligned.pair_ids, aligned.block_expert, t * k, k, d, inter, x.stride(0), w_in.stride(0),
        w_in.stride(1), h.stride(0), float(swiglu_limit or 0.0), ACT=ACT_CODES[activation], GATED=gated,
        INTERLEAVED=interleaved, HAS_LIMIT=swiglu_limit is not None, PREC=prec, BLOCK_M=BLOCK_M, BLOCK_N=bn_in,
        BLOCK_K=bk_in)  # fmt: skip
    bn_out = min(64, max(16, triton.next_power_of_2(d)))
    _down_kernel[(blocks, triton.cdiv(d, bn_out))](
        h, w_out, y, aligned.pair_ids, aligned.block_expert, weights.reshape(-1).float().contiguous(), t * k, d,
        inter, h.stride(0), w_out.stride(0), w_out.stride(1), y.stride(0), PREC=prec, BLOCK_M=BLOCK_M,
        BLOCK_N=bn_out, BLOCK_K=bn_in)  # fmt: skip
    return y.view(t, k, d).sum(1).to(x.dtype)
