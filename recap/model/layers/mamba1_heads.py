"""Zamba's multi-head Mamba1 mixer: Mamba1 (layers/mamba1.py) with d_inner split into H heads.

in_proj's output interleaves x and the gate per channel ([x_0, z_0, x_1, z_1, ...], transformers'
view(.., I, 2)); the conv runs over all I channels; each head h has its own x_proj [R + 2N, I/H] and
dt_proj [I/H, R] (so its own Delta, B_t, C_t); A_log [H, I/H, N] and D [H, I/H] flatten to Mamba1's [I, N]
and [I]. The state is Mamba1's [I, N]: head h owns channels h*I/H .. (h+1)*I/H, scanned by the Mamba1
kernels on that slice of the state (their slot, checkpoint and position writes included).
"""

from __future__ import annotations

import torch

from recap.kernels.metadata import ForwardBatch
from recap.kernels.varlen import copy_decode_checkpoints
from recap.model.cache import ModelCaches
from recap.model.layers.conv import CausalConv1d
from recap.model.layers.linear import Linear, empty_param
from recap.model.layers.mixer import Mixer
from recap.model.mixer_configs import MultiHeadMamba1Config


class MultiHeadMamba1Mixer(Mixer):
    cache_group = "state"

    def __init__(self, hidden_size: int, cfg: MultiHeadMamba1Config, dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.bcdt_norm != "none":
            raise ValueError("the multi-head Mamba1 mixer has no dt/B/C norms")
        self.cfg = cfg
        i, n, r, heads = cfg.d_inner, cfg.d_state, cfg.dt_rank, cfg.num_heads
        hd = i // heads
        self.in_proj = Linear(hidden_size, 2 * i, cfg.proj_bias, dtype)
        self.conv1d = CausalConv1d(i, cfg.d_conv, cfg.conv_bias, cfg.activation, dtype)
        self.x_proj_weight = empty_param(heads, r + 2 * n, hd, dtype=dtype)
        self.dt_proj_weight = empty_param(heads, hd, r, dtype=dtype)
        self.dt_proj_bias = empty_param(heads, hd, dtype=dtype)
        self.A_log = empty_param(heads, hd, n, dtype=dtype)
        self.D = empty_param(heads, hd, dtype=dtype)
        self.out_proj = Linear(i, hidden_size, cfg.proj_bias, dtype)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        """hidden [T, D] -> [T, D]; reads and updates this layer's `conv` and `ssm` state tensors."""
        state, slot_positions = self.layer_cache(caches, layer), caches.slot_positions
        conv_state, ssm_state = state["conv"], state["ssm"]
        meta = batch.ssm
        if meta is None:
            raise ValueError("a Mamba layer needs batch.ssm metadata")
        cfg = self.cfg
        t, i, n, heads = hidden.shape[0], cfg.d_inner, cfg.d_state, cfg.num_heads
        hd = i // heads
        xz = self.in_proj(hidden).view(t, i, 2)
        x = self.conv1d(xz[..., 0].contiguous(), conv_state, batch)  # (t, i)
        z = xz[..., 1].contiguous()
        params = torch.einsum("thc,hpc->thp", x.view(t, heads, hd), self.x_proj_weight)  # (t, H, R + 2N)
        dt, b, c = params.split([cfg.dt_rank, n, n], dim=-1)
        dt = torch.einsum("thr,hcr->thc", dt, self.dt_proj_weight).reshape(t, i)  # bias added in the kernel
        a = -torch.exp(self.A_log.float()).reshape(i, n)
        d, dt_bias = self.D.float().reshape(i), self.dt_proj_bias.float().reshape(i)
        ys = []
        for h in range(heads):
            ch = slice(h * hd, (h + 1) * hd)
            args = (x[:, ch].contiguous(), dt[:, ch].contiguous(), a[ch], b[:, h].contiguous(), c[:, h].contiguous(),
                    d[ch], z[:, ch].contiguous(), dt_bias[ch], True)  # fmt: skip
            if meta.is_decode:
                ys.append(batch.kernels.selective_state_update(
                    ssm_state[:, ch], *args, meta.state_indices, slot_positions, batch.positions,
                    meta.has_initial_state,
                ))  # fmt: skip
            else:
                ys.append(batch.kernels.selective_scan(*args, ssm_state[:, ch], meta, slot_positions=slot_positions))
        if meta.is_decode:
            copy_decode_checkpoints(ssm_state, meta, slot_positions)  # all heads at once
        return self.out_proj(torch.cat(ys, dim=-1).to(hidden.dtype))
