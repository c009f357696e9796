"""A decode step of a fixed number of rows captured as a flat list of native calls: the CPU counterpart of a
CUDA graph.

With the native kernels on, a batch-1 step of a 24-layer hybrid still spent ~4 ms outside its kernels, most of
it Python: nn.Module calls, tensor allocations, ctypes argument conversion, small torch ops (the residual
adds, the MLP's silu and product, RoPE, the K/V write). That time does not shrink with a second thread, and
at 2 threads it was a third of the step. A DecodeGraph walks the model once per cache set and records every
call of a decode step of its row count with its arguments fixed: weights, states, K/V pools and its own
activation buffers by address. Replaying it is one Python loop of ctypes calls (~1 us each); the step's inputs (tokens,
positions, state slots, K/V slots, block tables, sequence lengths) are read from the ForwardBatch's own
tensors, whose addresses are set into shared argument objects before each replay. A graph is captured per
row count (1 to MAX_ROWS): fp32 weights through the one-row kernel at batch 1 and the panel kernel at more
rows, int8 weights through the int8 kernel at every row count.

What it captures is exactly the module path's arithmetic with the native kernels (layers/linear.py's
RowKernel, kernels/mamba2_step.py, kernels/rms_norm.py, kernels/paged_decode.py) plus csrc/decode_ops.c for
the small ops; the module path stays the reference (tests/model/test_decode_graph.py compares them).
Supported: fp32 activations; embedding, RMSNorm, Linear (fp32 or int8 weights), Mamba2 mixers (the native
step), attention (GQA, RoPE or none; no q/k norm, head gate or sliding window) and gated silu MLPs, in
MixerBlock and HybridBlock layouts. Any other part (another mixer, a multiplier, a model that overrides its
forward) raises GraphUnsupportedError at capture and the model keeps its module path.
"""

from __future__ import annotations

import ctypes
import math
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from recap.kernels.decode_ops import decode_ops_available, decode_ops_library
from recap.kernels.linear_rows import panels_graph_call
from recap.kernels.metadata import ForwardBatch
from recap.kernels.native import raw_function
from recap.kernels.paged_decode import _lib as paged_decode_library
from recap.kernels.rms_norm import _lib as rms_norm_library
from recap.model.cache import ModelCaches
from recap.model.layers.attention import Attention
from recap.model.layers.embedding import Embedding
from recap.model.layers.linear import Linear
from recap.model.layers.mamba2 import Mamba2Mixer
from recap.model.layers.mlp import MLP
from recap.model.layers.norm import RMSNorm
from recap.model.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from recap.model.models.base import CausalLM

_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
MAX_ROWS = 8  # the largest decode batch captured (the panel kernel's one group of rows)


class GraphUnsupportedError(Exception):
    """A part of the model the decode graph does not capture; the model keeps its module path."""


def _addr(t: torch.Tensor) -> ctypes.c_void_p:
    return _P(t.data_ptr())


