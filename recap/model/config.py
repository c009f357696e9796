"""HF `config.json` -> frozen `ModelConfig`, the only config the layers ever read.

One translator per architecture turns the HF dict into normalized per-layer lists:
- `layer_types[i]`: the token mixer of layer i and so its caches:
    "mamba1" | "mamba2" | "gdn" (Gated DeltaNet) | "short_conv" | "kda" (Kimi Delta Attention) (a state slot
    part), "attention" (KV: softmax attention, or MLA when `ModelConfig.mla` is set), "none" (no
    mixer: an MLP/MoE-only layer, Nemotron-H), "hybrid" (attention AND a Mamba2 state in one layer: Falcon-H1's parallel
    mixers, Zamba2's shared-transformer layers; the family's model file says how they combine)
- `mlp_types[i]`:   "none" | "dense" | "moe" (the feed-forward of the layer, if any)
Multipliers (muP and friends) are explicit fields, 1.0 when a family has none.
The translators live in `translators/` (re-exported here); adding a family = one translator there +
one short model file in `recap/model/models/`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from recap.model.state_spec import StateTensorSpec, check_specs, conv_window_spec

LAYER_TYPES = ("mamba1", "mamba2", "attention", "gdn", "none", "hybrid", "short_conv", "kda")
ATTENTION_LAYER_TYPES = ("attention", "hybrid")  # layers with a KV cache
# Layers with a part of the state slot: the recurrent kinds ("hybrid" = attention and Mamba2 side by side).
SSM_LAYER_TYPES = ("mamba1", "mamba2", "gdn", "hybrid", "short_conv", "kda")
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
    rope_theta: float | None  # None: no positional encoding in the layer (Jamba, Nemotron-H, Granite NoPE)
    rotary_dim: int  # leading dims of each head that are rotated (head_dim * partial factor); 0 if no rope
    bias: bool = False
    scale: float | None = None  # softmax scale; None: head_dim ** -0.5 (Granite: attention_multiplier)
    input_size: int | None = None  # q/k/v input width; None: hidden_size (Zamba2: 2 * hidden_size)
    input_multiplier: float = 1.0  # x * m before q/k/v (Falcon-H1 attention_in_multiplier)
    output_multiplier: float = 1.0  # o_proj(.) * m (Falcon-H1 attention_out_multiplier)

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else self.scale
    # RMSNorm of q and k before RoPE: "none", "head" (over each head's dims: Qwen3.5 / Qwen3-Next), "all" (over
    # all heads' dims at once: OLMo-Hybrid). output_gate: q_proj also yields a per-head gate g (its second half
    # per head) and the output is o * sigmoid(g) (Qwen3.5 / Qwen3-Next gated attention).
    qk_norm: str = "none"
    output_gate: bool = False
    qk_norm_eps: float = 1e-6  # Attention's "head" norms (LFM); GatedAttention takes its family's eps
    head_gate: bool = False  # each head's output scaled by sigmoid(g_proj(x)), one scalar per head (LFM3)
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

    def flops_weights(self, hidden: int) -> int:
        w = hidden * self.num_heads * self.qk_head_dim + hidden * (self.kv_lora_rank + self.qk_rope_head_dim)
        w += self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return w + self.num_heads * self.v_head_dim * hidden


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


GATE_NORMS = ("gated_rmsnorm", "rmsnorm_gate", "gate")


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
    # How y meets the gate z before out_proj: "gated_rmsnorm" norm(y * silu(z)) (Mamba2 and most hybrids),
    # "rmsnorm_gate" norm(y) * silu(z) (Falcon-H1 mamba_norm_before_gate), "gate" y * silu(z) (no norm weight)
    gate_norm: str = "gated_rmsnorm"
    input_multiplier: float = 1.0  # x * m before in_proj (Falcon-H1 ssm_in_multiplier)
    # in_proj output parts [z | x | B | C | dt] scaled by these (Falcon-H1 ssm_multipliers, its "mup vector")
    in_proj_multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    output_multiplier: float = 1.0  # out_proj(.) * m (Falcon-H1 ssm_out_multiplier)
    out_proj_bias: bool | None = None  # None: as proj_bias (Falcon-H1 sets it apart: projectors_bias)

    def __post_init__(self) -> None:
        if self.gate_norm not in GATE_NORMS:
            raise ValueError(f"unknown gate_norm {self.gate_norm!r}; choose one of {GATE_NORMS}")
        if len(self.in_proj_multipliers) != 5:
            raise ValueError("in_proj_multipliers needs 5 values: z, x, B, C, dt")

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


GDN_PROJECTIONS = ("qwen3_next", "qwen3_5", "olmo_hybrid")


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """A Gated DeltaNet mixer (glossary: recap/kernels/gdn.py). `projection` names the on-disk input layout:
    "qwen3_next" fused in_proj_qkvz / in_proj_ba grouped per key head; "qwen3_5" in_proj_qkv / _z / _b / _a;
    "olmo_hybrid" separate q/k/v/a/b/g projections (and o_proj, o_norm)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    norm_eps: float  # the per-head gated RMSNorm before the output projection
    projection: str
    activation: str = "silu"
    beta_scale: float = 1.0  # OLMo-Hybrid's allow_neg_eigval: beta in (0, 2)

    def __post_init__(self) -> None:
        if self.projection not in GDN_PROJECTIONS:
            raise ValueError(f"unknown GDN projection {self.projection!r}; choose one of {GDN_PROJECTIONS}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"{self.num_v_heads} value heads are not a multiple of {self.num_k_heads} key heads")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim  # the conv runs over [q | k | v]

    def state_specs(self) -> tuple[StateTensorSpec, ...]:
        matrix = StateTensorSpec("recurrent", (self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32)
        return conv_window_spec(self.conv_dim, self.conv_kernel), matrix

    def flops_weights(self, hidden: int) -> int:
        return hidden * (self.conv_dim + self.value_dim + 2 * self.num_v_heads) + self.value_dim * hidden


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

    def flops_weights(self, hidden: int) -> int:
        d, hd = self.dim, self.head_dim
        return 4 * hidden * d + 2 * (hidden * hd + hd * d) + hidden * self.num_heads  # q k v o, f_a/b, g_a/b, b


@dataclass(frozen=True)
class SharedBlocksConfig:
    """Transformer blocks whose weights several layers share, each use with its own low-rank adapters (Zamba2).

    The u-th "hybrid" layer (in layer order) runs block u % num_blocks; adapters are indexed by u.
    """

    num_blocks: int
    adapter_rank: int
    attention_adapters: bool  # q/k/v adapters too (use_shared_attention_adapter); the MLP always has gate_up ones
    # transformers ties the shared copies only along with the word embeddings: with tie_word_embeddings
    # false every use keeps its own copy of its block (and the checkpoint stores each), so this is False then.
    shared: bool = True


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
    embedding_multiplier: float = 1.0  # embeddings * m (Granite, Falcon-H1)
    residual_multiplier: float = 1.0  # h + branch * m (Granite)
    logits_multiplier: float = 1.0  # lm_head(h) * m (Granite: 1 / logits_scaling; Falcon-H1 lm_head_multiplier)
    attention: AttentionConfig | None = None
    # Per-layer attention settings, one entry per layer (None: `attention`); entries may differ from
    # `attention` in anything but the KV shape (LFM3's sliding-window layers: their own RoPE).
    layer_attention: tuple[AttentionConfig | None, ...] = ()
    mlp: MLPConfig | None = None
    moe: MoEConfig | None = None
    mamba1: Mamba1Config | None = None
    mamba2: Mamba2Config | None = None
    gdn: GatedDeltaNetConfig | None = None
    short_conv: ShortConvConfig | None = None
    mla: MLAConfig | None = None  # set: the attention layers are MLA (Kimi-Linear)
    kda: KDAConfig | None = None
    shared_blocks: SharedBlocksConfig | None = None
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
            needs = {"mamba1": (self.mamba1,), "mamba2": (self.mamba2,), "attention": (self.attention or self.mla,),
                     "gdn": (self.gdn,), "none": (), "hybrid": (self.attention, self.mamba2),
                     "short_conv": (self.short_conv,), "kda": (self.kda,)}[kind]  # fmt: skip
            if any(c is None for c in needs):
                raise ValueError(f"layer type {kind!r} used without its config")
        if self.mla is not None and (self.attention is not None or self.layer_attention or self.attention_windows):
            raise ValueError("MLA attention layers take no AttentionConfig, layer_attention or sliding windows")
        self._check_layer_attention()
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

    def _check_layer_attention(self) -> None:
        if not self.layer_attention:
            return
        if len(self.layer_attention) != self.num_layers:
            raise ValueError("layer_attention needs one entry per layer")
        for i, a in enumerate(self.layer_attention):
            if a is None:
                continue
            if i not in self.attention_layers or self.attention is None:
                raise ValueError(f"layer_attention[{i}] set on a layer without attention")
            if (a.num_kv_heads, a.head_dim) != (self.attention.num_kv_heads, self.attention.head_dim):
                raise ValueError(f"layer_attention[{i}]: KV heads and head_dim must match `attention` (one KV shape)")

    def attention_for(self, layer: int) -> AttentionConfig:
        """The attention settings of layer `layer` (its own entry of `layer_attention`, else `attention`)."""
        own = self.layer_attention[layer] if self.layer_attention else None
        cfg = own or self.attention
        if cfg is None or layer not in self.attention_layers:
            raise ValueError(f"layer {layer} ({self.layer_types[layer]}) has no attention")
        return cfg

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t in ATTENTION_LAYER_TYPES)

    @property
    def ssm_layers(self) -> tuple[int, ...]:
        """The recurrent layers, whose states make up a state slot."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in SSM_LAYER_TYPES)

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
        """The config of the mixer kind that owns a layer's recurrent state (None when the model has none)."""
        return {
            "mamba1": self.mamba1, "mamba2": self.mamba2, "hybrid": self.mamba2, "gdn": self.gdn,
            "short_conv": self.short_conv, "kda": self.kda,
        }.get(kind)  # fmt: skip

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
        """The paged tensors attention layer `layer` caches per token (its own K and V, or MLA's latent and
        rope key)."""
        if self.mla is not None:
            if layer not in self.attention_layers:
                raise ValueError(f"layer {layer} ({self.layer_types[layer]}) has no attention")
            return self.mla.kv_specs()
        return self.attention_for(layer).kv_specs()

    def _kv_bytes(self, layer: int, dtype: torch.dtype) -> int:
        return sum(math.prod(shape) for _, shape in self.kv_specs(layer)) * dtype.itemsize

    def flops_per_token(self) -> float:
        """Approximate prefill FLOPs per token: 2 x the weights every token multiplies (routed experts only)."""
        h, weights = self.hidden_size, 0
        for i, (kind, mlp) in enumerate(zip(self.layer_types, self.mlp_types)):
            if kind == "mamba1" and self.mamba1 is not None:
                m1 = self.mamba1
                weights += h * 2 * m1.d_inner + m1.d_inner * (m1.dt_rank + 2 * m1.d_state)
                weights += m1.dt_rank * m1.d_inner + m1.d_inner * h
            if kind in ("mamba2", "hybrid") and self.mamba2 is not None:
                weights += h * self.mamba2.in_proj_dim + self.mamba2.d_inner * h
            if kind == "gdn" and self.gdn is not None:
                weights += self.gdn.flops_weights(h)
            if kind == "short_conv":
                weights += 4 * h * h  # in_proj (3h) + out_proj
            if kind == "kda" and self.kda is not None:
                weights += self.kda.flops_weights(h)
            if kind in ATTENTION_LAYER_TYPES and self.mla is not None:
                weights += self.mla.flops_weights(h)
            elif kind in ATTENTION_LAYER_TYPES:
                a = self.attention_for(i)
                d_in = a.input_size or h
                q_heads = a.num_heads * (2 if a.output_gate else 1)  # a gated q_proj also yields the gate
                weights += d_in * (q_heads + 2 * a.num_kv_heads) * a.head_dim + a.num_heads * a.head_dim * h
                weights += d_in * a.num_heads if a.head_gate else 0
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
    "MLPConfig",
    "Mamba1Config",
    "Mamba2Config",
    "GatedDeltaNetConfig",
    "KDAConfig",
    "MLAConfig",
    "MoEConfig",
    "ModelConfig",
    "SharedBlocksConfig",
    "ShortConvConfig",
    "UnsupportedArchitectureError",
    "architecture_of",
    "load_config",
    "read_hf_config",
    "translate_config",
]
