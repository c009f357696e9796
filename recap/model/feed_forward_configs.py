"""The feed-forward configs: a dense MLP, a sparse MoE (a layer's `mlp_types` entry says which, if any)."""

from __future__ import annotations

from dataclasses import dataclass

MLP_TYPES = ("none", "dense", "moe")


@dataclass(frozen=True)
class MLPConfig:
    """A dense feed-forward: gated down(act(gate(x) * gate_multiplier) * up(x)) * down_multiplier, or
    non-gated down(act(up(x))) (Nemotron-H's relu2 MLP)."""

    intermediate_size: int
    activation: str = "silu"
    bias: bool = False
    gated: bool = True
    fused_gate_up: bool = False  # one `gate_up_proj` [2I, H] (gate rows first) instead of gate_proj + up_proj
    gate_multiplier: float = 1.0  # Falcon-H1's mlp_multipliers[0]
    down_multiplier: float = 1.0  # Falcon-H1's mlp_multipliers[1]
    swiglu_limit: float | None = None  # gated only: gate clamped to <= L and up to [-L, L] (GLM-5.3-Flash)
    interleaved_gate_up: bool = False  # fused_gate_up rows alternate gate, up (Inkling's hub checkpoints)

    def flops_weights(self, hidden: int) -> int:
        """Weights one token multiplies: gate (if gated), up and down."""
        return (3 if self.gated else 2) * hidden * self.intermediate_size


ROUTER_SCORINGS = ("softmax", "sigmoid")
EXPERT_LAYOUTS = ("list", "stacked")


@dataclass(frozen=True)
class MoEConfig:
    """A sparse MoE: a router picks `top_k` of `num_experts` routed experts per token, plus optional shared experts.

    Routing (each field an HF config knob):
      scores = softmax(logits) | sigmoid(logits)            (`scoring`; logits in fp32)
      choice = scores + e_score_correction_bias             (`correction_bias`, DeepSeek-V3 / Nemotron-H)
      grouped top-k: keep the `topk_groups` of `num_groups` groups with the largest top-2 sum, then top-k
      weights = scores of the chosen experts (never the biased ones); / their sum if `renormalize`;
      * `routed_scaling_factor`.
    Shared experts (`shared_intermediate_size` > 0) see every token; their output is scaled by
    sigmoid(shared_expert_gate(x)) when `shared_gate` (Qwen-MoE), and added to the routed output.
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    activation: str = "silu"
    gated: bool = True  # experts (and shared experts) are gated MLPs; False: down(act(up(x)))
    bias: bool = False  # on the routed experts' projections (list layout only)
    shared_bias: bool = False  # on the shared experts' and the latent projections
    scoring: str = "softmax"
    renormalize: bool = False
    correction_bias: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    expert_layout: str = "list"  # "list": experts.{e}.*_proj.weight; "stacked": experts.gate_up_proj [E, 2I, H] ...
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_gate: bool = False
    latent_size: int | None = None  # routed experts run in a latent space: fc1_latent_proj / fc2_latent_proj
    swiglu_limit: float | None = None  # routed and shared experts: as MLPConfig.swiglu_limit
    # Shared experts the router scores too, as a sink (Inkling, layers/sink_moe.py): weights = sigmoid of the
    # chosen and the shared logits, normalized over both; each shared expert's output is scaled by its weight.
    shared_sink: int = 0
    interleaved_gate_up: bool = False  # stacked gate_up_proj rows (and a sink's shared ones) alternate gate, up
    # (gate cap, up cap): experts compute tanh-capped gate * sigmoid(gate) * tanh-capped up (Inkling-2)
    softcaps: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"bad MoE shape: {self.num_experts} experts, top-{self.top_k}")
        if self.scoring not in ROUTER_SCORINGS:
            raise ValueError(f"unknown router scoring {self.scoring!r}; choose one of {ROUTER_SCORINGS}")
        if self.expert_layout not in EXPERT_LAYOUTS:
            raise ValueError(f"unknown expert layout {self.expert_layout!r}; choose one of {EXPERT_LAYOUTS}")
        if self.num_experts % self.num_groups or not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(
                f"bad expert groups: {self.num_experts} experts, top-{self.topk_groups} of {self.num_groups}"
            )
        if self.num_groups > 1 and self.top_k > self.topk_groups * (self.num_experts // self.num_groups):
            raise ValueError("top_k exceeds the experts in the kept groups")
        if self.shared_gate and not self.shared_intermediate_size:
            raise ValueError("shared_gate without a shared expert")
        if self.bias and self.expert_layout == "stacked":
            raise ValueError("stacked experts carry no bias")

    def flops_weights(self, hidden: int) -> int:
        """Weights one token multiplies: router + top_k routed experts + shared experts (+ latent projections)."""
        per = (3 if self.gated else 2) * self.intermediate_size
        inner = self.latent_size or hidden
        total = hidden * self.num_experts + self.top_k * per * inner
        if self.latent_size:
            total += 2 * hidden * self.latent_size
        shared = (3 if self.gated else 2) * hidden * self.shared_intermediate_size + per * hidden * self.shared_sink
        return total + shared


