"""The native Gated DeltaNet decode step (csrc/gdn_step.c): everything between the input projections and out_proj
of a plain decode step in one call (the conv window, the q/k norms, the gates, the delta rule on the slot's
matrix state, the gated output norm).

On the module path a Qwen3.5 GDN layer ran ~40 ATen ops per decode step, and their dispatch cost more than the
arithmetic at batch 1. `GdnStep` binds the kernel to one mixer's weights; backends/decode_graph.py records it.
Reference: `gdn_step_ref`, the module path's torch ops (layers/gdn.py's decode arithmetic), compared on random
inputs in tests/backends/test_gdn_graph.py.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from recap.kernels.conv1d import causal_conv1d_update
from recap.kernels.gdn import gdn_gates, normalize_qk_inputs
from recap.kernels.gdn_decode import gated_delta_rule_update
from recap.kernels.native import address as _p
from recap.kernels.native import load_library, loads, raw_function

_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
L2_EPS = 1e-6  # kernels/gdn.py's l2_normalize
_ERRORS = {-1: "a state slot outside the cache", -2: "a conv of other than 2 to 65 taps",
           -3: "value heads not a multiple of key heads, or a value head above 1024"}  # fmt: skip


@functools.cache
def gdn_step_library() -> ctypes.CDLL:
    """The library (raises NativeUnavailableError)."""
    return load_library("gdn_step")


@functools.cache
def gdn_step_available() -> bool:
    """Whether the kernel builds and loads here."""
    return loads(gdn_step_library)


class GdnStep:
    """The kernel bound to one GDN mixer's weights: conv_w [conv_dim, K], A_log and dt_bias [Hv], the output norm's
    weight [Dv] and eps; heads (Hk, Hv, Dk, Dv). The tensors must stay where they are while it is used."""

    def __init__(self, conv_w: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, norm_w: torch.Tensor,
                 norm_eps: float, heads: tuple[int, int, int, int]) -> None:  # fmt: skip
        hk, hv, dk, dv = heads
        self.conv_dim, self.kconv = 2 * hk * dk + hv * dv, conv_w.shape[1]
        for t, shape in ((conv_w, (self.conv_dim, self.kconv)), (A_log, (hv,)), (dt_bias, (hv,)), (norm_w, (dv,))):
            if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != shape:
                raise ValueError(f"a GDN step weight {tuple(t.shape)} {t.dtype}: contiguous fp32 {shape} expected")
        if hv % hk or not 2 <= self.kconv <= 65 or dv > 1024:
            raise ValueError(f"GDN heads {heads} with a {self.kconv}-tap conv: the native step does not run them")
        self.heads, self.norm_eps = heads, norm_eps
        self.weights = (conv_w, A_log, dt_bias, norm_w)

    def _check(self, rows: int, conv_state: torch.Tensor, state: torch.Tensor, *inputs: torch.Tensor) -> None:
        hk, hv, dk, dv = self.heads
        widths = (self.conv_dim, hv * dv, hv, hv)
        for t, w in zip(inputs, widths):
            if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != (rows, w):
                raise ValueError(f"a GDN step input {tuple(t.shape)}: contiguous fp32 ({rows}, {w}) expected")
        s = state.shape[0]
        for t, shape in ((conv_state, (s, self.conv_dim, self.kconv - 1)), (state, (s, hv, dk, dv))):
            if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != shape:
                raise ValueError(f"a GDN state {tuple(t.shape)} {t.dtype}: contiguous fp32 {shape} expected")

    def graph_call(
        self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, slots: ctypes.c_void_p,
        dst: ctypes.c_void_p | None, positions: ctypes.c_void_p, slot_positions: torch.Tensor,
        conv_state: torch.Tensor, state: torch.Tensor, threads: ctypes.c_int,
    ) -> tuple[ctypes._CFuncPtr, tuple, list[torch.Tensor]]:  # fmt: skip
        """The step of the rows of fixed buffers qkv [t, conv_dim], z [t, Hv Dv], b and a [t, Hv] as a decode graph
        replays it; slots, dst (None: the same slots) and positions are addresses of the step's int64 [t] tensors,
        set before each replay. Returns (function, arguments, [out [t, Hv Dv], scratch]): buffers the caller keeps
        alive with the graph."""
        t = qkv.shape[0]
        self._check(t, conv_state, state, qkv, z, b, a)
        hk, hv, dk, dv = self.heads
        conv_w, A_log, dt_bias, norm_w = self.weights
        work, out = torch.empty(t, self.conv_dim + 2 * hv), torch.empty(t, hv * dv)
        args = (
            _I64(t), slots, dst, positions, _p(slot_positions), _p(qkv), _p(z), _p(b), _p(a), _I64(hk), _I64(hv),
            _I64(dk), _I64(dv), _p(conv_w), _I64(self.kconv), _p(conv_state), _p(state), _I64(state.shape[0]),
            _p(A_log), _p(dt_bias), _p(norm_w), _F32(self.norm_eps), _F32(L2_EPS), _p(work), _p(out), threads,
        )  # fmt: skip
        return raw_function(gdn_step_library(), "recap_gdn_step", _INT), args, [out, work]

    def __call__(
        self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_state: torch.Tensor,
        state: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, slot_positions: torch.Tensor,
        dst: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """One step on tensors (`gdn_step_ref`'s signature); ValueError for a slot outside the state."""
        fn, args, (out, _) = self.graph_call(
            qkv, z, b, a, _p(slots), None if dst is None else _p(dst), _p(positions), slot_positions, conv_state,
            state, _INT(torch.get_num_threads()),
        )  # fmt: skip
        rc = fn(*args)
        if rc:
            raise ValueError(f"gdn_step: {_ERRORS.get(rc, rc)} (slots {slots.tolist()})")
        return out


def gdn_step_ref(
    step: GdnStep, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_state: torch.Tensor,
    state: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, slot_positions: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The module path's decode arithmetic (layers/gdn.py: the conv update, normalize_qk_inputs, gdn_gates,
    gated_delta_rule_update, HeadGatedRMSNorm's torch ops) on the same arguments (a plain step: no dst)."""
    hk, hv, dk, dv = step.heads
    conv_w, A_log, dt_bias, norm_w = step.weights
    n, kd = qkv.shape[0], hk * dk
    y = causal_conv1d_update(qkv, conv_state, conv_w, None, slots, "silu")
    q, k, v = y.split([kd, kd, hv * dv], dim=-1)
    q, k = normalize_qk_inputs(q.reshape(n, hk, dk), k.reshape(n, hk, dk))
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    o = gated_delta_rule_update(state, q, k, v.reshape(n, hv, dv), g, beta, slots, slot_positions, positions)
    # HeadGatedRMSNorm: o / rms(o) per head (its one-reduction inverse RMS), times the weight, times silu(z)
    inv = torch.linalg.vector_norm(o, dim=-1, keepdim=True).square_().div_(dv).add_(step.norm_eps).rsqrt_()
    h = o * inv * norm_w
    return h.mul_(F.silu(z.reshape(n, hv, dv))).reshape(n, hv * dv)