def _f32_contiguous(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise GraphUnsupportedError(f"{what} is not a contiguous fp32 tensor")
    return t


class DecodeGraph:
    """One model's decode step of `rows` rows over one cache set, captured (see the module docstring)."""

    def __init__(self, model: CausalLM, caches: ModelCaches, rows: int = 1) -> None:
        """Capture; raises GraphUnsupportedError naming the first part it cannot capture."""
        from recap.model.models.base import CausalLM
        from recap.model.models.hybrid import HybridBlock
        from recap.model.models.mamba import MixerBlock

        if not decode_ops_available():
            raise GraphUnsupportedError("the native decode ops do not build here")
        cls = type(model)
        if cls.forward is not CausalLM.forward or cls.embed is not CausalLM.embed:
            raise GraphUnsupportedError(f"{cls.__name__} overrides forward or embed")
        if model.dtype != torch.float32 or model.config.embedding_multiplier != 1.0:
            raise GraphUnsupportedError("activations other than fp32, or an embedding multiplier")
        if not 1 <= rows <= MAX_ROWS:
            raise GraphUnsupportedError(f"{rows} rows (captured: 1 to {MAX_ROWS})")
        self.rows = rows  # captured over `caches`: CausalLM keeps a graph with the cache set it was made for
        self._caches = weakref.ref(caches)
        self._keep: list[torch.Tensor] = []  # the activation buffers the calls write and read
        self._ops: list[tuple[ctypes._CFuncPtr, tuple, str | None]] = []
        # The step's inputs: addresses of the ForwardBatch's tensors, set before each replay.
        self._ids, self._pos, self._slot = _P(), _P(), _P()
        self._kv_slot, self._tables, self._seq_lens = _P(), _P(), _P()
        self._table_stride = _I64(0)
        self._threads = _INT(torch.get_num_threads())
        self.has_state = self.has_attention = False
        d = model.config.hidden_size
        self._h = self._buffer(d)  # the residual stream

        emb = model.embedding()
        if type(emb) is not Embedding:
            raise GraphUnsupportedError(f"embedding {type(emb).__name__}")
        w = _f32_contiguous(emb.weight, "the embedding")
        self._op(
            raw_function(decode_ops_library(), "recap_embed_rows", _INT),
            (_addr(w), _I64(w.shape[0]), _I64(d), self._ids, _I64(rows), _addr(self._h)),
            "a token id outside the vocabulary",
        )
        for i, block in enumerate(model.blocks()):
            if type(block) is MixerBlock:
                parts = [(block.norm, block.mixer)]
            elif type(block) is HybridBlock:
                parts = [(block.input_layernorm, block.self_attn if block.is_attention else block.mamba)]
                if hasattr(block, "feed_forward"):
                    parts.append((block.pre_ff_layernorm, block.feed_forward))
            else:
                raise GraphUnsupportedError(f"layer {i}: block {type(block).__name__}")
            for norm, mixer in parts:
                out = self._mixer(mixer, self._norm(norm, self._h), caches, i)
                add = raw_function(decode_ops_library(), "recap_add_f32")
                self._op(add, (_addr(self._h), _addr(out), _I64(rows * d)))
        self.hidden = self._norm(model.final_norm(), self._h)

    # ---------------------------------------------------------------- capture

    def _buffer(self, n: int) -> torch.Tensor:
        t = torch.zeros(self.rows, n)
        self._keep.append(t)
        return t

    def _op(self, fn: ctypes._CFuncPtr, args: tuple, error: str | None = None) -> None:
        self._ops.append((fn, args, error))

    def _norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if type(norm) is not RMSNorm or not norm.native:
            raise GraphUnsupportedError(f"norm {type(norm).__name__} (native: {getattr(norm, 'native', False)})")
        w = _f32_contiguous(norm.weight, "a norm weight")
        y = self._buffer(x.shape[1])
        self._op(
            raw_function(rms_norm_library(), "recap_rms_norm_f32"),
            (_addr(x), _I64(self.rows), _I64(x.shape[1]), _addr(w), _F32(norm.eps), _addr(y)),
        )
        return y

    def _linear(self, lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if type(lin) is not Linear or x.shape[1] != lin.in_features:
            raise GraphUnsupportedError(f"linear layer {type(lin).__name__}")
        y = self._buffer(lin.out_features)
        if lin._rows is not None and (self.rows == 1 or lin._rows.is_int8):
            self._op(*lin._rows.graph_call(_addr(x), _addr(y), lin.in_features, self._threads, self.rows))
        elif self.rows > 1 and lin._panels is not None:
            self._op(*panels_graph_call(_addr(x), _addr(y), self.rows, lin._panels, lin.bias, lin.out_features,
                                        self._threads))  # fmt: skip
        else:
            raise GraphUnsupportedError(f"a linear layer without a native kernel for {self.rows} rows")
        return y

    def _mixer(self, mixer: nn.Module, x: torch.Tensor, caches: ModelCaches, layer: int) -> torch.Tensor:
        kind = type(mixer)
        if kind is Mamba2Mixer:
            return self._mamba2(mixer, x, caches, layer)
        if kind is Attention:
            return self._attention(mixer, x, caches, layer)
        if kind is MLP:
            return self._mlp(mixer, x)
        raise GraphUnsupportedError(f"layer {layer}: mixer {kind.__name__}")

    def _mamba2(self, m: Mamba2Mixer, x: torch.Tensor, caches: ModelCaches, layer: int) -> torch.Tensor:
        c = m.cfg
        multipliers = c.input_multiplier != 1.0 or m.in_proj_scale is not None or c.output_multiplier != 1.0
        if m.native_step is None or multipliers:
            raise GraphUnsupportedError(f"layer {layer}: a Mamba2 mixer without its native step, or with multipliers")
        state = caches.state[layer]
        conv, ssm = (_f32_contiguous(state[n], f"layer {layer}'s {n} state") for n in ("conv", "ssm"))
        proj = self._linear(m.in_proj, x)
        fn, args, y = m.native_step.graph_call(proj, self._slot, self._pos, caches.slot_positions, conv, ssm,
                                               self._threads)  # fmt: skip
        self._keep.append(y)
        self._op(fn, args)
        self.has_state = True
        return self._linear(m.out_proj, y)

    def _attention(self, a: Attention, x: torch.Tensor, caches: ModelCaches, layer: int) -> torch.Tensor:
        c = a.cfg
        plain = c.qk_norm == "none" and not c.head_gate and c.input_multiplier == 1.0 and c.output_multiplier == 1.0
        if not (plain and a.native and a.window == 0 and (a.rotary is None or type(a.rotary) is RotaryEmbedding)):
            raise GraphUnsupportedError(f"layer {layer}: attention with q/k norms, a gate, multipliers or a window")
        kv = caches.kv[layer]
        k_cache, v_cache = (_f32_contiguous(t, f"layer {layer}'s K/V") for t in (kv.k_cache, kv.v_cache))
        nb, bs, hkv, dh = k_cache.shape
        hq = c.num_heads
        if (hkv, dh) != (c.num_kv_heads, c.head_dim):
            raise GraphUnsupportedError(f"layer {layer}: K/V cache {tuple(k_cache.shape)} does not fit the layer")
        q, k, v = (self._linear(p, x) for p in (a.q_proj, a.k_proj, a.v_proj))
        inv_freq = None if a.rotary is None else _f32_contiguous(a.rotary.inv_freq, "inv_freq")
        if inv_freq is not None and inv_freq.numel() > 512:
            raise GraphUnsupportedError(f"layer {layer}: rotary dim {2 * inv_freq.numel()} above 1024")
        self._op(raw_function(decode_ops_library(), "recap_rope_write_kv", _INT), (
            _addr(q), _addr(k), _addr(v), _I64(self.rows), _I64(hq), _I64(hkv), _I64(dh), self._pos,
            None if inv_freq is None else _addr(inv_freq), _I64(0 if inv_freq is None else 2 * inv_freq.numel()),
            _addr(k_cache), _addr(v_cache), _I64(nb * bs), self._kv_slot,
        ), f"layer {layer}: a K/V slot outside the cache")  # fmt: skip
        out = self._buffer(hq * dh)
        scale = a.scale if a.scale is not None else 1.0 / math.sqrt(dh)
        self._op(raw_function(paged_decode_library(), "recap_paged_decode", _I64), (
            _addr(q), _I64(self.rows), _I64(hq), _I64(hkv), _I64(dh), _addr(k_cache), _addr(v_cache), _I64(nb),
            _I64(bs),
            self._tables, self._table_stride, self._seq_lens, _I64(0), _F32(scale), _addr(out), self._threads,
        ), f"layer {layer}: a block table entry outside the cache")  # fmt: skip
        self.has_attention = True
        return self._linear(a.o_proj, out)

    def _mlp(self, m: MLP, x: torch.Tensor) -> torch.Tensor:
        c = m.cfg
        if not c.gated or c.activation not in ("silu", "swish") or c.gate_multiplier != 1.0 or c.down_multiplier != 1.0:
            raise GraphUnsupportedError("an MLP other than gated silu without multipliers")
        i = c.intermediate_size
        if c.fused_gate_up:
            gu = self._linear(m.gate_up_proj, x)
            gate, up, stride = _P(gu.data_ptr()), _P(gu.data_ptr() + 4 * i), 2 * i
        else:
            gate, up = (_addr(self._linear(p, x)) for p in (m.gate_proj, m.up_proj))
            stride = i
        act = self._buffer(i)
        self._op(raw_function(decode_ops_library(), "recap_silu_mul_f32"),
                 (gate, up, _addr(act), _I64(self.rows), _I64(i), _I64(stride)))  # fmt: skip
        return self._linear(m.down_proj, act)

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

    def run(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """The step's final hidden states [rows, D] (a new tensor); `caches` (the set it was captured over) are
        updated as the module path does, checkpoints included."""
        assert caches is self._caches(), "a decode graph runs over the cache set it was captured over"
        self._ids.value = batch.input_ids.data_ptr()
        self._pos.value = batch.positions.data_ptr()
        if self.has_state:
            assert batch.ssm is not None
            self._slot.value = batch.ssm.state_indices.data_ptr()
        if self.has_attention:
            attn = batch.attn
            assert attn is not None and attn.block_tables.stride(1) == 1
            self._kv_slot.value = attn.slot_mapping.data_ptr()
            self._tables.value = attn.block_tables.data_ptr()
            self._table_stride.value = attn.block_tables.stride(0)
            self._seq_lens.value = attn.seq_lens.data_ptr()
        self._threads.value = torch.get_num_threads()
        for fn, args, error in self._ops:
            if fn(*args) and error is not None:
                raise ValueError(f"decode graph: {error}")
        if batch.planned_checkpoints:  # a row's token completed a block: its new state, every layer's, is one
            assert batch.ssm is not None
            for row, position, slot in batch.planned_checkpoints:
                caches.copy_state(batch.ssm.state_indices_list[row], slot)
                written = int(caches.slot_positions[slot])
                assert written == position, f"checkpoint slot {slot} holds position {written}, planned {position}"
        return self.hidden.clone()


def capture(model: CausalLM, caches: ModelCaches, log: Callable[[str], None]) -> dict[int, DecodeGraph | None]:
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
