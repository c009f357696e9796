"""The causal depthwise conv taps over packed rows in native C (csrc/conv_taps.c): kernels/conv1d.py's causal_conv1d
on a prefill step, for every family with a short conv (Gated DeltaNet's, Mamba2's, LFM2's).

The torch op lays every row out as [its K-1 initial inputs, its tokens] in one buffer (an index_copy per part), runs
K multiply-adds over it and picks the rows' outputs back (index_select); here each token's K taps are read where
they are (the row's tokens, or its initial window) and the windows at chunk ends are copied straight into their
slots; silu is applied in the same pass (to a few ulp of F.silu), saving a pass over the output.
`causal_conv1d_native` has causal_conv1d's signature and side effects; decode batches, other devices and dtypes go
to the torch op. Reference: conv1d.py's causal_conv1d_ref (and causal_conv1d), compared on random inputs in
tests/kernels/test_conv_taps.py.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from recap.kernels.conv1d import _activate, causal_conv1d
from recap.kernels.metadata import SSMMetadata
from recap.kernels.native import address as _p
from recap.kernels.native import load_library, loads
from recap.kernels.step_plan import StepPlan, check_slot_positions

_I64, _INT = ctypes.c_int64, ctypes.c_int


@functools.cache
def conv_taps_library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The library (raises NativeUnavailableError); `extra_flags`: another instruction set's build (tests)."""
    lib = load_library("conv_taps", extra_flags)
    lib.recap_conv_taps.restype = _INT
    return lib


@functools.cache
def conv_taps_available() -> bool:
    """Whether the kernel builds and loads here."""
    return loads(conv_taps_library)


def causal_conv1d_native(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    meta: SSMMetadata,
    activation: str | None = "silu",
    slot_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """conv1d.causal_conv1d (same signature and side effects), prefill steps in C; decode batches, other devices
    and a conv state other than contiguous fp32 run the torch op."""
    if (
        meta.is_decode or x.device.type != "cpu" or conv_state.dtype != torch.float32
        or not conv_state.is_contiguous() or not conv_taps_available()
    ):  # fmt: skip
        return causal_conv1d(x, weight, bias, conv_state, meta, activation, slot_positions)
    check_slot_positions(slot_positions)
    t, d = x.shape
    k = weight.shape[1]
    xf = x.float().contiguous()
    w = weight.float().contiguous()
    b = None if bias is None else bias.float().contiguous()
    nb = meta.state_indices.numel()
    s = StepPlan.of(meta)
    fused = activation in ("silu", "swish")  # in the kernel's pass over y; any other activation: torch's, after
    work = torch.empty(k * d + nb * (k - 1) * d)
    y = torch.empty(t, d)
    rc = conv_taps_library().recap_conv_taps(
        _I64(nb), _p(s.query_start_loc), _p(s.slots), _p(s.has_init), _I64(s.chunk_row.numel()), _p(s.cu),
        _p(s.chunk_row), _p(s.dest), _p(s.end_pos), _p(s.last_chunk), _I64(t), _I64(d), _I64(k), _p(xf), _p(w),
        None if b is None else _p(b), _p(conv_state),
        _I64(conv_state.shape[0]), None if slot_positions is None else _p(slot_positions), _INT(fused), _p(work),
        _p(y), _INT(torch.get_num_threads()),
    )  # fmt: skip
    if rc:
        why = "a state slot outside the cache" if rc == -1 else "a conv of other than 1 to 65 taps"
        raise ValueError(f"conv_taps: {why}")
    return (y if fused else _activate(y, activation, inplace=True)).to(x.dtype)
