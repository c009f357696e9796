"""Zaya's compressed convolutional attention (CCA), names as transformers' ZayaAttention:

    q, k = q_proj(x), k_proj(x)
    c = grouped_conv(depthwise_conv([q | k]))     depthwise over every channel, then a conv mixing the channels
                                                  of each q or k head over time (both biased, inputs zero before
                                                  the row starts)
    q_res = (q + k repeated per group) / 2;  k_res = q_res averaged over each group
    q, k = c_q + q_res, c_k + k_res;  q, k = L2-normed to sqrt(head_dim), k * temp (per KV head); partial RoPE
    v = [v_proj_current(x) | v_proj_delayed(x of the previous token)] (the delayed projection is biased)
    out = o_proj(attention(q, k, v))

The two convs compose into one of kernel K = k0 + k1 - 1 over the raw q/k inputs, so the slot keeps their last
K-1 (`conv_qk`): each token's K inputs are read from the window before the step, and the conv kernel (zero taps:
its output unused) moves the window on and writes its checkpoints. The previous token's x is a token shift
(`shift_v`), as RWKV's.
"""

from __future__ import annotations

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch, KVWrite
from recap.kernels.varlen import copy_decode_checkpoints, record_decode_positions
from recap.model.cache import ModelCaches
from recap.model.layers.conv import TokenShift, causal_conv, conv_windows
from recap.model.layers.linear import Linear, empty_param
from recap.model.layers.mixer import Mixer
from recap.model.layers.qk_rope import QKRope
from recap.model.layers.rotary import RotaryEmbedding
from recap.model.mixer_configs import AttentionConfig
from recap.model.zaya_config import CCAConfig


def _conv(channels: int, in_per_group: int, kernel: int, dtype: torch.dtype) -> nn.Module:
    conv = nn.Module()
    conv.weight = empty_param(channels, in_per_group, kernel, dtype=dtype)  # as nn.Conv1d's
    conv.bias = empty_param(channels, dtype=dtype)
    return conv


def cca_conv(windows: torch.Tensor, depthwise: nn.Module, grouped: nn.Module, head_dim: int) -> torch.Tensor:
    """windows [T, C, K] (lag order: the token first) -> [T, C] fp32: the grouped conv over the depthwise conv's
    last k1 outputs, each computed from k0 raw inputs."""
    k0, k1 = depthwise.weight.shape[-1], grouped.weight.shape[-1]
    taps0 = depthwise.weight[:, 0].float().flip(-1)  # [C, k0], lag order
    lags = [(windows[:, :, m : m + k0] * taps0).sum(-1) for m in range(k1)]
    mid = torch.stack(lags[::-1], dim=-1) + depthwise.bias.float()[:, None]  # [T, C, k1], oldest first
    t, c = mid.shape[:2]
    g = c // head_dim
    w1 = grouped.weight.float().view(g, head_dim, head_dim, k1)  # [group, out, in, time]
    out = torch.einsum("tgij,goij->tgo", mid.view(t, g, head_dim, k1), w1)
    return out.reshape(t, c) + grouped.bias.float()


