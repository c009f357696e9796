"""The gated delta rule's prefill in native C (csrc/gdn_walk.c): kernels/gdn.py's chunk form, per value head, in one
call for a step's packed rows (Gated DeltaNet's decay per head and KDA's per key channel).

The torch op (gdn.gated_delta_rule) builds every piece's matrices with batched torch ops, then carries the state
through a Python loop over pieces (a few ATen calls each); here each (piece, value head) runs its whole chunk form
in C with the state held in cache, the q/k L2 norms done as it reads them, and the states of chunk ends written
straight into their slots. `gated_delta_rule_native` has gated_delta_rule's signature and side effects; decode
batches, other devices and the shapes the kernel does not take go to the torch op. Reference: gdn.py's
gated_delta_rule_ref (and gated_delta_rule, the torch chunk form), compared on random inputs in
tests/kernels/test_gdn_walk.py.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from recap.kernels.gdn import PIECE, gated_delta_rule
from recap.kernels.gdn_step import L2_EPS
from recap.kernels.kda import kda
from recap.kernels.metadata import SSMMetadata
from recap.kernels.native import address as _p
from recap.kernels.native import load_library, loads
from recap.kernels.step_plan import StepPlan, check_slot_positions

_I64, _INT, _F32 = ctypes.c_int64, ctypes.c_int, ctypes.c_float
MAX_PIECE, MAX_DIM, ROW_BLOCK = 64, 256, 8  # gdn_walk.c's limits (Dk a multiple of its row block)
_ERRORS = {-1: "a state slot outside the cache", -2: "a piece outside 1 .. 64 tokens",
           -3: "heads the kernel does not take", -4: "out of memory"}  # fmt: skip


@functools.cache
def gdn_walk_library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The library (raises NativeUnavailableError); `extra_flags`: another instruction set's build (tests)."""
    lib = load_library("gdn_walk", extra_flags)
    lib.recap_gdn_prefill.restype = _INT
    return lib


@functools.cache
def gdn_walk_available() -> bool:
    """Whether the kernel builds and loads here."""
    return loads(gdn_walk_library)


def _rows(x: torch.Tensor, heads: int, dim: int) -> tuple[torch.Tensor, int]:
    """x [T, heads, dim] as fp32 with contiguous heads (a view where it is one), and its stride between tokens."""
    x = x.float()
    if x.stride(-1) != 1 or x.stride(-2) != dim:
        x = x.contiguous()
    return x, x.stride(0)


def takes(q: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state: torch.Tensor, piece: int) -> bool:
    """Whether the native kernel runs this call (else the torch op does)."""
    hk, dk = q.shape[1:]
    hv, dv = v.shape[1:]
    return (
        q.device.type == "cpu" and state.dtype == torch.float32 and state.is_contiguous() and hv % hk == 0
        and dk % ROW_BLOCK == 0 and dk <= MAX_DIM and dv <= MAX_DIM and 1 <= piece <= MAX_PIECE
        and g.dim() in (2, 3) and gdn_walk_available()
    )  # fmt: skip


def gated_delta_rule_native(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
    piece: int = PIECE,
    normalize_qk: bool = False,
) -> torch.Tensor:
    """gdn.gated_delta_rule (same signature and side effects), prefill steps in C; decode batches and what the
    kernel does not take run the torch op."""
    if meta.is_decode or not takes(q, v, g, state, piece):
        return gated_delta_rule(q, k, v, g, beta, state, meta, slot_positions, piece, normalize_qk)
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    (q, qs), (k, ks), (v32, vs) = _rows(q, hk, dk), _rows(k, hk, dk), _rows(v, hv, dv)
    g, beta = g.float().contiguous(), beta.float().contiguous()
    check_slot_positions(slot_positions)
    out = torch.empty(t, hv, dv)
    plan = StepPlan.of(meta)
    rc = gdn_walk_library().recap_gdn_prefill(
        *plan.walk_args(), _p(q), _I64(qs), _p(k), _I64(ks), _p(v32), _I64(vs), _p(g), _p(beta), _I64(hk), _I64(hv),
        _I64(dk), _I64(dv), _INT(g.dim() == 3), _INT(normalize_qk), _F32(L2_EPS), _p(state), _I64(state.shape[0]),
        None if slot_positions is None else _p(slot_positions), _I64(piece), _p(out), _INT(torch.get_num_threads()),
    )  # fmt: skip
    if rc:
        raise ValueError(f"gdn_walk: {_ERRORS.get(rc, rc)}")
    return out.to(v.dtype)


def kda_native(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    meta: SSMMetadata,
    slot_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """kda.kda (same signature and side effects): prefill steps in C, the q/k norms and the query scale done there
    (kda._prepare's); decode batches and what the kernel does not take run the torch op."""
    if meta.is_decode or not takes(q, v, g, state, PIECE):
        return kda(q, k, v, g, beta, state, meta, slot_positions)
    return gated_delta_rule_native(q, k, v, g, beta, state, meta, slot_positions, normalize_qk=True)
