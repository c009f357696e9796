"""Zaya's MoE, names as transformers' ZayaSparseMoeBlock: `gate` (the router) and `experts` (stacked SwiGLUs).

    r = gate.down_proj(x) (+ the previous layer's r * router_states_scale, from layer 1 on)
    p = softmax(router_mlp(r))   router_mlp: RMSNorm, fc1, gelu, fc2, gelu, out_proj over E + 1 classes
    e = argmax(p + balancing_biases)   (one expert per token; class E is the skip expert: output 0)
    out = p[e] * down_proj[e](silu(gate[e](x)) * up[e](x))
r goes on to the next layer's router (within the same token; no state across tokens).
A backend may hand the experts the kernel set's fused experts (`set_moe_kernel`): the skip expert's id (E) is
outside the stack, so it computes nothing there too; the per-expert loop below is its reference."""

from __future__ import annotations

import torch
from torch import nn

from recap.kernels.kernel_set import Kernel
from recap.model.layers.linear import Linear, empty_param
from recap.model.layers.norm import RMSNorm


class ZayaRouter(nn.Module):
    def __init__(self, hidden: int, router_hidden: int, experts: int, eps: float, first: bool,
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        self.down_proj = Linear(hidden, router_hidden, True, dtype)
        if not first:  # transformers' use_eda: every layer but the first adds the previous router state
            self.router_states_scale = empty_param(router_hidden, dtype=dtype)
        m = self.router_mlp = nn.Module()
        m.norm = RMSNorm(router_hidden, eps, dtype)
        m.fc1 = Linear(router_hidden, router_hidden, True, dtype)
        m.fc2 = Linear(router_hidden, router_hidden, True, dtype)
        m.out_proj = Linear(router_hidden, experts + 1, False, dtype)
        self.balancing_biases = empty_param(experts + 1, dtype=torch.float32)

    def forward(self, x: torch.Tensor, prev: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """x [T, D] -> (expert index [T], its probability [T], this router's state [T, R])."""
        r = self.down_proj(x)
        if prev is not None and hasattr(self, "router_states_scale"):
            r = r + prev * self.router_states_scale
        m, gelu = self.router_mlp, nn.functional.gelu
        probs = torch.softmax(m.out_proj(gelu(m.fc2(gelu(m.fc1(m.norm(r)))))), dim=-1)
        index = torch.argmax(probs.float() + self.balancing_biases, dim=-1)
        return index, probs.gather(-1, index[:, None])[:, 0], r


class ZayaMoE(nn.Module):
    def __init__(self, hidden: int, router_hidden: int, experts: int, intermediate: int, eps: float,
                 first: bool, dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        self.gate = ZayaRouter(hidden, router_hidden, experts, eps, first, dtype)
        self.experts = nn.Module()
        self.experts.gate_up_proj = empty_param(experts, 2 * intermediate, hidden, dtype=dtype)
        self.experts.down_proj = empty_param(experts, hidden, intermediate, dtype=dtype)
        self.moe_kernel: Kernel | None = None

    def set_moe_kernel(self, kernel: Kernel | None) -> None:
        """The fused experts (kernels/triton/fused_moe.py's signature) from now on; None: the loop."""
        self.moe_kernel = kernel

    def forward(self, x: torch.Tensor, prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (output [T, D], the router state for the next layer)."""
        index, weight, r = self.gate(x, prev)
        if self.moe_kernel is not None:
            ex = self.experts
            return self.moe_kernel(x, ex.gate_up_proj, ex.down_proj, index[:, None], weight[:, None]), r
        out = torch.zeros_like(x)
        num = self.experts.gate_up_proj.shape[0]
        for e in torch.unique(index).tolist():
            if e == num:  # the skip expert computes nothing
                continue
            rows = torch.nonzero(index == e)[:, 0]
            gate, up = nn.functional.linear(x[rows], self.experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = nn.functional.linear(nn.functional.silu(gate) * up, self.experts.down_proj[e])
            out.index_add_(0, rows, (y * weight[rows, None]).to(out.dtype))
        return out, r
