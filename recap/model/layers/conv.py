"""Depthwise causal conv1d weights ([D, 1, K] as on disk), dispatching to the varlen or the update kernel; and the
two reads of a conv window other layers share: a token's last K inputs (`conv_windows`) and the previous token
(`TokenShift`, a width-2 conv whose window is the slot's)."""

from __future__ import annotations

import torch
from torch import nn

from recap.kernels.metadata import PAD_SLOT_ID, ForwardBatch, SSMMetadata
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


def conv_windows(y: torch.Tensor, state: torch.Tensor, meta: SSMMetadata) -> torch.Tensor:
    """[T, C, K]: each token's last K inputs, the token itself first (lag order), from the rows' windows
    [S, C, K-1] (oldest first) as they are before this step; padding rows get zeros."""
    t, c = y.shape
    k = state.shape[-1] + 1
    out = torch.zeros(t, c, k, dtype=torch.float32, device=y.device)
    qsl = meta.query_start_loc_list
    for r, slot in enumerate(meta.state_indices_list):
        a, b = qsl[r], qsl[r + 1]
        if slot == PAD_SLOT_ID or a == b:
            continue
        prev = state[slot].float() if meta.has_initial_state_list[r] else torch.zeros(c, k - 1, device=y.device)
        ctx = torch.cat([prev, y[a:b].float().t()], dim=1)  # (c, k - 1 + n)
        out[a:b] = ctx.unfold(1, k, 1).flip(-1).transpose(0, 1)
    return out


class TokenShift(nn.Module):
    """x [T, D] -> the previous token's x (the slot's window at a row start: zeros for a fresh row)."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        taps = torch.zeros(dim, 2, dtype=dtype)
        taps[:, 0] = 1.0
        self.register_buffer("taps", taps, persistent=False)  # not a checkpoint weight

    def forward(self, x: torch.Tensor, window: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return causal_conv(x, window, self.taps, None, None, batch)
