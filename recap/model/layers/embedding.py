"""Token embedding: ids [T] -> hidden [T, D].

The table is in the model dtype, or, once `quantize_int8` ran (`backends.base.set_linear_backend` with int8 or
int4 weights, after the linear layers, tied head included, have their own layouts), int8 rows with one fp32 scale
each,
the same symmetric per-row int8 as a quantized linear layer's (model/quant.py). A lookup reads a few rows per
step, so the int8 table costs no speed; it is what the table holds in memory: at 1B shapes the fp32 table is
0.5-0.6 GiB of a 2.5 GiB int8 model, 1.5 GiB of a 7B one. 8 bits also under int4, as llama.cpp keeps its
Q4_K_M embedding at 4+ bits: only the rows a step reads are dequantized, so fewer bits would save memory only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from recap.model.capture import DecodeCapture, f32_contiguous, require_type
from recap.model.layers.linear import WeightReleasedError, empty_param
from recap.model.quant import quantize_int8_weight


def embedding_int8_ref(ids: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The int8 table's rows: q[ids] * scales[ids] in fp32 [T, D] (the reference of recap_embed_rows_i8)."""
    return q.index_select(0, ids).float() * scales.index_select(0, ids)[:, None]


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_param(vocab_size, hidden_size, dtype=dtype)
        self.dtype = dtype
        self.released = False  # the table is int8 (`qweight`, `scales`): the full-precision one was freed

    def __getattr__(self, name: str) -> torch.Tensor | nn.Module:
        if name == "weight" and self.__dict__.get("released"):
            raise WeightReleasedError("the embedding's full-precision table was released: it is held as int8")
        return super().__getattr__(name)

    def quantize_int8(self) -> None:
        """Hold the table as int8 rows with one scale each and free the full-precision one (once)."""
        if self.released:
            return
        q, scales = quantize_int8_weight(self.weight)
        self.qweight = nn.Parameter(q, requires_grad=False)
        self.scales = nn.Parameter(scales, requires_grad=False)
        del self.weight  # the tied head, if any, holds its own layout by now (backends/base.py)
        self.released = True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.released:
            return embedding_int8_ref(ids, self.qweight, self.scales).to(self.dtype)
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
            return builder.embed_int8(self.qweight, self.scales)
        return builder.embed(f32_contiguous(self.weight, "the embedding"))
