"""Gated DeltaNet mixer (Qwen3-Next, Qwen3.5 / 3.6, OLMo-Hybrid's linear-attention layers).

Glossary (recap/kernels/gdn.py): Hk key heads of Dk, Hv value heads of Dv.
  [q | k | v] = input projections -> causal depthwise conv + silu (conv window in the `conv` state tensor)
  q, k L2-normalized (fp32, eps 1e-6), q scaled by Dk^-1/2;  beta = sigmoid(b) (* 2 with OLMo's neg. eigenvalues)
  g = -exp(A_log) softplus(a + dt_bias)  (log decay per value head)
  o = gated delta rule (matrix state [Hv, Dk, Dv] in the `recurrent` state tensor)
  out = out_proj(rmsnorm_per_head(o) * silu(z))
The three families differ only in how the projections sit on disk (`GatedDeltaNetConfig.projection`).
"""

from __future__ import annotations

import torch

from recap.kernels.gdn_step import GdnStep, gdn_step_available
from recap.kernels.metadata import ForwardBatch
from recap.kernels.varlen import copy_decode_checkpoints
from recap.model.cache import ModelCaches
from recap.model.capture import DecodeCapture, GraphUnsupportedError, f32_contiguous, require_type
from recap.model.layers.conv import CausalConv1d
from recap.model.layers.linear import Linear, empty_param
from recap.model.layers.mixer import Mixer
from recap.model.layers.norm import HeadGatedRMSNorm
from recap.model.mixer_configs import GatedDeltaNetConfig


