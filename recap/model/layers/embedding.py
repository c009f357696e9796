"""Token embedding: ids [T] -> hidden [T, D].

The table is in the model dtype, or, once `quantize_int8` ran (`backends.base.set_linear_backend` with int8 or
int4 weights, after the linear layers, tied head included, have their own layouts), int8 rows with one fp32 scale
each,
the same symmetric per-row int8 as a quantized linear layer's (model/quant.py). A lookup reads a few rows per
step, so the int8 table costs no speed; it is what the table holds in memory: at 1B shapes the fp32 table is
0.5-0.6 GiB of a 2.5 GiB int8 model, 1.5 GiB of a 7B one. 8 bits also under int4, as llama.cpp keeps its
Q4_K_M embedding at 4+ bits: only the rows a step reads are dequantized, so fewer bits would save memory only.
A tied model whose head is int8 holds the matrix once: the lookups read the head's tiles, whose rows and scales
are the table's (quant.quantize_int8_tiles), instead of a table of their own (Qwen3.5-0.8B's 248K x 1024: 254 MB).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from recap.kernels.linear_rows import Int8Rows
from recap.model.capture import DecodeCapture, f32_contiguous, require_type
from recap.model.layers.linear import Int8Linear, Linear, WeightReleasedError, empty_param
from recap.model.quant import Int8Tiles, quantize_int8_weight


def int8_tiles_of(head: nn.Module | None) -> Int8Tiles | None:
    """A head's int8 tiles where it holds them (an int8 Linear with the native layout), else None."""
    impl = getattr(head, "impl", None) if isinstance(head, Linear) else None
    return impl.tiles if isinstance(impl, Int8Linear) else None


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_param(vocab_size, hidden_size, dtype=dtype)
        self.dtype = dtype
        self.released = False  # the table is int8 (`qweight`, `scales`, or a tied head's tiles): fp32 one freed
        self.shared: Int8Tiles | None = None  # the tied head's tiles the lookups read

    def __getattr__(self, name: str) -> torch.Tensor | nn.Module:
        if name == "weight" and self.__dict__.get("released"):
            raise WeightReleasedError("the embedding's full-precision table was released: it is held as int8")
        return super().__getattr__(name)

    def quantize_int8(self, shared: Int8Tiles | None = None) -> None:
        """Hold the table as int8 rows with one scale each and free the full-precision one (once). `shared`: the
        int8 tiles of a head tied to this table (laid out from it), read in place of rows of its own."""
        if self.released:
            return
        vocab, d = self.weight.shape
        if shared is not None and shared.in_features == d and shared.scales.numel() == vocab:
            self.shared = shared
        else:
            q, scales = quantize_int8_weight(self.weight)
            self.qweight = nn.Parameter(q, requires_grad=False)
            self.scales = nn.Parameter(scales, requires_grad=False)
        del self.weight  # the tied head, if any, holds its own layout by now (backends/base.py)
        self.released = True

    def int8_rows(self) -> Int8Rows:
        """The int8 rows the lookups read (the tied head's tiles read now: a backend may have moved them)."""
        if self.shared is not None:
            return Int8Rows.tiled(self.shared.tiles, self.shared.scales, self.shared.in_features)
        return Int8Rows.table(self.qweight, self.scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.released:
            return self.int8_rows().lookup_ref(ids).to(self.dtype)
        return F.embedding(ids, self.weight)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        if self.released:
            raise WeightReleasedError(f"{prefix}weight was quantized to int8; a state dict needs the full table "
                                      "(load the model again)")  # fmt: skip
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def capture_decode(self, builder: DecodeCapture) -> torch.Tensor:
        """Record the lookup of the step's token ids -> [rows, D] (model/capture.py)."""
        require_type(self, Embedding, "embedding")
        if self.released:
            return builder.embed_int8(self.int8_rows())
        return builder.embed(f32_contiguous(self.weight, "the embedding"))
