"""The small operations of a captured decode step (csrc/decode_ops.c): embedding rows (fp32 or int8) and an
embedding multiplier, the residual add (scaled or not), an MLP's act(gate) * up or act(x) per activation, RoPE
with the K/V write, gated attention's q / gate split and output gate, and LFM2's gated short conv step.
backends/decode_graph.py replays them by address; the wrappers here call them on tensors, for tests against their
torch references (F.embedding, linear_rows.Int8Rows.lookup_ref, x * m, h + x, h + x * m, layers/activation.py's
activations, RotaryEmbedding.apply with paged_attention.write_kv, conv1d.causal_conv1d_update with
varlen.record_decode_positions, torch.sigmoid over a head's gate half, h * x)."""

from __future__ import annotations

import ctypes
import functools

import torch

from recap.kernels.linear_rows import Int8Rows
from recap.kernels.native import address as _p
from recap.kernels.native import load_library, loads


@functools.cache
def decode_ops_library() -> ctypes.CDLL:
    """The library (raises NativeUnavailableError); backends/decode_graph.py takes raw handles of its functions."""
    return load_library("decode_ops")


@functools.cache
def decode_ops_available() -> bool:
    """Whether the library builds and loads here (linear_rows_available says why not, once)."""
    return loads(decode_ops_library)


def _i64(v: int) -> ctypes.c_int64:
    return ctypes.c_int64(v)


def embed_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """weight [V, D] fp32, ids [n] int64 -> [n, D]; ValueError for an id outside the vocabulary."""
    out = torch.empty(ids.numel(), weight.shape[1], device="cpu")
    if decode_ops_library().recap_embed_rows(_p(weight), _i64(weight.shape[0]), _i64(weight.shape[1]), _p(ids),
                                             _i64(ids.numel()), _p(out)):  # fmt: skip
        raise ValueError(f"a token id of {ids.tolist()} outside the vocabulary of {weight.shape[0]}")
    return out


def embed_rows_int8(rows: Int8Rows, ids: torch.Tensor) -> torch.Tensor:
    """rows[ids] [n, D] fp32 (Int8Rows.lookup_ref) from a table or a tied head's tiles; ValueError for an id
    outside the vocabulary."""
    out = torch.empty(ids.numel(), rows.d, device="cpu")
    if decode_ops_library().recap_embed_rows_i8(_p(rows.q), _p(rows.scales), _i64(rows.vocab), _i64(rows.d),
                                                _i64(rows.group), _i64(rows.chunk), _p(ids), _i64(ids.numel()),
                                                _p(out)):  # fmt: skip
        raise ValueError(f"a token id of {ids.tolist()} outside the vocabulary of {rows.vocab}")
    return out


