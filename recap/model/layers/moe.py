"""Sparse mixture of experts: a router, routed experts (per-expert modules or stacked 3-D weights), shared experts.

The routing kinds of the families recap loads are fields of `MoEConfig` (see its docstring):
  Jamba          softmax, top-k, weights not renormalized
  Granite 4.0-H  softmax, top-k, renormalized (= softmax over the top-k logits)
  Qwen-MoE       softmax, top-k, renormalized if norm_topk_prob; shared expert behind a sigmoid gate
  Nemotron-H     sigmoid + correction bias, grouped top-k, renormalized, routed scaling; non-gated relu2 experts
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from recap.kernels.kernel_set import Kernel
from recap.kernels.moe import MOE_ACTIVATIONS
from recap.model.feed_forward_configs import MLPConfig, MoEConfig
from recap.model.layers.activation import activation
from recap.model.layers.linear import Linear, empty_param
from recap.model.layers.mixer import Mixer
from recap.model.layers.mlp import MLP, clamp_swiglu, split_gate_up

if TYPE_CHECKING:
    from recap.kernels.metadata import ForwardBatch
    from recap.model.cache import ModelCaches

logger = logging.getLogger(__name__)
_REFUSALS_LOGGED: set[str] = set()


def route(
    logits: torch.Tensor, cfg: MoEConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (fp32) -> (weights [T, k] fp32, expert ids [T, k]) as `cfg` says."""
    scores = torch.softmax(logits, dim=-1) if cfg.scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias
    if cfg.num_groups > 1:
        t, g = choice.shape[0], cfg.num_groups
        grouped = choice.view(t, g, -1)  # (t, g, e/g)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # (t, g)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(cfg.topk_groups, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(t, -1)
    experts = choice.topk(cfg.top_k, dim=-1).indices  # (t, k)
    weights = scores.gather(1, experts)
    if cfg.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, experts