class GatedDeltaNetMixer(Mixer):
    cache_group = "state"

    def __init__(self, hidden_size: int, cfg: GatedDeltaNetConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        kd, vd, hv = cfg.key_dim, cfg.value_dim, cfg.num_v_heads
        if cfg.projection == "qwen3_next":
            self.in_proj_qkvz = Linear(hidden_size, 2 * kd + 2 * vd, False, dtype)
            self.in_proj_ba = Linear(hidden_size, 2 * hv, False, dtype)
        elif cfg.projection == "qwen3_5":
            self.in_proj_qkv = Linear(hidden_size, 2 * kd + vd, False, dtype)
            self.in_proj_z = Linear(hidden_size, vd, False, dtype)
            self.in_proj_b = Linear(hidden_size, hv, False, dtype)
            self.in_proj_a = Linear(hidden_size, hv, False, dtype)
        else:  # olmo_hybrid
            for name, dim in (("q_proj", kd), ("k_proj", kd), ("v_proj", vd), ("a_proj", hv), ("b_proj", hv),
                              ("g_proj", vd)):  # fmt: skip
                setattr(self, name, Linear(hidden_size, dim, False, dtype))
        if cfg.projection == "olmo_hybrid":  # one conv weight per input on disk; run as one [q | k | v] conv
            for name, dim in (("q_conv1d", kd), ("k_conv1d", kd), ("v_conv1d", vd)):
                setattr(self, name, CausalConv1d(dim, cfg.conv_kernel, False, cfg.activation, dtype))
        else:
            self.conv1d = CausalConv1d(cfg.conv_dim, cfg.conv_kernel, False, cfg.activation, dtype)
        self.dt_bias = empty_param(hv, dtype=dtype)
        self.A_log = empty_param(hv, dtype=dtype)
        olmo = cfg.projection == "olmo_hybrid"
        self._norm_name, self._out_name = ("o_norm", "o_proj") if olmo else ("norm", "out_proj")
        setattr(self, self._norm_name, HeadGatedRMSNorm(cfg.head_v_dim, cfg.norm_eps, dtype))
        setattr(self, self._out_name, Linear(vd, hidden_size, False, dtype))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, D] -> (qkv [T, conv_dim] as [q | k | v] with heads in order, z [T, Vd], b [T, Hv], a [T, Hv])."""
        c, t = self.cfg, x.shape[0]
        if c.projection == "qwen3_5":
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        if c.projection == "olmo_hybrid":
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
            return qkv, self.g_proj(x), self.b_proj(x), self.a_proj(x)
        # qwen3_next: per key head [q (Dk) | k (Dk) | v (r Dv) | z (r Dv)] and [b (r) | a (r)], r = Hv / Hk
        r = c.num_v_heads // c.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(t, c.num_k_heads, -1)
        q, k, v, z = qkvz.split([c.head_k_dim, c.head_k_dim, r * c.head_v_dim, r * c.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(t, c.num_k_heads, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return qkv, z.reshape(t, -1), b.reshape(t, -1), a.reshape(t, -1)

    def _conv(self, qkv: torch.Tensor, conv_state: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The causal conv + activation over [q | k | v], rolling the `conv` window of the rows' slots."""
        meta = batch.ssm
        assert meta is not None
        if self.cfg.projection != "olmo_hybrid":
            return self.conv1d(qkv, conv_state, batch)
        w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)  # (d, k)
        act = self.cfg.activation
        if meta.is_decode:
            y = batch.kernels.causal_conv1d_update(
                qkv, conv_state, w, None, meta.state_indices, act, meta.has_initial_state
            )
            copy_decode_checkpoints(conv_state, meta, None)  # the update kernel writes running slots only
            return y
        return batch.kernels.causal_conv1d(qkv, w, None, conv_state, meta, act)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        """hidden [T, D] -> [T, D]; reads and updates this layer's `conv` and `recurrent` state tensors."""
        state, slot_positions = self.layer_cache(caches, layer), caches.slot_positions
        meta = batch.ssm
        if meta is None:
            raise ValueError("a Gated DeltaNet layer needs batch.ssm metadata")
        c, t = self.cfg, hidden.shape[0]
        qkv, z, b, a = self._project(hidden)
        qkv = self._conv(qkv.contiguous(), state["conv"], batch)
        q, k, v = qkv.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        q, k = (x.reshape(t, c.num_k_heads, c.head_k_dim) for x in (q, k))  # normalised by the kernel
        g, beta = batch.kernels.gdn_gates(a, b, self.A_log, self.dt_bias)
        if c.beta_scale != 1.0:
            beta = beta * c.beta_scale
        v = v.reshape(t, c.num_v_heads, c.head_v_dim)
        # (t, hv, dv)
        o = batch.kernels.gated_delta_rule(q, k, v, g, beta, state["recurrent"], meta, slot_positions,
                                           normalize_qk=True)  # fmt: skip
        o = getattr(self, self._norm_name)(o.reshape(t, c.value_dim), z)
        return getattr(self, self._out_name)(o.to(hidden.dtype))

    def capture_decode(self, builder: DecodeCapture, x: torch.Tensor, caches: ModelCaches, layer: int) -> torch.Tensor:
        """Record a plain decode step (model/capture.py): the four input projections, the native step in place on
        the step's slots (kernels/gdn_step.py: this forward's decode arithmetic), out_proj. Qwen3.5's projection
        layout with a silu conv and no beta scale only."""
        require_type(self, GatedDeltaNetMixer, f"layer {layer}: mixer")
        c = self.cfg
        norm = self.norm if c.projection == "qwen3_5" else None
        if norm is None or c.activation not in ("silu", "swish") or c.beta_scale != 1.0 or not gdn_step_available():
            raise GraphUnsupportedError(f"layer {layer}: a GDN mixer of the {c.projection!r} layout, activation "
                                        f"{c.activation!r}, beta scale {c.beta_scale}")  # fmt: skip
        if norm.norm_kernel is not None or self.conv1d.bias is not None:
            raise GraphUnsupportedError(f"layer {layer}: a GDN mixer with a fused norm kernel or a conv bias")
        state = self.layer_cache(caches, layer)
        conv, rec = (f32_contiguous(state[n], f"layer {layer}'s {n} state") for n in ("conv", "recurrent"))
        heads = (c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim)
        try:
            step = GdnStep(f32_contiguous(self.conv1d.weight, "a conv weight").squeeze(1), self.A_log, self.dt_bias,
                           norm.weight, norm.eps, heads)  # fmt: skip
        except ValueError as e:
            raise GraphUnsupportedError(f"layer {layer}: {e}") from None
        qkv, z, b, a = (p.capture_decode(builder, x) for p in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b,
                                                                self.in_proj_a))  # fmt: skip
        y = builder.gdn_step(step, qkv, z, b, a, conv, rec, caches.slot_positions)
        return self.out_proj.capture_decode(builder, y)
