"""xLSTM's mLSTM layer, its norms and its gated feed-forward (transformers' xLSTMLayer, xLSTMRMSNorm,
xLSTMMultiHeadLayerNorm and xLSTMFeedForward; weights named as on disk):
  q, k, v, o = projections of x ("single": q, k, v, ogate_preact; "fused": qkv_opreact split in that order)
  i, f = soft_cap(igate_preact(x)), soft_cap(fgate_preact(x))  ("fused": ifgate_preact split)
  h = mLSTM(q, k, v, i, f) per head (kernels/mlstm.py);  y = out_proj(sigmoid(o) * multihead_norm(h))
"""

from __future__ import annotations

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layers.linear import Linear, empty_param
from recap.model.layers.mixer import Mixer
from recap.model.layers.norm import RMSNorm
from recap.model.xlstm_config import XlstmConfig


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else cap * torch.tanh(x / cap)


class XlstmRMSNorm(RMSNorm):
    """weight * x / rms(x) (+ bias), reduced in fp32 when `force_float32` (transformers' order of operations).

    With no bias and the fp32 reduction it is the fused kernels' `weight_in_dtype` norm, so it takes them where a
    backend hands them over (RMSNorm's `add_forward` included); otherwise it always runs the ops below."""

    def __init__(self, dim: int, eps: float, bias: bool, force_float32: bool, dtype: torch.dtype) -> None:
        super().__init__(dim, eps, dtype)
        self.force_float32 = force_float32
        self.bias = empty_param(dim, dtype=dtype) if bias else None

    def _weight_fits(self, x: torch.Tensor) -> bool:
        return self.bias is None and self.force_float32 and super()._weight_fits(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused(x):
            assert self.norm_kernel is not None
            return self.norm_kernel(x, self.weight, self.eps, weight_in_dtype=True)
        y = x.float() if self.force_float32 else x
        y = (y * torch.rsqrt(y.pow(2).mean(dim=-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
        return y if self.bias is None else y + self.bias


class MultiHeadLayerNorm(nn.Module):
    """A LayerNorm (no affine) over each head's V features, then one weight (+ bias) over all heads."""

    def __init__(self, heads: int, head_dim: int, cfg: XlstmConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.eps, self.force_float32 = heads, cfg.norm_eps, cfg.force_float32_norm
        self.weight = empty_param(heads * head_dim, dtype=dtype)
        self.bias = empty_param(heads * head_dim, dtype=dtype) if cfg.use_bias else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, H, V] -> [T, H * V]."""
        y = h.float() if self.force_float32 else h
        y = (y - y.mean(-1, keepdim=True)) * torch.rsqrt(y.var(-1, keepdim=True, unbiased=False) + self.eps)
        y = y.to(h.dtype).flatten(1) * self.weight
        return y if self.bias is None else y + self.bias


class MlstmLayer(Mixer):
    cache_group = "state"

    def __init__(self, hidden_size: int, cfg: XlstmConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        qk, v, heads, bias = cfg.qk_dim, cfg.v_dim, cfg.num_heads, cfg.use_bias
        if cfg.weight_mode == "single":
            self.q = Linear(hidden_size, qk, bias, dtype)
            self.k = Linear(hidden_size, qk, bias, dtype)
            self.v = Linear(hidden_size, v, bias, dtype)
            self.ogate_preact = Linear(hidden_size, v, bias, dtype)
            self.igate_preact = Linear(hidden_size, heads, True, dtype)
            self.fgate_preact = Linear(hidden_size, heads, True, dtype)
        else:
            self.qkv_opreact = Linear(hidden_size, 2 * qk + 2 * v, bias, dtype)
            self.ifgate_preact = Linear(hidden_size, 2 * heads, True, dtype)
        self.multihead_norm = MultiHeadLayerNorm(heads, cfg.v_head_dim, cfg, dtype)
        self.out_proj = Linear(v, hidden_size, bias, dtype)

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q, k, v, o, i, f) of x [T, D], the gates soft-capped."""
        cfg = self.cfg
        if cfg.weight_mode == "single":
            q, k, v, o = self.q(x), self.k(x), self.v(x), self.ogate_preact(x)
            i = soft_cap(self.igate_preact(x), cfg.gate_soft_cap)
            f = soft_cap(self.fgate_preact(x), cfg.gate_soft_cap)
            return q, k, v, o, i, f
        q, k, v, o = torch.tensor_split(self.qkv_opreact(x), (cfg.qk_dim, 2 * cfg.qk_dim, 2 * cfg.qk_dim + cfg.v_dim),
                                        dim=-1)  # fmt: skip
        i, f = torch.tensor_split(soft_cap(self.ifgate_preact(x), cfg.gate_soft_cap), (cfg.num_heads,), dim=-1)
        return q, k, v, o, i, f

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        """x [T, D] (norm_mlstm's output) -> [T, D]; reads and updates this layer's `mlstm` state."""
        meta = batch.ssm
        if meta is None:
            raise ValueError("an mLSTM layer needs batch.ssm metadata")
        cfg = self.cfg
        q, k, v, o, i, f = self._projections(x)
        t, heads = x.shape[0], cfg.num_heads
        h = batch.kernels.mlstm_scan(
            q.reshape(t, heads, -1), k.reshape(t, heads, -1), v.reshape(t, heads, -1), i, f,
            self.layer_cache(caches, layer)["mlstm"], meta, caches.slot_positions, cfg.eps,
        )  # fmt: skip
        return self.out_proj(torch.sigmoid(o) * self.multihead_norm(h.to(x.dtype)))


class XlstmFeedForward(nn.Module):
    """silu(gate) * up, then proj_down ("single": proj_up_gate, proj_up; "fused": proj_up_gate_z split)."""

    def __init__(self, hidden_size: int, up: int, cfg: XlstmConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.up, self.fused = up, cfg.weight_mode == "fused"
        if self.fused:
            self.proj_up_gate_z = Linear(hidden_size, 2 * up, cfg.use_bias, dtype)
        else:
            self.proj_up_gate = Linear(hidden_size, up, cfg.use_bias, dtype)
            self.proj_up = Linear(hidden_size, up, cfg.use_bias, dtype)
        self.proj_down = Linear(up, hidden_size, cfg.use_bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, z = torch.tensor_split(self.proj_up_gate_z(x), (self.up,), dim=-1)
        else:
            gate, z = self.proj_up_gate(x), self.proj_up(x)
        return self.proj_down(torch.nn.functional.silu(gate) * z)