class Router(Linear):
    """logits = x W^T ([E, H] weight); `e_score_correction_bias` [E] (fp32, as HF keeps it) when the config has one."""

    def __init__(self, hidden_size: int, cfg: MoEConfig, dtype: torch.dtype) -> None:
        super().__init__(hidden_size, cfg.num_experts, False, dtype)
        bias = empty_param(cfg.num_experts, dtype=torch.float32) if cfg.correction_bias else None
        self.e_score_correction_bias = bias

    def route(self, x: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
        return route(self(x).float(), cfg, self.e_score_correction_bias)


def _grouped(experts: torch.Tensor, weights: torch.Tensor, num_experts: int):  # noqa: ANN202
    """(expert, token ids, their weights [n, 1]) for each expert that got tokens: one sort, no per-expert scan."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // k
    w = weights.reshape(-1)[order, None]
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        if n:
            yield e, tokens[start : start + n], w[start : start + n]
            start += n


class FusedExperts(nn.Module, ABC):
    """Routed experts that a backend may run through the kernel set's fused experts (`set_moe_kernel`: one
    fixed-shape call a CUDA graph can hold, kernels/moe.py); their per-expert loop (`run`) is its reference."""

    cfg: MoEConfig
    moe_kernel: Kernel | None = None
    moe_refusal: str | None = None  # why the kernel handed was not taken: the loop runs

    def set_moe_kernel(self, kernel: Kernel | None) -> None:
        """`kernel` for these experts from now on, where it serves them (else, and for None: the loop)."""
        self.moe_kernel, self.moe_refusal = None, None
        if kernel is None:
            return
        c = self.cfg
        self.moe_refusal = ("expert biases" if c.bias else "soft-capped SwiGLU experts" if c.softcaps is not None
                            else f"activation {c.activation!r}" if c.activation not in MOE_ACTIVATIONS
                            else self._fusable())  # fmt: skip
        if self.moe_refusal is not None and self.moe_refusal not in _REFUSALS_LOGGED:  # once, not per layer
            _REFUSALS_LOGGED.add(self.moe_refusal)
            logger.warning("routed experts keep their per-expert loop (it reads the host: no CUDA graph holds it), "
                           "the fused kernel does not serve %s", self.moe_refusal)  # fmt: skip
        if self.moe_refusal is None:
            self.moe_kernel = kernel

    @abstractmethod
    def _fusable(self) -> str | None:
        """Ready the weights for the kernel; what it cannot serve (None: nothing)."""

    @abstractmethod
    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(w_in [E, 2I or I, D], w_out [E, D, I], gate/up rows interleaved) as the kernel takes them."""

    def _fused(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        assert self.moe_kernel is not None
        w_in, w_out, interleaved = self._stacked()
        c = self.cfg
        return self.moe_kernel(x, w_in, w_out, experts, weights, activation=c.activation, gated=c.gated,
                               interleaved=interleaved, swiglu_limit=c.swiglu_limit)  # fmt: skip


def _share(linear: Linear, weight: torch.Tensor) -> None:
    """Serve `linear` from `weight` (its values, in other storage: a view of a stacked copy); dense layers only."""
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.impl.weight = linear.weight


class ExpertList(FusedExperts, nn.ModuleList):
    """Routed experts as on disk in per-expert form: `experts.{e}.{gate_proj,up_proj,down_proj}.weight`.

    For the fused kernel their weights are stacked once (`set_moe_kernel`) and each expert's layers then read
    views of the stacks: one copy of the weights either way."""

    def __init__(self, dim: int, cfg: MoEConfig, dtype: torch.dtype) -> None:
        mlp = MLPConfig(cfg.intermediate_size, cfg.activation, cfg.bias, cfg.gated, swiglu_limit=cfg.swiglu_limit)
        super().__init__(MLP(dim, mlp, dtype) for _ in range(cfg.num_experts))
        self.cfg = cfg
        self._stacks: tuple[torch.Tensor, torch.Tensor] | None = None

    def _fusable(self) -> str | None:
        names = ("gate_proj", "up_proj", "down_proj") if self.cfg.gated else ("up_proj", "down_proj")
        layers = [[getattr(m, n) for n in names] for m in self]
        if any(lin.backend != "torch" or lin.released for ls in layers for lin in ls):
            return "quantized or packed expert layers (int8/int4/oneDNN): it takes dense fp32/bf16/fp16 weights"
        with torch.no_grad():
            w_in = torch.stack([torch.cat([lin.weight for lin in ls[:-1]]) for ls in layers])
            w_out = torch.stack([ls[-1].weight for ls in layers])
        i = self.cfg.intermediate_size
        for e, ls in enumerate(layers):
            for j, lin in enumerate(ls[:-1]):
                _share(lin, w_in[e, j * i : (j + 1) * i])
            _share(ls[-1], w_out[e])
        self._stacks = (w_in, w_out)
        return None

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        assert self._stacks is not None
        return *self._stacks, False

    def run(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.moe_kernel is not None:
            return self._fused(x, experts, weights)
        out = torch.zeros_like(x)
        for e, tok, w in _grouped(experts, weights, len(self)):
            out.index_add_(0, tok, self[e](x[tok]).mul_(w))
        return out


def softcapped_swiglu(gate: torch.Tensor, up: torch.Tensor, gate_cap: float, up_cap: float) -> torch.Tensor:
    """cap_g tanh(gate / cap_g) * sigmoid(gate) * cap_u tanh(up / cap_u), in fp32 (Inkling-2's experts)."""
    g, u = gate.float(), up.float()
    out = torch.tanh(g / gate_cap) * gate_cap * torch.sigmoid(g) * (torch.tanh(u / up_cap) * up_cap)
    return out.to(gate.dtype)


class StackedExperts(FusedExperts):
    """Routed experts as 3-D weights: `gate_up_proj` [E, 2I, D] (gate rows first; `up_proj` [E, I, D] when not
    gated) and `down_proj` [E, D, I]."""

    def __init__(self, dim: int, cfg: MoEConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg, self.num_experts, i = cfg, cfg.num_experts, cfg.intermediate_size
        if cfg.gated:
            self.gate_up_proj = empty_param(cfg.num_experts, 2 * i, dim, dtype=dtype)
        else:
            self.up_proj = empty_param(cfg.num_experts, i, dim, dtype=dtype)
        self.down_proj = empty_param(cfg.num_experts, dim, i, dtype=dtype)
        self.act = activation(cfg.activation)

    def _fusable(self) -> str | None:
        dtype = self.down_proj.dtype
        return None if dtype in (torch.float32, torch.bfloat16, torch.float16) else f"{dtype} expert weights"

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        w_in = self.gate_up_proj if self.cfg.gated else self.up_proj
        return w_in, self.down_proj, self.cfg.interleaved_gate_up

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.gated:
            gate_up = F.linear(x, self.gate_up_proj[e])
            gate, up = clamp_swiglu(*split_gate_up(gate_up, self.cfg.interleaved_gate_up), self.cfg.swiglu_limit)
            if self.cfg.softcaps is not None:
                return F.linear(softcapped_swiglu(gate, up, *self.cfg.softcaps), self.down_proj[e])
            return F.linear(self.act(gate).mul_(up), self.down_proj[e])
        return F.linear(self.act(F.linear(x, self.up_proj[e])), self.down_proj[e])

    def run(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.moe_kernel is not None:
            return self._fused(x, experts, weights)
        out = torch.zeros_like(x)
        for e, tok, w in _grouped(experts, weights, self.num_experts):
            out.index_add_(0, tok, self._expert(e, x[tok]).mul_(w))
        return out


class SparseMoE(Mixer):
    """routed(x) (+ shared(x), gated by sigmoid(shared_expert_gate(x)) when configured).

    The router, shared-expert and shared-gate attribute names follow the family's checkpoint
    (`router` / `gate`, `shared_experts` / `shared_expert`, `shared_expert_gate`).
    """

    def __init__(
        self,
        hidden_size: int,
        cfg: MoEConfig,
        dtype: torch.dtype,
        router_name: str = "router",
        shared_name: str = "shared_experts",
        shared_gate_name: str = "shared_expert_gate",
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self._names = (router_name, shared_name, shared_gate_name)
        setattr(self, router_name, Router(hidden_size, cfg, dtype))
        dim = cfg.latent_size or hidden_size
        if cfg.latent_size:
            self.fc1_latent_proj = Linear(hidden_size, cfg.latent_size, cfg.shared_bias, dtype)
            self.fc2_latent_proj = Linear(cfg.latent_size, hidden_size, cfg.shared_bias, dtype)
        layout = ExpertList if cfg.expert_layout == "list" else StackedExperts
        self.experts = layout(dim, cfg, dtype)
        if cfg.shared_intermediate_size:
            shared = MLPConfig(cfg.shared_intermediate_size, cfg.activation, cfg.shared_bias, cfg.gated,
                               swiglu_limit=cfg.swiglu_limit)  # fmt: skip
            setattr(self, shared_name, MLP(hidden_size, shared, dtype))
        if cfg.shared_gate:
            setattr(self, shared_gate_name, Linear(hidden_size, 1, False, dtype))

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch | None = None,
        caches: ModelCaches | None = None,
        layer: int | None = None,
    ) -> torch.Tensor:
        """x [T, D] -> [T, D]. As a layer's mixer it is called like any mixer (layers/mixer.py) and reads no cache."""
        cfg = self.cfg
        router_name, shared_name, gate_name = self._names
        weights, experts = getattr(self, router_name).route(x, cfg)
        h = self.fc1_latent_proj(x) if cfg.latent_size else x
        out = self.experts.run(h, experts, weights.to(x.dtype))
        if cfg.latent_size:
            out = self.fc2_latent_proj(out)
        if cfg.shared_intermediate_size:
            shared = getattr(self, shared_name)(x)
            if cfg.shared_gate:
                shared = shared * torch.sigmoid(getattr(self, gate_name)(x))
            out = out + shared
        return out
