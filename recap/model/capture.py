"""The decode-capture protocol: how a model's parts describe one decode step to a graph builder.

A backend that replays decode steps as flat lists of native calls (recap/backends/decode_graph.py, the CPU
counterpart of a CUDA graph) walks the model once through `capture_decode` methods: the model, its blocks,
their mixers and MLPs, norms and linear layers each record the calls of their own decode arithmetic on a
`DecodeCapture` builder and return the buffer their output lands in. A part without the method, or with an
option the native calls do not implement, raises GraphUnsupportedError naming it, and the model keeps its
module path. Each capturing part accepts its exact class only: a subclass may compute something else.
Signatures: the model `capture_decode(builder, caches) -> hidden`; a block, mixer or MLP
`capture_decode(builder, x, caches, layer) -> out` (`capture_part` calls it); an embedding
`capture_decode(builder) -> h`; a norm or linear layer `capture_decode(builder, x) -> y`.

The builder's operations are fixed-size native calls over fp32 row buffers [rows, n]; the step's inputs
(token ids, positions, state slots, K/V slots, block tables, sequence lengths) are set by the builder before
each replay, so parts never see them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from recap.kernels.gdn_step import GdnStep
    from recap.kernels.linear_rows import Int8Rows
    from recap.kernels.mamba2_step import Mamba2Step
    from recap.model.cache import ModelCaches

# (ctypes function, its prepared arguments, what a nonzero return means or None): one call of a replay.
NativeCall = tuple[Any, tuple, str | None]


class GraphUnsupportedError(Exception):
    """A part of the model the decode graph does not capture; the model keeps its module path."""


class DecodeCapture(Protocol):
    """What a part may record while a decode step of `rows` rows is captured (recap/backends/decode_graph.py)."""

    rows: int
    threads: Any  # ctypes.c_int: the thread count each replay passes to the kernels that take one

    def buffer(self, n: int) -> torch.Tensor:
        """A fresh fp32 activation buffer [rows, n] owned by the graph."""
        ...

    def record(self, call: NativeCall) -> None:
        """Append a prepared native call (e.g. a linear layer's `graph_call`)."""
        ...

    def embed(self, weight: torch.Tensor) -> torch.Tensor:
        """The step's token ids looked up in weight [V, D] -> [rows, D]."""
        ...

    def embed_int8(self, rows: Int8Rows) -> torch.Tensor:
        """The step's token ids looked up in int8 rows with a scale each (a table or a tied head's tiles) -> [rows, D]
        fp32."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
        """weight * x / rms(x) over x's rows -> a new buffer; offset: (1 + weight), a zero-centred norm's."""
        ...

    def head_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
        """weight * x / rms(x) over each head of x [rows, heads * Dh] (weight [Dh]: a q/k norm) -> a new buffer;
        offset: (1 + weight)."""
        ...

    def split_gate(self, x: torch.Tensor, heads: int, dh: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [rows, heads * 2 Dh], each head [q | gate] (a gated attention's q_proj) -> (q, sigmoid(gate)), each
        [rows, heads * Dh]."""
        ...

    def mul(self, h: torch.Tensor, x: torch.Tensor) -> None:
        """h *= x, in place (an output gate)."""
        ...

    def short_conv(
        self, proj: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
        slot_positions: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """LFM2's gated short conv on in_proj's output [rows, 3D], in place on the step's state slots -> [rows, D]."""
        ...

    def add(self, h: torch.Tensor, x: torch.Tensor, multiplier: float = 1.0) -> None:
        """h += x * multiplier (the residual stream; x * m rounded before the add, as torch's h + x * m)."""
        ...

    def scale(self, x: torch.Tensor, multiplier: float) -> None:
        """x *= multiplier, in place (an embedding multiplier)."""
        ...

    def activation(self, name: str, x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        """act(x) * up (a gated MLP; up None: act(x)) for the activation `name` (an HF name, layers/activation.py)
        over column views of buffers with one row stride -> [rows, I]; GraphUnsupportedError for an activation
        without a native op."""
        ...

    def mamba2_step(
        self, step: Mamba2Step, proj: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, slot_positions: torch.Tensor
    ) -> torch.Tensor:
        """A Mamba2 mixer's native decode step on in_proj's output, in place on the step's state slots -> y."""
        ...

    def gdn_step(
        self, step: GdnStep, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
        conv: torch.Tensor, state: torch.Tensor, slot_positions: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """A Gated DeltaNet mixer's native decode step on its projections' outputs, in place on the step's state
        slots -> the gated, normed output [rows, Hv * Dv] (out_proj's input)."""
        ...

    def paged_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inv_freq: torch.Tensor | None,
        k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, layer: int,
    ) -> torch.Tensor:  # fmt: skip
        """RoPE (inv_freq; None: none) on q and k, k and v written at the step's K/V slots, then paged decode
        attention of q over the step's block tables -> [rows, Hq * Dh]. The caches fix the head counts."""
        ...


def require_type(part: object, cls: type, what: str) -> None:
    """Raise GraphUnsupportedError unless `part` is exactly `cls` (a subclass may override its arithmetic)."""
    if type(part) is not cls:
        raise GraphUnsupportedError(f"{what} {type(part).__name__}")


def f32_contiguous(t: torch.Tensor, what: str) -> torch.Tensor:
    """`t`, if a contiguous fp32 tensor (what the native calls read by address); else GraphUnsupportedError."""
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise GraphUnsupportedError(f"{what} is not a contiguous fp32 tensor")
    return t


def capture_part(
    part: object, what: str, builder: DecodeCapture, x: torch.Tensor, caches: ModelCaches, layer: int
) -> torch.Tensor:
    """`part.capture_decode(...)`, or GraphUnsupportedError naming `what` and the part's class when it has none."""
    method = getattr(part, "capture_decode", None)
    if method is None:
        raise GraphUnsupportedError(f"{what} {type(part).__name__}")
    return method(builder, x, caches, layer)


def capture_norm(norm: object, builder: DecodeCapture, x: torch.Tensor) -> torch.Tensor:
    """A norm's `capture_decode(builder, x)`, or GraphUnsupportedError naming the norm."""
    method = getattr(norm, "capture_decode", None)
    if method is None:
        raise GraphUnsupportedError(f"norm {type(norm).__name__} (native: {getattr(norm, 'native', False)})")
    return method(builder, x)


def capture_residual(
    builder: DecodeCapture, h: torch.Tensor, norm: object, part: object, caches: ModelCaches, layer: int,
    multiplier: float = 1.0,
) -> None:
    """h += part(norm(h)) * multiplier, the pre-norm residual step of a block."""
    out = capture_part(part, f"layer {layer}: mixer", builder, capture_norm(norm, builder, h), caches, layer)
    builder.add(h, out, multiplier)
