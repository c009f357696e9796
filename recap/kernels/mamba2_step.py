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

from recap.kernels.native import NativeUnavailableError, load_library

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


def mamba2_step(
    proj: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    slot_positions: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    ssm_state: torch.Tensor,
    shape: tuple[int, int, int, int],
    dt_bias: torch.Tensor,
    a_log: torch.Tensor,
    d: torch.Tensor,
    time_step_limit: tuple[float, float],
    norm_weight: torch.Tensor | None,
    gate_norm: str,
    group_size: int,
    eps: float,
) -> torch.Tensor:
    """proj [t, z | xbc | dt] (in_proj's output, multipliers applied) -> y [t, H * P], the gated (and normed)
    input of out_proj; updates conv_state [S, conv_dim, K-1], ssm_state [S, H, P, N] and slot_positions at
    `slots` [t] (int64). shape = (H, P, G, N). Every float tensor fp32 and contiguous."""
    h, p, g, n = shape
    t, d_inner = proj.shape[0], h * p
    conv_dim = d_inner + 2 * g * n
    floats = (proj, conv_state, conv_weight, ssm_state, dt_bias, a_log, d)
    if any(x.dtype != torch.float32 or not x.is_contiguous() for x in floats):
        raise ValueError("mamba2_step takes contiguous fp32 tensors")
    if slots.dtype != torch.int64 or positions.dtype != torch.int64 or slot_positions.dtype != torch.int64:
        raise ValueError("mamba2_step takes int64 slots and positions")
    if proj.shape[1] < d_inner + conv_dim + h or conv_weight.shape[0] != conv_dim or h % g:
        raise ValueError(f"mamba2_step: proj {tuple(proj.shape)} and conv {tuple(conv_weight.shape)} do not fit "
                         f"(H, P, G, N) = {shape}")
    if gate_norm != "gate" and (norm_weight is None or d_inner % group_size):
        raise ValueError("mamba2_step: a normed gate needs its weight and groups that divide H * P")
    kconv = conv_weight.shape[-1]
    work = torch.empty(t, conv_dim)
    dts = torch.empty(t, h)
    y = torch.empty(t, d_inner)
    _lib().recap_mamba2_step(
        t, slots.data_ptr(), positions.data_ptr(), slot_positions.data_ptr(), proj.data_ptr(), proj.stride(0),
        conv_state.data_ptr(), conv_weight.data_ptr(), _ptr(conv_bias), kconv, ssm_state.data_ptr(), h, p, g, n,
        dt_bias.data_ptr(), a_log.data_ptr(), d.data_ptr(), time_step_limit[0], time_step_limit[1],
        _ptr(norm_weight), GATE_MODES[gate_norm], group_size, eps, work.data_ptr(), dts.data_ptr(), y.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return y
