"""Depthwise causal conv1d weights ([D, 1, K] as on disk), dispatching to the varlen or the update kernel."""

from __future__ import annotations

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.kernels.varlen import copy_decode_checkpoints
from recap.model.layers.activation import activation as activation_fn
from recap.model.layers.linear import empty_param

KERNEL_ACTIVATIONS = ("silu", "swish")  # fused into the conv kernels; any other runs after them


class CausalConv1d(nn.Module):
    def __init__(self, dim: int, kernel: int, bias: bool, activation: str, dtype: torch.dtype) -> None:
        super().__init__()
        fused = activation in KERNEL_ACTIVATIONS
        self.activation = activation if fused else None  # what the kernels apply
        # The conv state holds inputs, not outputs, so an activation applied after the kernel is equivalent.
        # "none": a plain conv (LFM2's short conv).
        self.post_activation = None if fused or activation == "none" else activation_fn(activation)
        self.weight = empty_param(dim, 1, kernel, dtype=dtype)
        self.bias = empty_param(dim, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x [T, D] -> [T, D]; reads and updates conv_state [S, D, K-1] of the rows' slots."""
        y = causal_conv(x, conv_state, self.weight.squeeze(1), self.bias, self.activation, batch)
        return y if self.post_activation is None else self.post_activation(y)


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                activation: str | None, batch: ForwardBatch) -> torch.Tensor:  # fmt: skip
    """x [T, D] through the depthwise causal conv w [D, K] (the varlen kernel, or the update kernel for a decode
    batch), reading and updating conv_state [S, D, K-1] of the rows' slots and their checkpoints."""
    meta = batch.ssm
    assert meta is not None, "a causal conv needs batch.ssm metadata"
    if meta.is_decode:
        # has_initial_state: a one-token prompt (context 0) must not read its slot's old content.
        y = batch.kernels.causal_conv1d_update(
            x, conv_state, w, bias, meta.state_indices, activation, meta.has_initial_state
        )
        copy_decode_checkpoints(conv_state, meta, None)  # the update kernel writes running slots only
        return y
    return batch.kernels.causal_conv1d(x, w, bias, conv_state, meta, activation)