def add_(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """h += x for contiguous fp32 tensors of one size; returns h."""
    decode_ops_library().recap_add_f32(_p(h), _p(x), _i64(h.numel()))
    return h


def add_scaled_(h: torch.Tensor, x: torch.Tensor, m: float) -> torch.Tensor:
    """h += x * m for contiguous fp32 tensors of one size (torch's h + x * m, rounded alike); returns h."""
    decode_ops_library().recap_add_scaled_f32(_p(h), _p(x), ctypes.c_float(m), _i64(h.numel()))
    return h


def scale_(x: torch.Tensor, m: float) -> torch.Tensor:
    """x *= m for a contiguous fp32 tensor; returns x."""
    decode_ops_library().recap_scale_f32(_p(x), ctypes.c_float(m), _i64(x.numel()))
    return x


# HF activation names (model/layers/activation.py) -> the csrc op computing them (recap_<op>_f32); the others
# (gelu_fast, quick_gelu, sigmoid, tanh) have none and keep a model on its module path.
NATIVE_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                      "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "relu2": "relu2"}  # fmt: skip


def row_stride(x: torch.Tensor, up: torch.Tensor | None) -> int:
    """The one row stride of x [rows, n] and up (a column view each, as of a [gate | up] buffer); ValueError when
    their shapes or strides differ or a row is not contiguous."""
    same = up is None or (up.shape == x.shape and up.stride() == x.stride())
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1 or not same:
        raise ValueError("act(x) * up over fp32 column views of one shape and row stride")
    return x.stride(0)


def activation_mul(name: str, x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """act(x) * up (a gated MLP) or act(x) (up None) [rows, n] for `name` of NATIVE_ACTIVATIONS (KeyError for
    another), x and up fp32 column views with one row stride."""
    rows, n = x.shape
    fn = getattr(decode_ops_library(), f"recap_{NATIVE_ACTIVATIONS[name]}_f32")
    out = torch.empty(rows, n, device="cpu")
    fn(_p(x), None if up is None else _p(up), _p(out), _i64(rows), _i64(n), _i64(row_stride(x, up)))
    return out


def split_gate(x: torch.Tensor, heads: int, dh: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, heads * 2 dh] contiguous fp32, each head [q | gate] -> (q, sigmoid(gate)) [n, heads * dh] each."""
    n = x.shape[0]
    q, gate = torch.empty(n, heads * dh, device="cpu"), torch.empty(n, heads * dh, device="cpu")
    decode_ops_library().recap_split_gate_f32(_p(x), _i64(n), _i64(heads), _i64(dh), _p(q), _p(gate))
    return q, gate


def mul_(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """h *= x for contiguous fp32 tensors of one size; returns h."""
    decode_ops_library().recap_mul_f32(_p(h), _p(x), _i64(h.numel()))
    return h


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  inv_freq: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slots: torch.Tensor) -> None:
    """q [n, Hq, Dh] and k [n, Hkv, Dh] rotated in place at positions [n] (inv_freq [rot/2], None: no RoPE),
    then k and v written at cache slots [n] of k_cache / v_cache [NB, block_size, Hkv, Dh]; ValueError for a
    slot outside the cache."""
    rows, hq, dh = q.shape
    hkv = k.shape[1]
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    rot = 0 if inv_freq is None else 2 * inv_freq.numel()
    rc = decode_ops_library().recap_rope_write_kv(
        _p(q), _p(k), _p(v), _i64(rows), _i64(hq), _i64(hkv), _i64(dh), _p(positions),
        None if inv_freq is None else _p(inv_freq), _i64(rot), _p(k_cache), _p(v_cache), _i64(num_slots), _p(slots),
    )  # fmt: skip
    if rc:
        raise ValueError(f"rope_write_kv: a slot of {slots.tolist()} outside the cache's {num_slots} slots"
                         if rc == -1 else f"rope_write_kv: rotary dim {rot} above 1024")  # fmt: skip


def short_conv_step(proj: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
                    slots: torch.Tensor, positions: torch.Tensor, slot_positions: torch.Tensor,
                    dst: torch.Tensor | None = None) -> torch.Tensor:
    """LFM2's gated short conv at one token per row: proj [n, 3D] = [B | C | x] -> C * conv(B * x) [n, D] with the
    conv weight [D, K] (bias [D] or None) over the windows state [S, D, K - 1] of slots [n], each rolled by one
    into dst [n] (None: the same slots; rows in order) with slot_positions[dst] = positions + 1. ValueError for a
    slot outside the state."""
    n, d = proj.shape[0], weight.shape[0]
    out = torch.empty(n, d, device="cpu")
    rc = decode_ops_library().recap_short_conv_step(
        _p(proj), _i64(n), _i64(d), _p(weight), None if bias is None else _p(bias), _i64(weight.shape[1]),
        _p(state), _i64(state.shape[0]), _p(slots), None if dst is None else _p(dst), _p(positions),
        _p(slot_positions), _p(out),
    )  # fmt: skip
    if rc:
        raise ValueError(f"short_conv_step: a slot of {slots.tolist()} outside the state's {state.shape[0]} slots"
                         if rc == -1 else f"short_conv_step: {weight.shape[1]} taps (2 to 65)")  # fmt: skip
    return out
