"""Mamba2 (SSD) mixer, as in Mamba2, Bamba and other Mamba2 hybrids.

Glossary (Mamba2 paper, section 7): H heads of P = head_dim channels, G groups sharing B and C,
N = d_state, I = H * P.
  in_proj(x) = [z (I) | xBC (I + 2 G N) | dt (H)];  xBC -> causal conv + silu -> [x | B | C]
  A = -exp(A_log) [H] (scalar per head);  dt = clamp(softplus(dt + dt_bias), time_step_limit)
  h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t;  y_t = C_t h_t + D x_t  (the SSD kernels)
  out = out_proj(gated_rmsnorm(y, z))  with RMS over groups of I / G channels
Options (Mamba2Config): the norm/gate order (`gate_norm`), and Falcon-H1's multipliers on the input,
on each part of in_proj's output (its "mup vector") and on the output.
"""

from __future__ import annotations

import torch

from recap.kernels.mamba2_step import Mamba2Step, mamba2_step_available
from recap.kernels.metadata import ForwardBatch
from recap.kernels.varlen import copy_decode_checkpoints
from recap.model.cache import ModelCaches
from recap.model.capture import DecodeCapture, GraphUnsupportedError, f32_contiguous, require_type
from recap.model.layers.conv import CausalConv1d
from recap.model.layers.linear import Linear, empty_param
from recap.model.layers.mamba2_decode import decode_supported, mamba2_decode
from recap.model.layers.mixer import Mixer
from recap.model.layers.norm import GatedRMSNorm
from recap.model.mixer_configs import Mamba2Config


def in_proj_scale(cfg: Mamba2Config) -> torch.Tensor | None:
    """The per-channel multiplier of in_proj's output [z | x | B | C | dt] (None when all are 1)."""
    if all(m == 1.0 for m in cfg.in_proj_multipliers):
        return None
    gn = cfg.n_groups * cfg.d_state
    sizes = (cfg.d_inner, cfg.d_inner, gn, gn, cfg.num_heads)
    return torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, cfg.in_proj_multipliers)])


