"""LFM2's gated short convolution: the whole recurrent state is the conv window (the state kind "short_conv").

    [B | C | x] = in_proj(h)            (T, 3D)
    y = out_proj(C * conv(B * x))       conv: depthwise causal, K taps, no activation

A slot holds only the last K - 1 inputs of the conv (B * x), so a checkpoint is D * (K - 1) values per layer.
The conv kernel records the slot positions it writes (provenance), as an SSM kernel does for Mamba layers.
"""

from __future__ import annotations

import torch

from recap.kernels.metadata import ForwardBatch
from recap.kernels.varlen import copy_decode_checkpoints, record_decode_positions
from recap.model.cache import ModelCaches
from recap.model.capture import DecodeCapture, GraphUnsupportedError, f32_contiguous, require_type
from recap.model.layers.conv import CausalConv1d
from recap.model.layers.linear import Linear
from recap.model.layers.mixer import Mixer
from recap.model.mixer_configs import ShortConvConfig


class ShortConv(Mixer):
    """Weights as on disk: `in_proj` [3D, D], `conv` [D, 1, K], `out_proj` [D, D] (biases if `bias`)."""

    cache_group = "state"

    def __init__(self, hidden_size: int, cfg: ShortConvConfig, dtype: torch.dtype) -> None:
        super().__init__()
        if hidden_size != cfg.dim:
            raise ValueError(f"a short conv runs over the hidden size ({hidden_size}), not {cfg.dim} channels")
        self.cfg = cfg
        self.in_proj = Linear(cfg.dim, 3 * cfg.dim, cfg.bias, dtype)
        self.conv = CausalConv1d(cfg.dim, cfg.kernel, cfg.bias, "none", dtype)
        self.out_proj = Linear(cfg.dim, cfg.dim, cfg.bias, dtype)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        """hidden [T, D] -> [T, D]; reads and updates this layer's `conv` state tensor."""
        state, slot_positions = self.layer_cache(caches, layer), caches.slot_positions
        meta = batch.ssm
        if meta is None:
            raise ValueError("a short-conv layer needs batch.ssm metadata")
        conv_state = state["conv"]
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)  # (t, d) each
        bx = b * x
        w = self.conv.weight.squeeze(1)  # (d, k)
        if meta.is_decode:
            idx, init = meta.state_indices, meta.has_initial_state
            y = batch.kernels.causal_conv1d_update(bx, conv_state, w, self.conv.bias, idx, None, init)
            record_decode_positions(slot_positions, meta.state_indices, batch.positions)
            copy_decode_checkpoints(conv_state, meta, slot_positions)
        else:
            y = batch.kernels.causal_conv1d(bx, w, self.conv.bias, conv_state, meta, None, slot_positions)
        return self.out_proj(c * y)

    def capture_decode(self, builder: DecodeCapture, x: torch.Tensor, caches: ModelCaches, layer: int) -> torch.Tensor:
        """Record a plain decode step (model/capture.py): in_proj, the gated conv in place on the step's slots
        (csrc/decode_ops.c's recap_short_conv_step: this forward's arithmetic), out_proj."""
        require_type(self, ShortConv, f"layer {layer}: mixer")
        conv_state = f32_contiguous(self.layer_cache(caches, layer)["conv"], f"layer {layer}'s conv state")
        weight = f32_contiguous(self.conv.weight.squeeze(1), f"layer {layer}'s conv weight")  # (d, k)
        bias = None if self.conv.bias is None else f32_contiguous(self.conv.bias, f"layer {layer}'s conv bias")
        d, k = weight.shape
        if tuple(conv_state.shape[1:]) != (d, k - 1) or not 2 <= k <= 65:
            raise GraphUnsupportedError(f"layer {layer}: a short conv of {k} taps over a {tuple(conv_state.shape)} "
                                        "state")  # fmt: skip
        proj = self.in_proj.capture_decode(builder, x)
        y = builder.short_conv(proj, weight, bias, conv_state, caches.slot_positions)
        return self.out_proj.capture_decode(builder, y)
