"""Token embedding: ids [T] -> hidden [T, D]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from recap.model.capture import DecodeCapture, f32_contiguous, require_type
from recap.model.layers.linear import empty_param


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_param(vocab_size, hidden_size, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def capture_decode(self, builder: DecodeCapture) -> torch.Tensor:
        """Record the lookup of the step's token ids -> [rows, D] (model/capture.py)."""
        require_type(self, Embedding, "embedding")
        return builder.embed(f32_contiguous(self.weight, "the embedding"))
