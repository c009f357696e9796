"""HF `config.json` -> frozen `ModelConfig`, the only config the layers ever read.

One translator per architecture turns the HF dict into normalized per-layer lists:
- `layer_types[i]`: "mamba1" | "mamba2" | "attention" | "short_conv" | "kda" (the mixer of layer i)
- `mlp_types[i]`:   "none" | "dense" | "moe" (the feed-forward after the mixer, if any)
The translators live in `hf_config.py` (re-exported here); adding a family = one translator there +
one short model file in `recap/model/models/`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from recap.model.state_spec import StateTensorSpec, check_specs, conv_window_spec

LAYER_TYPES = ("mamba1", "mamba2", "attention", "short_conv", "kda")
MLP_TYPES = ("none", "dense", "moe")
# Mamba1 has no chunked algorithm; the runner still cuts rows on this grid (cheap and harmless).
DEFAULT_MAMBA1_CHUNK = 256


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture has no translator (the message lists the supported ones)."""


@dataclass(frozen=True)
class AttentionConfig:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float | None  # None: no positional encoding in the layer (Jamba)
    rotary_dim: int  # leading dims of each head that are rotated (head_dim * partial factor); 0 if no rope
    bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm (q_norm, k_norm) on q and k before RoPE (Qwen3, LFM2)
    qk_norm_eps: float = 1e-6
    output_gate: bool = False  # each head's output scaled by sigmoid(g_proj(x)) (LFM3)
    # "Proportional" RoPE (LFM3 full attention): only the first rope_angles of the rotary_dim / 2 frequency
    # pairs turn (frequencies from rotary_dim), the rest stay put; None: every pair turns.
    rope_angles: int | None = None

    def kv_specs(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """What the layer caches per token: (name, shape) of each paged tensor."""
        return ("k", (self.num_kv_heads, self.head_dim)), ("v", (self.num_kv_heads, self.head_dim))


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2 MLA; Kimi-Linear's, without positional encoding).

    Per token the layer caches only the compressed latent c (kv_lora_rank, after kv_a_layernorm) and the
    shared rope key (qk_rope_head_dim); K and V of every head are expanded from c by kv_b_proj when read.
    """

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    bias: bool = False  # on q_a_proj, kv_a_proj_with_mqa and o_proj
    norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def kv_specs(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return ("latent", (1, self.kv_lora_rank)), ("rope", (1, self.qk_rope_head_dim))


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
        return total + (3 if self.gated else 2) * hidden * self.shared_intermediate_size


@dataclass(frozen=True)
class Mamba1Config:
    d_inner: int
    d_state: int
    d_conv: int
    dt_rank: int
    conv_bias: bool
    proj_bias: bool
    activation: str = "silu"
    # RMS norms on dt, B, C after x_proj: "none" (Mamba), "plain" (FalconMamba, no weights), "weighted" (Jamba)
    bcdt_norm: str = "none"
    bcdt_norm_eps: float = 1e-6

    @property
    def conv_dim(self) -> int:
        return self.d_inner

    def state_specs(self) -> tuple[StateTensorSpec, ...]:
        ssm = StateTensorSpec("ssm", (self.d_inner, self.d_state), torch.float32)
        return conv_window_spec(self.conv_dim, self.d_conv), ssm


@dataclass(frozen=True)
class Mamba2Config:
    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    d_conv: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    time_step_limit: tuple[float, float]
    norm_eps: float  # the gated RMSNorm before out_proj
    activation: str = "silu"

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def in_proj_dim(self) -> int:
        return self.d_inner + self.conv_dim + self.num_heads  # [z | xBC | dt]

    def state_specs(self) -> tuple[StateTensorSpec, ...]:
        ssm = StateTensorSpec("ssm", (self.num_heads, self.head_dim, self.d_state), torch.float32)
        return conv_window_spec(self.conv_dim, self.d_conv), ssm


@dataclass(frozen=True)
class ShortConvConfig:
    """LFM2's gated short convolution: y = out_proj(C * conv(B * x)), [B | C | x] = in_proj(h); state = conv window."""

    dim: int  # channels (the hidden size)
    kernel: int  # conv taps (conv_L_cache)
    bias: bool = False  # on in_proj, the conv and out_proj

    def state_specs(self) -> tuple[StateTensorSpec, ...]:
        return (conv_window_spec(self.dim, self.kernel),)


@dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention: q, k, v through their own short convs (silu), a per-channel forget gate, a delta
    rule over a [head_dim, head_dim] matrix state per head, a gated RMSNorm on the output."""

    num_heads: int
    head_dim: int
    conv_kernel: int
    norm_eps: float = 1e-5

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim

    def state_specs(self) -> tuple[StateTensorSpec, ...]:
        convs = tuple(conv_window_spec(self.dim, self.conv_kernel, f"conv_{x}") for x in "qkv")
        return *convs, StateTensorSpec("recurrent", (self.num_heads, self.head_dim, self.head_dim), torch.float32)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    norm_eps: float
    tie_word_embeddings: bool
    ssm_chunk_size: int  # chunk grid the runner passes to build_forward_batch
    residual_in_fp32: bool = False
    attention: AttentionConfig | None = None
    mlp: MLPConfig | None = None
    moe: MoEConfig | None = None
    mamba1: Mamba1Config | None = None
    mamba2: Mamba2Config | None = None
    short_conv: ShortConvConfig | None = None
    mla: MLAConfig | None = None  # set: the attention layers are MLA (Kimi-Linear)
    kda: KDAConfig | None = None
    # The attention of sliding-window layers when it differs from `attention` (LFM3: other RoPE); None: same.
    window_attention: AttentionConfig | None = None
    post_norms: bool = False  # RMSNorms on the mixer's and the feed-forward's outputs as well (LFM3's sandwich)
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    max_position_embeddings: int | None = None
    # Per layer: the sliding window (tokens a query sees, itself included) of an attention layer, 0 for full
    # attention and for other layers; () when no layer has one. Window layers form the window cache group.
    attention_windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.layer_types) != len(self.mlp_types):
            raise ValueError("layer_types and mlp_types must have one entry per layer")
        for kind in self.layer_types:
            if kind not in LAYER_TYPES:
                raise ValueError(f"unknown layer type {kind!r}")
            if self.layer_config(kind) is None:
                raise ValueError(f"layer type {kind!r} used without its config")
        if self.attention_windows:
            if len(self.attention_windows) != len(self.layer_types):
                raise ValueError("attention_windows must have one entry per layer")
            for kind, w in zip(self.layer_types, self.attention_windows):
                if w < 0 or (w and kind != "attention"):
                    raise ValueError(f"a sliding window ({w}) needs an attention layer, not {kind!r}")
        for kind in self.mlp_types:
            if kind not in MLP_TYPES:
                raise ValueError(f"unknown mlp type {kind!r}")
            if {"none": True, "dense": self.mlp, "moe": self.moe}[kind] is None:
                raise ValueError(f"mlp type {kind!r} used without its config")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "attention")

    @property
    def ssm_layers(self) -> tuple[int, ...]:
        """The recurrent layers (every non-attention kind), whose states make up a state slot."""
        return tuple(i for i, t in enumerate(self.layer_types) if t != "attention")

    def window_of(self, layer: int) -> int:
        """The sliding window of attention layer `layer` (0: full attention)."""
        return self.attention_windows[layer] if self.attention_windows else 0

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        """Attention layers of the KV group (no window)."""
        return tuple(i for i in self.attention_layers if not self.window_of(i))

    @property
    def window_layers(self) -> tuple[int, ...]:
        """Sliding-window attention layers: the window group, with its own block pool."""
        return tuple(i for i in self.attention_layers if self.window_of(i))

    @property
    def sliding_window(self) -> int:
        """The widest window of the window group (0: no group); the core keeps that much for every layer."""
        return max((self.window_of(i) for i in self.window_layers), default=0)

    @property
    def has_attention(self) -> bool:
        return bool(self.attention_layers)

    @property
    def has_ssm(self) -> bool:
        return bool(self.ssm_layers)

    def layer_config(self, kind: str) -> object | None:
        """The config of a mixer kind (None when the model has none)."""
        return {
            "mamba1": self.mamba1, "mamba2": self.mamba2, "attention": self.attention or self.mla,
            "short_conv": self.short_conv, "kda": self.kda,
        }[kind]  # fmt: skip

    def attention_config(self, layer: int) -> AttentionConfig:
        """The attention settings of attention layer `layer` (window layers may have their own)."""
        cfg = self.window_attention if self.window_of(layer) and self.window_attention else self.attention
        if cfg is None:
            raise ValueError(f"layer {layer} has no attention config")
        return cfg

    def state_specs(self, layer: int) -> tuple[StateTensorSpec, ...]:
        """The named tensors one state slot holds for recurrent layer `layer` (declared by its kind's config)."""
        kind = self.layer_types[layer]
        cfg = self.layer_config(kind)
        if kind == "attention" or cfg is None or not hasattr(cfg, "state_specs"):
            raise ValueError(f"layer {layer} ({kind}) has no recurrent state")
        return check_specs(cfg.state_specs())

    def state_bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes of one state slot: every state tensor of every recurrent layer (conv windows in `dtype`)."""
        return sum(spec.nbytes(dtype) for i in self.ssm_layers for spec in self.state_specs(i))

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K + V for one token across every full-attention layer (the KV group)."""
        return sum(self._kv_bytes(i, dtype) for i in self.full_attention_layers)

    def window_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K + V for one token across every sliding-window layer (the window group)."""
        return sum(self._kv_bytes(i, dtype) for i in self.window_layers)

    def kv_specs(self, layer: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The paged tensors attention layer `layer` caches per token (K and V, or MLA's latent and rope key)."""
        return self.mla.kv_specs() if self.mla is not None else self.attention_config(layer).kv_specs()

    def _kv_bytes(self, layer: int, dtype: torch.dtype) -> int:
        return sum(math.prod(shape) for _, shape in self.kv_specs(layer)) * dtype.itemsize

    def flops_per_token(self) -> float:
        """Approximate prefill FLOPs per token: 2 x the weights every token multiplies (routed experts only)."""
        h, weights = self.hidden_size, 0
        for kind, mlp in zip(self.layer_types, self.mlp_types):
            if kind == "mamba1" and self.mamba1 is not None:
                m1 = self.mamba1
                weights += h * 2 * m1.d_inner + m1.d_inner * (m1.dt_rank + 2 * m1.d_state)
                weights += m1.dt_rank * m1.d_inner + m1.d_inner * h
            elif kind == "mamba2" and self.mamba2 is not None:
                weights += h * self.mamba2.in_proj_dim + self.mamba2.d_inner * h
            elif kind == "short_conv":
                weights += 4 * h * h  # in_proj (3h) + out_proj
            elif kind == "kda" and self.kda is not None:
                d, hd = self.kda.dim, self.kda.head_dim
                weights += 4 * h * d + 2 * (h * hd + hd * d) + h * self.kda.num_heads  # q k v o, f_a/b, g_a/b, b
            elif self.mla is not None:
                m = self.mla
                weights += h * m.num_heads * m.qk_head_dim + h * (m.kv_lora_rank + m.qk_rope_head_dim)
                weights += m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
                weights += m.num_heads * m.v_head_dim * h
            elif self.attention is not None:
                a = self.attention
                weights += h * (a.num_heads + 2 * a.num_kv_heads) * a.head_dim + a.num_heads * a.head_dim * h
            if mlp == "dense" and self.mlp is not None:
                weights += (3 if self.mlp.gated else 2) * h * self.mlp.intermediate_size
            elif mlp == "moe" and self.moe is not None:
                weights += self.moe.flops_weights(h)
        weights += h * self.vocab_size
        return 2.0 * weights


# The translators, re-exported so `recap.model.config` is the one place to get a ModelConfig from.
from recap.model.hf_config import (  # noqa: E402
    TRANSLATORS,
    architecture_of,
    load_config,
    read_hf_config,
    translate_config,
)

__all__ = [
    "TRANSLATORS",
    "AttentionConfig",
    "KDAConfig",
    "MLAConfig",
    "MLPConfig",
    "Mamba1Config",
    "Mamba2Config",
    "MoEConfig",
    "ModelConfig",
    "ShortConvConfig",
    "UnsupportedArchitectureError",
    "architecture_of",
    "load_config",
    "read_hf_config",
    "translate_config",
]
