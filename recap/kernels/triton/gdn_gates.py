"""Gated DeltaNet's gates in one launch (GPU twin of recap.kernels.gdn.gdn_gates, its reference).

g = -exp(A_log) * softplus(a + dt_bias) (the log decay) and beta = sigmoid(b), fp32, per (token, value head):
torch's ops took ~11 launches per GDN layer and step, each a few microseconds of a decode step on an H100.
softplus follows torch's (threshold 20: x itself above it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _gates_kernel(a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, n, heads, stride_a, stride_b,
                  BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    t, h = i // heads, i % heads
    x = tl.load(a_ptr + t * stride_a + h, mask=mask, other=0.0).to(tl.float32)
    x = x + tl.load(dtb_ptr + h, mask=mask, other=0.0).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    decay = tl.exp(tl.load(alog_ptr + h, mask=mask, other=0.0).to(tl.float32))
    tl.store(g_ptr + i, -decay * softplus, mask=mask)
    bv = tl.load(b_ptr + t * stride_b + h, mask=mask, other=0.0).to(tl.float32)
    tl.store(beta_ptr + i, tl.sigmoid(bv), mask=mask)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(g, beta) [T, H] fp32 from a, b [T, H] (any float dtype, heads contiguous) and A_log, dt_bias [H]."""
    if a.shape != b.shape or a.dim() != 2 or A_log.shape != (a.shape[1],) or dt_bias.shape != A_log.shape:
        raise ValueError(f"gates need a, b [T, H] and A_log, dt_bias [H]: got {tuple(a.shape)}, {tuple(b.shape)}, "
                         f"{tuple(A_log.shape)}, {tuple(dt_bias.shape)}")  # fmt: skip
    a, b = (x if x.stride(-1) == 1 else x.contiguous() for x in (a, b))
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    n = a.numel()
    if n:
        _gates_kernel[(triton.cdiv(n, BLOCK),)](a, b, A_log, dt_bias, g, beta, n, a.shape[1], a.stride(0),
                                                b.stride(0), BLOCK=BLOCK)  # fmt: skip
    return g, beta