class CCAAttention(QKRope, Mixer):
    def __init__(self, hidden_size: int, cfg: CCAConfig, attn: AttentionConfig, dtype: torch.dtype,
                 window: int = 0) -> None:  # fmt: skip
        super().__init__()
        self.cfg, self.attn, self.window = cfg, attn, window
        self.cache_group = "window" if window else "kv"
        q_dim, kv_dim, c = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.qk_channels
        p = self.qkv_proj = nn.Module()
        p.q_proj = Linear(hidden_size, q_dim, attn.bias, dtype)
        p.k_proj = Linear(hidden_size, kv_dim, attn.bias, dtype)
        p.v_proj_current = Linear(hidden_size, kv_dim // 2, attn.bias, dtype)
        p.v_proj_delayed = Linear(hidden_size, kv_dim // 2, attn.bias, dtype)
        p.conv_qk_depthwise = _conv(c, 1, cfg.depthwise_kernel, dtype)
        p.conv_qk_grouped = _conv(c, cfg.head_dim, cfg.grouped_kernel, dtype)
        self.qk_norm = nn.Module()
        self.qk_norm.temp = empty_param(cfg.num_kv_heads, dtype=dtype)
        self.o_proj = Linear(q_dim, hidden_size, attn.bias, dtype)
        rope = attn.rope_theta is not None and attn.rotary_dim > 0
        self.rotary = RotaryEmbedding(attn.rotary_dim, attn.rope_theta, None) if rope else None  # type: ignore[arg-type]
        self.shift = TokenShift(hidden_size, dtype)
        self.register_buffer("zero_taps", torch.zeros(c, cfg.window, dtype=dtype), persistent=False)

    def qk(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> tuple[torch.Tensor, ...]:
        """q [T, H, Dh], k [T, Hkv, Dh] after the convs and residuals (before the norms), moving `conv_qk` on."""
        cfg, p, t = self.cfg, self.qkv_proj, x.shape[0]
        meta = batch.ssm
        if meta is None:
            raise ValueError("a CCA layer needs batch.ssm metadata")
        q, k = p.q_proj(x), p.k_proj(x)
        qk = torch.cat([q, k], dim=-1)
        state = caches.state[layer]["conv_qk"]  # the slot part (this mixer's group is the KV one)
        windows = conv_windows(qk, state, meta)  # before the kernel moves the window on
        self.move_window(qk, state, batch, caches)
        conv = cca_conv(windows, p.conv_qk_depthwise, p.conv_qk_grouped, cfg.head_dim).to(x.dtype)
        groups = cfg.num_heads // cfg.num_kv_heads
        q_res = q.view(t, cfg.num_heads, cfg.head_dim)
        q_res = (q_res + k.view(t, cfg.num_kv_heads, cfg.head_dim).repeat_interleave(groups, dim=1)) * 0.5
        k_res = q_res.view(t, cfg.num_kv_heads, groups, cfg.head_dim).mean(dim=-2)
        q_dim = cfg.num_heads * cfg.head_dim
        return conv[:, :q_dim].view_as(q_res) + q_res, conv[:, q_dim:].view_as(k_res) + k_res

    def move_window(self, qk: torch.Tensor, state: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> None:
        """The conv kernels with zero taps (output unused): the window moved on, its checkpoints written and
        the positions the rows' slots now hold recorded."""
        meta, slot_positions = batch.ssm, caches.slot_positions
        assert meta is not None
        if slot_positions is None:
            causal_conv(qk, state, self.zero_taps, None, None, batch)
        elif meta.is_decode:
            batch.kernels.causal_conv1d_update(
                qk, state, self.zero_taps, None, meta.state_indices, None, meta.has_initial_state
            )
            record_decode_positions(slot_positions, meta.state_indices, batch.positions)
            copy_decode_checkpoints(state, meta, slot_positions)
        else:
            batch.kernels.causal_conv1d(qk, self.zero_taps, None, state, meta, None, slot_positions)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        cfg, p, t = self.cfg, self.qkv_proj, x.shape[0]
        meta = batch.window_attn if self.window else batch.attn
        if meta is None or batch.positions is None:
            raise ValueError("a CCA layer needs attention metadata and positions")
        q, k = self.qk(x, batch, caches, layer)
        prev = self.shift(x, caches.state[layer]["shift_v"], batch)
        v = torch.cat([p.v_proj_current(x), p.v_proj_delayed(prev)], dim=-1).view(t, cfg.num_kv_heads, cfg.head_dim)
        eps, scale = torch.finfo(q.dtype).eps, cfg.head_dim**0.5
        q = q * (scale / q.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        k = k * (scale / k.norm(p=2, dim=-1, keepdim=True).clamp_min(eps)) * self.qk_norm.temp[:, None]
        kv = self.layer_cache(caches, layer)
        write = KVWrite(v, kv.k_cache, kv.v_cache, meta.slot_mapping)
        q, k, _, written = self.prepare_qk(q, k, batch.positions, kv=write)  # RoPE (its L2 norms are not the kernel's)
        out = batch.kernels.paged_attention(q, k, v, kv.k_cache, kv.v_cache, meta, self.attn.softmax_scale,
                                            self.window or None, False, written)  # fmt: skip
        return self.o_proj(out.reshape(t, cfg.num_heads * cfg.head_dim))
