"""A decode step of a fixed number of rows captured as a flat list of native calls: the CPU counterpart of a
CUDA graph.

With the native kernels on, a batch-1 step of a 24-layer hybrid still spent ~4 ms outside its kernels, most of
it Python: nn.Module calls, tensor allocations, ctypes argument conversion, small torch ops (the residual
adds, the MLP's activation and product, RoPE, the K/V write). That time does not shrink with a second thread, and
at 2 threads it was a third of the step. A DecodeGraph walks the model once per cache set and records every
call of a decode step of its row count with its arguments fixed: weights, states, K/V pools and its own
activation buffers by address. Replaying it is one Python loop of ctypes calls (~1 us each); the step's inputs (tokens,
positions, state slots, K/V slots, block tables, sequence lengths) are read from the ForwardBatch's own
tensors, whose addresses are set into shared argument objects before each replay. A graph is captured per
row count (1 to MAX_ROWS): fp32 weights through the one-row kernel at batch 1 and the panel kernel at more
rows, int8 weights through the int8 kernel at every row count.

The walk goes through the model's `capture_decode` protocol (recap/model/capture.py): the model, its blocks,
mixers, MLPs, norms and linear layers each record their own arithmetic on this builder's operations, so this module
knows no model class. What it captures is exactly the module path's arithmetic with the native kernels
(layers/linear.py's RowKernel, kernels/mamba2_step.py, kernels/gdn_step.py, kernels/rms_norm.py,
kernels/paged_decode.py) plus csrc/decode_ops.c for the small ops; the module path stays the reference
(tests/backends/test_decode_graph.py compares them). Supported today: fp32 activations; embedding (fp32 or int8
table, times a multiplier), RMSNorm and the zero-centred (1 + w) OffsetRMSNorm, residual adds (times a multiplier:
muP's, Granite's), Linear (fp32, int8 or int4 weights), Mamba2 mixers (the native step), LFM2's gated short convs,
Gated DeltaNet mixers in Qwen3.5's projection layout (kernels/gdn_step.py), attention (GQA, RoPE or none, per-head
q/k RMSNorms or none; no head gate or sliding window), gated attention (q_proj's output gate, per-head plain or
zero-centred q/k norms, partial RoPE) and MLPs, gated or not, with an activation csrc/decode_ops.c has (silu, gelu,
gelu_tanh, relu, relu2: Nemotron-H's), in MixerBlock, HybridBlock, GraniteBlock, LfmBlock (no post norms) and
Qwen3_5Block (dense MLPs) layouts. Any other part (another mixer, a mixer's own multipliers, a MoE, a model that
overrides its forward) raises GraphUnsupportedError at capture and the model keeps its module path.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable
from typing import Protocol

import torch

from recap.kernels.decode_ops import NATIVE_ACTIVATIONS, decode_ops_available, decode_ops_library, row_stride
from recap.kernels.gdn_step import GdnStep
from recap.kernels.linear_rows import Int8Rows
from recap.kernels.mamba2_step import Mamba2Step
from recap.kernels.metadata import ForwardBatch
from recap.kernels.native import address as _addr
from recap.kernels.native import raw_function
from recap.kernels.paged_decode import _lib as paged_decode_library
from recap.kernels.rms_norm import _lib as rms_norm_library
from recap.model.cache import ModelCaches
from recap.model.capture import DecodeCapture, GraphUnsupportedError, NativeCall

_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
MAX_ROWS = 8  # the largest decode batch captured (the panel kernel's one group of rows)


class CapturableModel(Protocol):
    """A model that records its decode step (CausalLM.capture_decode)."""

    def capture_decode(self, builder: DecodeCapture, caches: ModelCaches) -> torch.Tensor: ...


def _rms_norm_function(offset: bool) -> ctypes._CFuncPtr:
    """The native RMS norm: weight w, or 1 + w (offset: a zero-centred norm's)."""
    return raw_function(rms_norm_library(), "recap_rms_norm_offset_f32" if offset else "recap_rms_norm_f32")


class DecodeGraph:
    """One model's decode step of `rows` rows over one cache set, captured (see the module docstring); the
    builder the model's parts record on (model/capture.py's DecodeCapture)."""

    max_rows = MAX_ROWS  # the most rows captured (a verify graph's rows are tokens: backends/verify_graph.py)

    def __init__(self, model: CapturableModel, caches: ModelCaches, rows: int = 1) -> None:
        """Capture; raises GraphUnsupportedError naming the first part it cannot capture."""
        if not decode_ops_available():
            raise GraphUnsupportedError("the native decode ops do not build here")
        if not 1 <= rows <= self.max_rows:
            raise GraphUnsupportedError(f"{rows} rows (captured: 1 to {self.max_rows})")
        self.rows = rows  # captured over `caches`: a backend keeps a graph with the cache set it was made for
        self._caches = weakref.ref(caches)
        self._keep: list[torch.Tensor] = []  # the activation buffers the calls write and read
        self._ops: list[NativeCall] = []
        # The step's inputs: addresses of the ForwardBatch's tensors, set before each replay.
        self._ids, self._pos, self._slot = _P(), _P(), _P()
        self._kv_slot, self._tables, self._seq_lens = _P(), _P(), _P()
        self._table_stride = _I64(0)
        self.threads = _INT(torch.get_num_threads())
        self.has_state = self.has_attention = False
        self.hidden = model.capture_decode(self, caches)

    # ---------------------------------------------------------------- the builder's operations

    def buffer(self, n: int) -> torch.Tensor:
        t = torch.zeros(self.rows, n, device="cpu")
        self._keep.append(t)
        return t

    def record(self, call: NativeCall) -> None:
        self._ops.append(call)

    def embed(self, weight: torch.Tensor) -> torch.Tensor:
        vocab, d = weight.shape
        h = self.buffer(d)  # the residual stream
        self.record((raw_function(decode_ops_library(), "recap_embed_rows", _INT),
                     (_addr(weight), _I64(vocab), _I64(d), self._ids, _I64(self.rows), _addr(h)),
                     "a token id outside the vocabulary"))  # fmt: skip
        return h

    def embed_int8(self, rows: Int8Rows) -> torch.Tensor:
        assert rows.q.dtype == torch.int8 and rows.q.is_contiguous() and rows.scales.dtype == torch.float32
        h = self.buffer(rows.d)
        self.record((raw_function(decode_ops_library(), "recap_embed_rows_i8", _INT),
                     (_addr(rows.q), _addr(rows.scales), _I64(rows.vocab), _I64(rows.d), _I64(rows.group),
                      _I64(rows.chunk), self._ids, _I64(self.rows), _addr(h)),
                     "a token id outside the vocabulary"))  # fmt: skip
        return h

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
        y = self.buffer(x.shape[1])
        args = (_addr(x), _I64(self.rows), _I64(x.shape[1]), _addr(weight), _F32(eps), _addr(y))
        self.record((_rms_norm_function(offset), args, None))
        return y

    def head_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
        dh = weight.numel()
        y = self.buffer(x.shape[1])
        args = (_addr(x), _I64(self.rows * x.shape[1] // dh), _I64(dh), _addr(weight), _F32(eps), _addr(y))
        self.record((_rms_norm_function(offset), args, None))
        return y

    def split_gate(self, x: torch.Tensor, heads: int, dh: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [rows, heads * 2 dh], each head [q | gate] -> (q [rows, heads * dh], sigmoid(gate) [rows, heads * dh])."""
        q, gate = self.buffer(heads * dh), self.buffer(heads * dh)
        self.record((raw_function(decode_ops_library(), "recap_split_gate_f32"),
                     (_addr(x), _I64(self.rows), _I64(heads), _I64(dh), _addr(q), _addr(gate)), None))  # fmt: skip
        return q, gate

    def mul(self, h: torch.Tensor, x: torch.Tensor) -> None:
        self.record((raw_function(decode_ops_library(), "recap_mul_f32"), (_addr(h), _addr(x), _I64(h.numel())),
                     None))  # fmt: skip

    def short_conv(
        self, proj: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
        slot_positions: torch.Tensor, dst: ctypes.c_void_p | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """(dst: a verify graph's per-token destination slots.)"""
        d, k = weight.shape
        out = self.buffer(d)
        self.record((raw_function(decode_ops_library(), "recap_short_conv_step", _INT), (
            _addr(proj), _I64(self.rows), _I64(d), _addr(weight), None if bias is None else _addr(bias), _I64(k),
            _addr(state), _I64(state.shape[0]), self._slot, dst, self._pos, _addr(slot_positions), _addr(out),
        ), "a state slot outside the cache"))  # fmt: skip
        self.has_state = True
        return out

    def add(self, h: torch.Tensor, x: torch.Tensor, multiplier: float = 1.0) -> None:
        if multiplier == 1.0:  # the plain add, as the module path's h + x
            call = (raw_function(decode_ops_library(), "recap_add_f32"), (_addr(h), _addr(x), _I64(h.numel())))
        else:
            call = (raw_function(decode_ops_library(), "recap_add_scaled_f32"),
                    (_addr(h), _addr(x), _F32(multiplier), _I64(h.numel())))  # fmt: skip
        self.record((*call, None))

    def scale(self, x: torch.Tensor, multiplier: float) -> None:
        self.record((raw_function(decode_ops_library(), "recap_scale_f32"), (_addr(x), _F32(multiplier),
                     _I64(x.numel())), None))  # fmt: skip

    def activation(self, name: str, x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        op = NATIVE_ACTIVATIONS.get(name)
        if op is None:
            raise GraphUnsupportedError(f"an MLP activation {name!r} (native: {sorted(NATIVE_ACTIVATIONS)})")
        try:
            stride = row_stride(x, up)
        except ValueError as e:
            raise GraphUnsupportedError(str(e)) from None
        act = self.buffer(x.shape[1])
        self.record((raw_function(decode_ops_library(), f"recap_{op}_f32"),
                     (_addr(x), None if up is None else _addr(up), _addr(act), _I64(self.rows), _I64(x.shape[1]),
                      _I64(stride)), None))  # fmt: skip
        return act

    def mamba2_step(
        self, step: Mamba2Step, proj: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, slot_positions: torch.Tensor
    ) -> torch.Tensor:
        fn, args, y = step.graph_call(proj, self._slot, self._pos, slot_positions, conv, ssm, self.threads)
        self._keep.append(y)
        self.record((fn, args, None))
        self.has_state = True
        return y

    def gdn_step(
        self, step: GdnStep, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
        conv: torch.Tensor, state: torch.Tensor, slot_positions: torch.Tensor, dst: ctypes.c_void_p | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """(dst: a verify graph's per-token destination slots.)"""
        fn, args, bufs = step.graph_call(qkv, z, b, a, self._slot, dst, self._pos, slot_positions, conv, state,
                                         self.threads)  # fmt: skip
        self._keep.extend(bufs)
        self.record((fn, args, "a state slot outside the cache"))
        self.has_state = True
        return bufs[0]

    def paged_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inv_freq: torch.Tensor | None,
        k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, layer: int,
    ) -> torch.Tensor:  # fmt: skip
        nb, bs, hkv, dh = k_cache.shape
        hq = q.shape[1] // dh
        self.record((raw_function(decode_ops_library(), "recap_rope_write_kv", _INT), (
            _addr(q), _addr(k), _addr(v), _I64(self.rows), _I64(hq), _I64(hkv), _I64(dh), self._pos,
            None if inv_freq is None else _addr(inv_freq), _I64(0 if inv_freq is None else 2 * inv_freq.numel()),
            _addr(k_cache), _addr(v_cache), _I64(nb * bs), self._kv_slot,
        ), f"layer {layer}: a K/V slot outside the cache"))  # fmt: skip
        out = self.buffer(hq * dh)
        self.record((raw_function(paged_decode_library(), "recap_paged_decode", _I64), (
            _addr(q), _I64(self.rows), _I64(hq), _I64(hkv), _I64(dh), _addr(k_cache), _addr(v_cache), _I64(nb),
            _I64(bs),
            self._tables, self._table_stride, self._seq_lens, _I64(0), _F32(scale), _addr(out), self.threads,
        ), f"layer {layer}: a block table entry outside the cache"))  # fmt: skip
        self.has_attention = True
        return out

    # ---------------------------------------------------------------- replay

    def takes(self, batch: ForwardBatch) -> bool:
        """Whether this step is one the graph replays: `rows` rows of one token each, every row continuing its
        slot (checkpoints allowed), no padding row, with no sliding-window paging."""
        n = self.rows
        if batch.num_tokens != n or batch.num_seqs != n:
            return False
        plain = batch.ssm is not None and batch.ssm.plain_decode
        if batch.window_attn is not None or (self.has_state and not plain):
            return False
        attn = batch.attn
        return not self.has_attention or (attn is not None and attn.is_decode and not any(attn.is_padding))

    def replay(self, batch: ForwardBatch, slots: torch.Tensor | None, tables: torch.Tensor | None,
               seq_lens: torch.Tensor | None) -> None:  # fmt: skip
        """Run the calls on the batch's token ids, positions and K/V slots, and these state slots, block tables
        and sequence lengths (a row's each)."""
        self._ids.value = batch.input_ids.data_ptr()
        self._pos.value = batch.positions.data_ptr()
        if self.has_state:
            assert slots is not None
            self._slot.value = slots.data_ptr()
        if self.has_attention:
            assert batch.attn is not None and tables is not None and seq_lens is not None and tables.stride(1) == 1
            self._kv_slot.value = batch.attn.slot_mapping.data_ptr()
            self._tables.value = tables.data_ptr()
            self._table_stride.value = tables.stride(0)
            self._seq_lens.value = seq_lens.data_ptr()
        self.threads.value = torch.get_num_threads()
        for fn, args, error in self._ops:
            if fn(*args) and error is not None:
                raise ValueError(f"decode graph: {error}")

    def run(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """The step's final hidden states [rows, D] (a new tensor); `caches` (the set it was captured over) are
        updated as the module path does, checkpoints included."""
        assert caches is self._caches(), "a decode graph runs over the cache set it was captured over"
        attn = batch.attn
        self.replay(batch, None if batch.ssm is None else batch.ssm.state_indices,
                    None if attn is None else attn.block_tables, None if attn is None else attn.seq_lens)  # fmt: skip
        if batch.planned_checkpoints:  # a row's token completed a block: its new state, every layer's, is one
            assert batch.ssm is not None
            caches.copy_checkpoints((batch.ssm.state_indices_list[r], p, s) for r, p, s in batch.planned_checkpoints)
        return self.hidden.clone()


def capture(
    model: CapturableModel, caches: ModelCaches, log: Callable[[str], None]
) -> dict[int, DecodeGraph | None]:
    """The model's decode graphs over `caches` for 1 to MAX_ROWS rows, captured together (a bounded set, made
    once per cache set rather than as batch sizes turn up), None where one cannot be captured; says why through
    `log`, once."""
    graphs: dict[int, DecodeGraph | None] = {}
    missing: dict[str, list[int]] = {}
    for rows in range(1, MAX_ROWS + 1):
        try:
            graphs[rows] = DecodeGraph(model, caches, rows)
        except GraphUnsupportedError as e:
            graphs[rows] = None
            missing.setdefault(str(e), []).append(rows)
    for why, counts in missing.items():
        log(f"decode graph not captured for {counts} rows, the module path runs: {why}")
    return graphs
