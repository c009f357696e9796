"""The token mixers' configs, and the one protocol they share (`MixerConfig`).

Each config says what its mixer caches (paged tensors per token for attention, named state tensors per slot
for the recurrent kinds: state_spec.py), how many weights one token multiplies (FLOPs) and which layer class
it configures, so that caches, byte accounting, FLOPs and model building never look at a layer's kind.
Which configs a layer of each normalized type needs is the table of layer_kinds.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from recap.model.state_spec import StateTensorSpec, conv_window_spec

# Mamba1 has no chunked algorithm; the runner still cuts rows on this grid (cheap and harmless).
DEFAULT_MAMBA1_CHUNK = 256
KVSpecs = tuple[tuple[str, tuple[int, ...]], ...]  # (name, per-token shape) of each paged tensor


class MixerConfig(ABC):
    """What every token mixer's config declares.

    `mixer`: "module:Class" of the layer it configures, built as `Class(hidden_size, cfg, dtype)` (an
    attention mixer also takes its layer's sliding window: `window=`), imported only when a model is built.
    """

    mixer: ClassVar[str]
    per_layer: ClassVar[bool] = False  # the mixer also takes its layer index (`layer=`): MiniMax's decay

    def kv_specs(self) -> KVSpecs:
        """What the layer caches per token in the paged KV pool (none for a recurrent mixer)."""
        return ()

    def state_specs(self) -> tuple[StateTensorSpec, ...]:
        """The named tensors one state slot holds for the layer (none for attention)."""
        return ()

    @abstractmethod
    def flops_weights(self, hidden: int) -> int:
        """Weights one token multiplies in the mixer (FLOPs per token / 2)."""


@dataclass(frozen=True)
class AttentionConfig(MixerConfig):
    mixer: ClassVar[str] = "recap.model.layers.attention:Attention"

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
    o_bias: bool | None = None  # o_proj's bias; None: as `bias` (RecurrentGemma: o_proj biased, q/k/v not)

    def kv_specs(self) -> KVSpecs:
        return ("k", (self.num_kv_heads, self.head_dim)), ("v", (self.num_kv_heads, self.head_dim))

    def flops_weights(self, hidden: int) -> int:
        d_in = self.input_size or hidden
        q_heads = self.num_heads * (2 if self.output_gate else 1)  # a gated q_proj also yields the gate
        weights = d_in * (q_heads + 2 * self.num_kv_heads) * self.head_dim + self.num_heads * self.head_dim * hidden
        return weights + (d_in * self.num_heads if self.head_gate else 0)


@dataclass(frozen=True)
class MLAConfig(MixerConfig):
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
    # RoPE on the rope dims of q and the shared key, DeepSeek's interleaved pairs (Ling 3.0); None: no rotation
    rope_theta: float | None = None
    head_gate: bool = False  # each head's output scaled by sigmoid(g_proj(x)), one scalar per head (Ling 3.0)
    mixer: ClassVar[str] = "recap.model.layers.mla:MLAttention"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def kv_specs(self) -> KVSpecs:
        return ("latent", (1, self.kv_lora_rank)), ("rope", (1, self.qk_rope_head_dim))

    def flops_weights(self, hidden: int) -> int:
        w = hidden * self.num_heads * self.qk_head_dim + hidden * (self.kv_lora_rank + self.qk_rope_head_dim)
        w += self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return w + self.num_heads * self.v_head_dim * hidden + (hidden * self.num_heads if self.head_gate else 0)


@dataclass(frozen=True)
class IndexedMLAConfig(MixerConfig):
    """MLA without positional encoding whose queries attend only the keys a DSA-style indexer selects
    (GLM-5.3-Flash's "indexed_attention"; kernels/indexed_mla.py).

    Per token the layer caches the latent c and, when it runs its own indexer (`indexer` "full"), the
    indexer's key and compression gate (index_head_dim each), in the same KV blocks: a prefix-cache hit
    restores the selection's inputs with the latents. A "shared" layer reuses the previous full layer's
    selection and caches only latents.
    """

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int
    index_heads: int
    index_head_dim: int
    index_topk: int  # tokens' budget of selected pools
    index_kpool: int  # tokens per pool
    index_tail: bool  # the query's own incomplete pool is always attended
    indexer: str = "full"  # "full" or "shared"
    bias: bool = False  # on q_a_proj, kv_a_proj_with_mqa and o_proj
    norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm
    mixer: ClassVar[str] = "recap.model.layers.indexed_mla:IndexedMLAttention"

    def __post_init__(self) -> None:
        if self.indexer not in ("full", "shared"):
            raise ValueError(f"indexer must be 'full' or 'shared', got {self.indexer!r}")

    def kv_specs(self) -> KVSpecs:
        latent: KVSpecs = (("latent", (1, self.kv_lora_rank)),)
        if self.indexer == "shared":
            return latent
        return (*latent, ("index_key", (1, self.index_head_dim)), ("index_gate", (1, self.index_head_dim)))

    def flops_weights(self, hidden: int) -> int:
        h, r = self.num_heads, self.kv_lora_rank
        w = hidden * self.q_lora_rank + self.q_lora_rank * h * self.qk_nope_head_dim + hidden * r
        w += r * h * (self.qk_nope_head_dim + self.v_head_dim) + h * self.v_head_dim * hidden
        if self.indexer == "full":  # wq_b, wk, weights_proj, the compression gate
            w += self.q_lora_rank * self.index_heads * self.index_head_dim
            w += hidden * (2 * self.index_head_dim + self.index_heads)
        return w


@dataclass(frozen=True)
class Mamba1Config(MixerConfig):
    mixer: ClassVar[str] = "recap.model.layers.mamba1:Mamba1Mixer"

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

    def flops_weights(self, hidden: int) -> int:
        i = self.d_inner  # in_proj, x_proj, dt_proj, out_proj
        return hidden * 2 * i + i * (self.dt_rank + 2 * self.d_state) + self.dt_rank * i + i * hidden


@dataclass(frozen=True)
class MultiHeadMamba1Config(Mamba1Config):
    """Zamba's Mamba1: d_inner split into `num_heads` heads of d_inner / num_heads channels, each with its own
    x_proj, dt_proj and so its own B_t, C_t; the conv and the state ([d_inner, d_state]) are Mamba1's."""

    mixer: ClassVar[str] = "recap.model.layers.mamba1_heads:MultiHeadMamba1Mixer"

    num_heads: int = 1

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.d_inner % self.num_heads:
            raise ValueError(f"d_inner {self.d_inner} must split into {self.num_heads} mamba heads")

    def flops_weights(self, hidden: int) -> int:
        i, r = self.d_inner, self.dt_rank  # in_proj, per-head x_proj and dt_proj (block-diagonal), out_proj
        return hidden * 2 * i + i * (r + 2 * self.d_state) + r * i + i * hidden


@dataclass(frozen=True)
class LightningConfig(MixerConfig):
    """MiniMax's lightning attention: linear attention with a constant decay per head and layer,
    S_t = lam S_{t-1} + k_t^T v_t, o_t = q_t S_t (q, k, v = silu(qkv_proj(x)) per head), then an RMSNorm over
    all heads, a sigmoid output gate and out_proj. lam = exp(-slope): slope = base^(h+1) * (1 - layer /
    (num_layers - 1 + 1e-5) + 1e-5), base = 2^(-8 / num_heads) (transformers' get_slope_rate).
    It is Mamba2's SSD exactly (dt = 1, A = -slope, B = k, C = q, x = v, one group per head, D = 0): the state
    is SSD's [H, P = head_dim (v), N = head_dim (k)], i.e. S transposed, written by the SSD kernels."""

    mixer: ClassVar[str] = "recap.model.layers.lightning:LightningAttention"
    per_layer: ClassVar[bool] = True

    num_heads: int
    head_dim: int
    num_layers: int
    norm_eps: float = 1e-6  # transformers' MiniMax builds this norm with its default eps
    activation: str = "silu"

    def slopes(self, layer: int) -> torch.Tensor:
        base = 1 / (2 ** (8 / self.num_heads))
        factor = 1 - layer / (self.num_layers - 1 + 1e-5) + 1e-5
        return base ** (torch.arange(self.num_heads, dtype=torch.float32) + 1) * factor

    def state_specs(self) -> tuple[StateTensorSpec, ...]:
        return (StateTensorSpec("ssm", (self.num_heads, self.head_dim, self.head_dim), torch.float32),)

    def flops_weights(self, hidden: int) -> int:
        inner = self.num_heads * self.head_dim  # qkv_proj, output_gate, out_proj
        return hidden * 3 * inner + hidden * inner + inner * hidden


GATE_NORMS = ("gated_rmsnorm", "rmsnorm_gate", "gate")


@dataclass(frozen=True)
class Mamba2Config(MixerConfig):
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
    mixer: ClassVar[str] = "recap.model.layers.mamba2:Mamba2Mixer"

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

    def flops_weights(self, hidden: int) -> int:
        return hidden * self.in_proj_dim + self.d_inner * hidden


GDN_PROJECTIONS = ("qwen3_next", "qwen3_5", "olmo_hybrid")


@dataclass(frozen=True)
class GatedDeltaNetConfig(MixerConfig):
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
    mixer: ClassVar[str] = "recap.model.layers.gdn:GatedDeltaNetMixer"

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
class ShortConvConfig(MixerConfig):
    """LFM2's gated short convolution: y = out_proj(C * conv(B * x)), [B | C | x] = in_proj(h); state = conv window."""

    dim: int  # channels (the hidden size)
    kernel: int  # conv taps (conv_L_cache)
    bias: bool = False  # on in_proj, the conv and out_proj
    mixer: ClassVar[str] = "recap.model.layers.short_conv:ShortConv"

    def state_specs(self) -> tuple[StateTensorSpec, ...]:
        return (conv_window_spec(self.dim, self.kernel),)

    def flops_weights(self, hidden: int) -> int:
        return hidden * 3 * self.dim + self.dim * hidden  # in_proj [B | C | x] + out_proj


KDA_LAYOUTS = ("kimi", "glm5", "bailing")


@dataclass(frozen=True)
class KDAConfig(MixerConfig):
    """Kimi Delta Attention: q, k, v through their own short convs (silu), a per-channel forget gate, a delta
    rule over a [head_dim, head_dim] matrix state per head, a gated RMSNorm on the output."""

    num_heads: int
    head_dim: int
    conv_kernel: int
    norm_eps: float = 1e-5
    # A_log on disk: "kimi" [1, 1, H, 1], "glm5" (GLM-5.3-Flash) [H]; "bailing" (Ling 3.0): A_log [H] and full-rank
    # f_proj / g_proj in place of the f_a/f_b and g_a/g_b pairs
    layout: str = "kimi"
    # None: g = -exp(A_log) softplus(f + dt_bias); else g = bound * sigmoid(exp(A_log) (f + dt_bias))
    gate_lower_bound: float | None = None
    mixer: ClassVar[str] = "recap.model.layers.kda:KDAMixer"

    def __post_init__(self) -> None:
        if self.layout not in KDA_LAYOUTS:
            raise ValueError(f"KDA layout must be one of {KDA_LAYOUTS}, got {self.layout!r}")

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim

    def state_specs(self) -> tuple[StateTensorSpec, ...]:
        convs = tuple(conv_window_spec(self.dim, self.conv_kernel, f"conv_{x}") for x in "qkv")
        return *convs, StateTensorSpec("recurrent", (self.num_heads, self.head_dim, self.head_dim), torch.float32)

    def flops_weights(self, hidden: int) -> int:
        d, hd = self.dim, self.head_dim
        gates = 2 * hidden * d if self.layout == "bailing" else 2 * (hidden * hd + hd * d)  # f and g projections
        return 4 * hidden * d + gates + hidden * self.num_heads  # q k v o, f, g, b


