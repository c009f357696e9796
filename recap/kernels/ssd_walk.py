"""Mamba2 SSD prefill in native C (csrc/ssd_walk.c): the recurrence walked token by token per head, the state in
register tiles, in one call for a step's packed rows.

The torch op (ssd.ssd) runs the chunked SSD form as batched GEMMs with K = 64 or 128 (30-60 GFLOP/s here at one
thread) plus elementwise passes; the walk does two multiply-adds per state element and token (the decay folded into
per-piece weights, see the C source), which at P = 64, N = 128 is fewer flops than the chunked form's three
products and runs at close to the FMA rate from registers. Checkpoints anywhere inside a chunk cost only the write
of their state. `ssd_native` has ssd's signature and side effects (`sub_chunk` plays no part: the walk has no
sub-chunks); decode batches, other devices and dtypes, and a step whose decay grows somewhere (Delta A > 0, which
no Mamba2 or Lightning layer makes) go to the torch op. Reference: ssd.py's ssd_ref (and ssd), compared on random
inputs in tests/kernels/test_ssd_walk.py.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from recap.kernels.metadata import SSMMetadata
from recap.kernels.native import address as _p
from recap.kernels.native import load_library, loads
from recap.kernels.ssd import SUB_CHUNK, ssd
from recap.kernels.step_plan import StepPlan, check_slot_positions
from recap.kernels.varlen import process_dt

_I64, _INT = ctypes.c_int64, ctypes.c_int
_GROWING = -5  # ssd_walk.c: a decay that grows; the torch op runs the step
_ERRORS = {-1: "a state slot outside the cache", -3: "heads not a multiple of groups", -4: "out of memory"}


@functools.cache
def ssd_walk_library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The library (raises NativeUnavailableError); `extra_flags`: another instruction set's build (tests)."""
    lib = load_library("ssd_walk", extra_flags)
    lib.recap_ssd_prefill.restype = _INT
    return lib


@functools.cache
def ssd_walk_available() -> bool:
    """Whether the kernel builds and loads here."""
    return loads(ssd_walk_library)


def _rows(v: torch.Tensor) -> tuple[torch.Tensor, int]:
    """v [T, a, b] with contiguous inner dims (a view where it has them), and its stride between tokens."""
    if v.stride(-1) != 1 or v.stride(-2) != v.shape[-1]:
        v = v.contiguous()
    return v, v.stride(0)


def takes(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None, state: torch.Tensor) -> bool:
    """Whether the native kernel runs this call (else the torch op does)."""
    nh, p = x.shape[1:]
    return (
        x.device.type == "cpu" and all(v.dtype == torch.float32 for v in (x, B, C, state)) and state.is_contiguous()
        and nh % B.shape[1] == 0 and (D is None or D.numel() in (nh, nh * p)) and ssd_walk_available()
    )  # fmt: skip


def ssd_native(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    ssm_state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
    sub_chunk: int = SUB_CHUNK,
) -> torch.Tensor:
    """ssd.ssd (same signature and side effects), prefill steps in C; decode batches and what the kernel does not
    take run the torch op."""
    args = (x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, ssm_state, meta, slot_positions, sub_chunk)
    if meta.is_decode or not takes(x, B, C, D, ssm_state):
        return ssd(*args)
    check_slot_positions(slot_positions)
    t, nh, p = x.shape
    g, n = B.shape[1:]
    (x32, xs), (b32, bs), (c32, cs) = _rows(x), _rows(B), _rows(C)
    delta = process_dt(dt, dt_bias, dt_softplus, dt_limit).contiguous()  # (t, h): Delta
    a = A.float().contiguous()
    d = None if D is None else D.float().contiguous()
    out = torch.empty(t, nh, p)
    plan = StepPlan.of(meta)
    rc = ssd_walk_library().recap_ssd_prefill(
        *plan.walk_args(), _p(x32), _I64(xs), _p(delta), _p(a), _p(b32), _I64(bs), _p(c32), _I64(cs),
        None if d is None else _p(d), _INT(d is not None and d.numel() != nh), _I64(nh), _I64(p), _I64(g), _I64(n),
        _p(ssm_state), _I64(ssm_state.shape[0]), None if slot_positions is None else _p(slot_positions), _p(out),
        _INT(torch.get_num_threads()),
    )  # fmt: skip
    if rc == _GROWING:
        return ssd(*args)
    if rc:
        raise ValueError(f"ssd_walk: {_ERRORS.get(rc, rc)}")
    return out
