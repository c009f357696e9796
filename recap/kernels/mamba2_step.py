"""The native Mamba2 decode step (csrc/mamba2_step.c): everything between in_proj and out_proj of a plain
decode step in one call.

At batch 1 the Python fast path (model/layers/mamba2_decode.py) still ran ~45 ATen ops per layer, and their
dispatch, the Python around them and three passes over the state (decay, update, y) cost more per step than
the layer's arithmetic. The C kernel reads and writes each slot's state once and computes y in the same pass.
Reference: `mamba2_decode` with the native step off (tests/model/test_mamba2_decode.py compares the two).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from recap.kernels.native import NativeUnavailableError, load_library, raw_function

logger = logging.getLogger(__name__)

GATE_MODES = {"gate": 0, "gated_rmsnorm": 1, "rmsnorm_gate": 2}  # csrc/mamba2_step.c's gate_mode values

_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = load_library("mamba2_step")
    lib.recap_mamba2_step.argtypes = [
        _I64, _P, _P, _P, _P, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _F32, _F32, _P,
        _INT, _I64, _F32, _P, _P, _P, _INT,
    ]  # fmt: skip
    lib.recap_mamba2_step.restype = None
    return lib


def _chain() -> ctypes._CFuncPtr:
    """recap_mamba2_chain: the step with a source and a destination slot per row, rows in order."""
    return raw_function(_lib(), "recap_mamba2_chain")


@functools.cache
def mamba2_step_available() -> bool:
    """Whether the kernel builds and loads here (about a second, once per machine); says why not once."""
    try:
        _lib()
    except NativeUnavailableError as e:
        logger.warning("native Mamba2 decode step unavailable, the torch path runs: %s", e)
        return False
    return True


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class Mamba2Step:
    """The kernel bound to one mixer's weights (checked and their addresses taken once, when built: build it
    again after the weights are replaced). Calling it runs one plain decode step of that mixer."""

    def __init__(
        self,
        conv_weight: torch.Tensor,
        conv_bias: torch.Tensor | None,
        shape: tuple[int, int, int, int],
        dt_bias: torch.Tensor,
        a_log: torch.Tensor,
        d: torch.Tensor,
        time_step_limit: tuple[float, float],
        norm_weight: torch.Tensor | None,
        gate_norm: str,
        group_size: int,
        eps: float,
    ) -> None:
        """shape = (H, P, G, N); conv_weight [conv_dim, 1 or absent, K]; every tensor fp32 and contiguous."""
        h, p, g, n = shape
        self.h, self.d_inner, self.conv_dim = h, h * p, h * p + 2 * g * n
        params = [t for t in (conv_weight, conv_bias, dt_bias, a_log, d, norm_weight) if t is not None]
        if any(x.dtype != torch.float32 or not x.is_contiguous() for x in params):
            raise ValueError("Mamba2Step takes contiguous fp32 weights")
        if conv_weight.shape[0] != self.conv_dim or h % g or any(x.numel() != h for x in (dt_bias, a_log, d)):
            raise ValueError(f"Mamba2Step: conv {tuple(conv_weight.shape)} or the head parameters do not fit "
                             f"(H, P, G, N) = {shape}")
        if gate_norm not in GATE_MODES:
            raise ValueError(f"Mamba2Step: unknown gate {gate_norm!r}; one of {tuple(GATE_MODES)}")
        if gate_norm != "gate" and (norm_weight is None or group_size <= 0 or self.d_inner % group_size):
            raise ValueError("Mamba2Step: a normed gate needs its weight and groups that divide H * P")
        self._keep = [t.detach() for t in params]  # their storage: the addresses below stay valid
        self._static = (
            conv_weight.data_ptr(), _ptr(conv_bias), conv_weight.shape[-1], h, p, g, n, dt_bias.data_ptr(),
            a_log.data_ptr(), d.data_ptr(), time_step_limit[0], time_step_limit[1], _ptr(norm_weight),
            GATE_MODES[gate_norm], group_size, eps,
        )  # fmt: skip

    def _check(self, proj: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        for x in (proj, conv_state, ssm_state):
            if x.dtype != torch.float32 or not x.is_contiguous():
                raise ValueError("Mamba2Step takes contiguous fp32 activations and states")
        if proj.shape[1] != self.d_inner + self.conv_dim + self.h or ssm_state.shape[1] != self.h:
            raise ValueError(f"Mamba2Step: proj {tuple(proj.shape)} or state {tuple(ssm_state.shape)} do not fit")

    def __call__(self, proj: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                 slot_positions: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> torch.Tensor:
        """proj [t, z | xbc | dt] (in_proj's output, multipliers applied) -> y [t, H * P], the gated (and
        normed) input of out_proj; updates conv_state [S, conv_dim, K-1], ssm_state [S, H, P, N] and
        slot_positions at `slots` [t] (int64, distinct)."""
        t = proj.shape[0]
        self._check(proj, conv_state, ssm_state)
        if slots.dtype != torch.int64 or positions.dtype != torch.int64 or slot_positions.dtype != torch.int64:
            raise ValueError("Mamba2Step takes int64 slots and positions")
        (cw, cb, k, h, p, g, n, dtb, alog, d, lo, hi, nw, mode, gs, eps) = self._static
        scratch = torch.empty(t * (self.conv_dim + h + self.d_inner), device="cpu")  # [t, conv out] | [t, dt] | [t, y]
        work = scratch.data_ptr()
        _lib().recap_mamba2_step(
            t, slots.data_ptr(), positions.data_ptr(), slot_positions.data_ptr(), proj.data_ptr(), proj.shape[1],
            conv_state.data_ptr(), cw, cb, k, ssm_state.data_ptr(), h, p, g, n, dtb, alog, d, lo, hi, nw, mode, gs,
            eps, work, work + 4 * t * self.conv_dim, work + 4 * t * (self.conv_dim + h), torch.get_num_threads(),
        )  # fmt: skip
        return scratch[t * (self.conv_dim + h) :].view(t, self.d_inner)

    def graph_call(self, proj: torch.Tensor, slots: ctypes.c_void_p, positions: ctypes.c_void_p,
                   slot_positions: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                   threads: ctypes.c_int, dst_slots: ctypes.c_void_p | None = None,
                   ) -> tuple[ctypes._CFuncPtr, tuple, torch.Tensor]:  # fmt: skip
        """The step of proj's rows as a decode graph replays it: proj [t, proj_dim] a fixed buffer, slots and
        positions the addresses of that step's int64 [t] tensors (set before each replay). Returns (function,
        arguments, y [t, H * P]: the buffer the call writes, which the caller keeps alive with the graph).
        With dst_slots (a verify graph's): row r reads slot slots[r] and writes dst_slots[r], rows in order
        (recap_mamba2_chain: a row may continue the state the row before it wrote)."""
        self._check(proj, conv_state, ssm_state)
        t = proj.shape[0]
        (cw, cb, k, h, p, g, n, dtb, alog, d, lo, hi, nw, mode, gs, eps) = self._static
        scratch = torch.empty(t * (self.conv_dim + h + self.d_inner), device="cpu")
        work = scratch.data_ptr()
        lead = (_I64(t), slots) if dst_slots is None else (_I64(t), slots, dst_slots)
        args = (
            *lead, positions, _P(slot_positions.data_ptr()), _P(proj.data_ptr()), _I64(proj.shape[1]),
            _P(conv_state.data_ptr()), _P(cw), _P(cb), _I64(k), _P(ssm_state.data_ptr()), _I64(h), _I64(p), _I64(g),
            _I64(n), _P(dtb), _P(alog), _P(d), _F32(lo), _F32(hi), _P(nw), _INT(mode), _I64(gs), _F32(eps), _P(work),
            _P(work + 4 * t * self.conv_dim), _P(work + 4 * t * (self.conv_dim + h)), threads,
        )  # fmt: skip
        y = scratch[t * (self.conv_dim + h) :].view(t, self.d_inner)
        fn = raw_function(_lib(), "recap_mamba2_step") if dst_slots is None else _chain()
        return fn, args, y
