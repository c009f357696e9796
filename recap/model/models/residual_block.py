"""Blocks that leave their last residual add to the norm after them, so that the add and that norm run as one
fused op where the kernel set has one (KernelSet.add_rms_norm; vLLM's layers pass (hidden, residual) pairs to
the same end).

A pre-norm block is `h += mixer(norm1(h)); h += ff(norm2(h))`: each add feeds a norm, the first the
feed-forward's pre-norm in the same block, the second the next block's input norm (or the model's final norm).
A ResidualBlock's `forward_residual(h, out)` takes the stream h and the previous block's pending output `out`
(None: nothing pending) and returns (h, its own pending output); `add_norm` runs `h + out` and the norm, fused or
not. CausalLM.forward threads the pending output from block to block and into the final norm; a block that is not a
ResidualBlock gets the stream with it added first, so families mix freely. `forward` (what the MTP head and
anything else that runs one block calls) is `forward_residual` with the add done at the end: one code path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layers.norm import RMSNorm


def add_norm(norm: nn.Module, h: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(h + out), h + out), `out` None: no add; a residual norm's `add_forward` (one fused kernel where the
    backend handed it one), any other norm after a plain add."""
    if isinstance(norm, RMSNorm):
        return norm.add_forward(h, out)
    h = h if out is None else h + out
    return norm(h), h


def settle(h: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The stream with the pending output added (for a part that reads the stream with no norm before it)."""
    return h if out is None else h + out


class ResidualBlock(nn.Module, ABC):
    """A block that hands its last residual add to the next norm (module docstring)."""

    def forward(self, h: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        h, out = self.forward_residual(h, None, batch, caches, layer)
        return h + out

    @abstractmethod
    def forward_residual(
        self, h: torch.Tensor, out: torch.Tensor | None, batch: ForwardBatch, caches: ModelCaches, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(stream, pending output) after this block, from the stream h and the previous block's pending `out`
        (None: none): the stream after the block is the returned stream + the returned output."""