class Mamba2Mixer(Mixer):
    cache_group = "state"

    def __init__(self, hidden_size: int, cfg: Mamba2Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.in_proj = Linear(hidden_size, cfg.in_proj_dim, cfg.proj_bias, dtype)
        self.conv1d = CausalConv1d(cfg.conv_dim, cfg.d_conv, cfg.conv_bias, cfg.activation, dtype)
        self.dt_bias = empty_param(cfg.num_heads, dtype=dtype)
        self.A_log = empty_param(cfg.num_heads, dtype=dtype)
        self.D = empty_param(cfg.num_heads, dtype=dtype)
        if cfg.gate_norm != "gate":  # "gate" alone has no norm (and no norm weight on disk)
            group = cfg.d_inner // cfg.n_groups
            self.norm = GatedRMSNorm(cfg.d_inner, group, cfg.norm_eps, dtype, cfg.gate_norm == "rmsnorm_gate")
        out_bias = cfg.proj_bias if cfg.out_proj_bias is None else cfg.out_proj_bias
        self.out_proj = Linear(cfg.d_inner, hidden_size, out_bias, dtype)
        scale = in_proj_scale(cfg)
        self.register_buffer("in_proj_scale", None if scale is None else scale.to(dtype), persistent=False)
        # Plain decode steps take mamba2_decode when it covers this config (False: always the reference path).
        self.fast_decode = decode_supported(self)
        # The native kernel bound to this mixer's weights (kernels/mamba2_step.py), which mamba2_decode runs on
        # plain fp32 decode steps; None: its torch ops. set_native.
        self.native_step: Mamba2Step | None = None

    def set_native(self, on: bool) -> None:
        """Plain fp32 decode steps through the native kernel (where it builds); call again after reloading weights."""
        c = self.cfg
        if not (on and self.fast_decode and self.dt_bias.dtype == torch.float32 and mamba2_step_available()):
            self.native_step = None
            return
        norm = None if c.gate_norm == "gate" else self.norm
        self.native_step = Mamba2Step(
            self.conv1d.weight, self.conv1d.bias, (c.num_heads, c.head_dim, c.n_groups, c.d_state), self.dt_bias,
            self.A_log, self.D, c.time_step_limit, None if norm is None else norm.weight, c.gate_norm,
            0 if norm is None else norm.group_size, c.norm_eps,
        )  # fmt: skip

    def capture_decode(self, builder: DecodeCapture, x: torch.Tensor, caches: ModelCaches, layer: int) -> torch.Tensor:
        """Record a plain decode step through the native step, in place on the step's slots (model/capture.py)."""
        require_type(self, Mamba2Mixer, f"layer {layer}: mixer")
        c = self.cfg
        multipliers = c.input_multiplier != 1.0 or self.in_proj_scale is not None or c.output_multiplier != 1.0
        if self.native_step is None or multipliers:
            raise GraphUnsupportedError(f"layer {layer}: a Mamba2 mixer without its native step, or with multipliers")
        state = caches.state[layer]
        conv, ssm = (f32_contiguous(state[n], f"layer {layer}'s {n} state") for n in ("conv", "ssm"))
        proj = self.in_proj.capture_decode(builder, x)
        y = builder.mamba2_step(self.native_step, proj, conv, ssm, caches.slot_positions)
        return self.out_proj.capture_decode(builder, y)

    def _gate(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if self.cfg.gate_norm == "gate":
            return (y.float() * torch.nn.functional.silu(z.float())).to(z.dtype)
        return self.norm(y, z)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        """hidden [T, D] -> [T, D]; reads and updates this layer's `conv` and `ssm` state tensors."""
        state, slot_positions = self.layer_cache(caches, layer), caches.slot_positions
        conv_state, ssm_state = state["conv"], state["ssm"]
        meta = batch.ssm
        fast = self.fast_decode and meta is not None and meta.plain_decode
        if fast and ssm_state.dtype == torch.float32 and ssm_state.is_contiguous():
            return mamba2_decode(self, hidden, batch, conv_state, ssm_state, slot_positions)
        return self.forward_ref(hidden, batch, conv_state, ssm_state, slot_positions)

    def forward_ref(
        self,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        slot_positions: torch.Tensor,
    ) -> torch.Tensor:
        """The general path (prefill, chunked, mixed and every decode step): the reference of mamba2_decode."""
        meta = batch.ssm
        if meta is None:
            raise ValueError("a Mamba2 layer needs batch.ssm metadata")
        c = self.cfg
        t = hidden.shape[0]
        proj = self.in_proj(hidden if c.input_multiplier == 1.0 else hidden * c.input_multiplier)
        if self.in_proj_scale is not None:
            proj = proj * self.in_proj_scale
        z, xbc, dt = proj.split([c.d_inner, c.conv_dim, c.num_heads], dim=-1)
        xbc = self.conv1d(xbc.contiguous(), conv_state, batch)  # (t, conv_dim)
        gn = c.n_groups * c.d_state
        x, b, cc = xbc.split([c.d_inner, gn, gn], dim=-1)
        x = x.reshape(t, c.num_heads, c.head_dim)  # (t, h, p)
        b = b.reshape(t, c.n_groups, c.d_state)  # (t, g, n)
        cc = cc.reshape(t, c.n_groups, c.d_state)
        dt = dt.contiguous()  # (t, h)
        a = -torch.exp(self.A_log.float())  # (h,)
        d, dt_bias = self.D.float(), self.dt_bias.float()
        if meta.is_decode:
            y = batch.kernels.ssd_state_update(
                ssm_state, x, dt, a, b, cc, d, dt_bias, True, c.time_step_limit, meta.state_indices,
                slot_positions, batch.positions, meta.has_initial_state,
            )  # fmt: skip
            copy_decode_checkpoints(ssm_state, meta, slot_positions)
        else:
            y = batch.kernels.ssd(
                x, dt, a, b, cc, d, dt_bias, True, c.time_step_limit, ssm_state, meta,
                slot_positions=slot_positions,
            )  # fmt: skip
        y = self._gate(y.reshape(t, c.d_inner), z)
        out = self.out_proj(y.to(hidden.dtype))
        return out if c.output_multiplier == 1.0 else out * c.output_multiplier
