"""Zamba2 (Zamba2ForCausalLM): Mamba2 layers, and at the "hybrid" layers a shared transformer block run
first on [h | the token embeddings] (2 x hidden wide), its output projected by the layer's own `linear`
and added to the Mamba2 layer's input. The block's weights are shared (block u % num_blocks for the u-th
hybrid layer); each use has its own LoRA adapters on q/k/v and on the MLP's gate_up (SharedBlocksConfig).

On disk a shared block is stored once, under the first hybrid layer that uses it
(`model.layers.{i}.shared_transformer.*`); later users store only `linear` and `mamba_decoder.*`.
The module tree follows that: the block is registered at its first user only, so the strict loader
compares exactly those keys. Adapter lists keep every use's index; uses of other blocks are Identity.
(transformers shares the blocks only when tie_word_embeddings is true; otherwise each use has its own
copy, on disk and here: SharedBlocksConfig.shared.)
"""

from __future__ import annotations

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layer_kinds import mixer_class
from recap.model.layers.attention import Attention
from recap.model.layers.linear import Linear
from recap.model.layers.mlp import MLP
from recap.model.layers.norm import RMSNorm
from recap.model.model_config import ModelConfig, SharedBlocksConfig
from recap.model.models.hybrid import HybridForCausalLM
from recap.model.models.residual_block import ResidualBlock, add_norm, settle


def _adapters(uses: list[bool], d_in: int, d_out: int, rank: int, dtype: torch.dtype) -> nn.ModuleList:
    """One low-rank adapter x -> B(A(x)) per use of the block (Identity for uses of other blocks)."""
    return nn.ModuleList(
        nn.Sequential(Linear(d_in, rank, False, dtype), Linear(rank, d_out, False, dtype)) if mine else nn.Identity()
        for mine in uses
    )


class SharedTransformer(nn.Module):
    """input_layernorm -> attention (+ q/k/v adapters) -> pre_ff_layernorm -> MLP (+ gate_up adapter); no residuals."""

    def __init__(self, config: ModelConfig, uses: list[bool], dtype: torch.dtype) -> None:
        super().__init__()
        sb, attn, mlp = config.shared_blocks, config.attention, config.mlp
        if sb is None or attn is None or mlp is None:
            raise ValueError("Zamba2 needs shared-block, attention and MLP configs")
        h, d_in = config.hidden_size, attn.input_size or 2 * config.hidden_size
        self.input_layernorm = RMSNorm(d_in, config.norm_eps, dtype)
        self.self_attn = Attention(h, attn, dtype)
        # each maps d_in -> d_in (as transformers builds them): no GQA with adapters
        if sb.attention_adapters and sb.adapter_rank:
            if not attn.num_heads * attn.head_dim == attn.num_kv_heads * attn.head_dim == d_in:
                raise ValueError("Zamba2's q/k/v adapters need num_key_value_heads == num_attention_heads")
            for name in ("linear_q_adapter_list", "linear_k_adapter_list", "linear_v_adapter_list"):
                setattr(self.self_attn, name, _adapters(uses, d_in, d_in, sb.adapter_rank, dtype))
        self.pre_ff_layernorm = RMSNorm(h, config.norm_eps, dtype)
        self.feed_forward = MLP(h, mlp, dtype)
        if sb.adapter_rank:  # Zamba2; Zamba (v1) has no adapters
            self.feed_forward.gate_up_proj_adapter_list = _adapters(uses, h, 2 * mlp.intermediate_size,
                                                                    sb.adapter_rank, dtype)  # fmt: skip
        self.attention_adapters, self.mlp_adapters = sb.attention_adapters and sb.adapter_rank > 0, sb.adapter_rank > 0

    def forward(self, x: torch.Tensor, use: int, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        x = self.input_layernorm(x)
        attn = self.self_attn
        q, k, v = attn.project(x)
        if self.attention_adapters:
            q = q + attn.linear_q_adapter_list[use](x)
            k = k + attn.linear_k_adapter_list[use](x)
            v = v + attn.linear_v_adapter_list[use](x)
        kv = attn.layer_cache(caches, layer)
        y = self.pre_ff_layernorm(attn.attend((q, k, v), batch, kv.k_cache, kv.v_cache))
        ff = self.feed_forward
        if not self.mlp_adapters:
            return ff(y)
        return ff.down(ff.gate_up(y) + ff.gate_up_proj_adapter_list[use](y))


class MambaLayer(ResidualBlock):
    """h + mamba(input_layernorm(h + extra)), `extra` being the shared block's projected output at hybrid layers.
    The mixer is the model's Mamba2 (Zamba2) or its multi-head Mamba1 (Zamba). The residual add it leaves pending
    feeds the next layer's norm; a hybrid layer's norm reads h + extra, not the stream, so it takes the add first."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        cfg = config.mamba2 or config.mamba1
        if cfg is None:
            raise ValueError("Zamba needs a Mamba2 or Mamba1 config")
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps, dtype)
        self.mamba = mixer_class(cfg)(config.hidden_size, cfg, dtype)

    def forward_residual(
        self, h: torch.Tensor, out: torch.Tensor | None, batch: ForwardBatch, caches: ModelCaches, layer: int,
        extra: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if extra is None:
            x, h = add_norm(self.input_layernorm, h, out)
        else:
            h = settle(h, out)
            x = self.input_layernorm(h + extra)
        return h, self.mamba(x, batch, caches, layer)


class HybridLayer(nn.Module):
    """shared block on [h | embeddings] -> linear -> added to the Mamba layer's input. `block_name`: the
    block's name on disk."""

    block_name = "shared_transformer"

    def __init__(self, config: ModelConfig, use: int, block: SharedTransformer, first_use: bool, dtype: torch.dtype):
        super().__init__()
        self.use = use
        if first_use:
            setattr(self, self.block_name, block)  # registered here only: its weights' one place on disk
        else:
            object.__setattr__(self, "_shared", block)  # a reference, not a submodule
        self.linear = Linear(config.hidden_size, config.hidden_size, False, dtype)
        self.mamba_decoder = MambaLayer(config, dtype)

    def block(self) -> SharedTransformer:
        return self._modules.get(self.block_name) or self._shared  # type: ignore[return-value]

    def forward_residual(
        self, h: torch.Tensor, out: torch.Tensor | None, emb: torch.Tensor, batch: ForwardBatch, caches: ModelCaches,
        layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(stream, pending output) as a ResidualBlock's; the shared block reads the stream with out added."""
        h = settle(h, out)
        t = self.block()(torch.cat((h, emb), dim=-1), self.use, batch, caches, layer)
        return self.mamba_decoder.forward_residual(h, None, batch, caches, layer, extra=self.linear(t))


def _shared_block(
    config: ModelConfig, sb: SharedBlocksConfig, b: int, uses: int, dtype: torch.dtype
) -> SharedTransformer:
    """Block b, with adapters for the uses u < `uses` where u % num_blocks == b."""
    return SharedTransformer(config, [u % sb.num_blocks == b for u in range(uses)], dtype)


class Zamba2ForCausalLM(HybridForCausalLM):
    """Also Zamba (v1)'s layout (models/zamba.py): its layer kinds and hybrid layer class are these attributes."""

    hybrid_kind, mamba_kind = "hybrid", "mamba2"
    hybrid_layer: type[HybridLayer] = HybridLayer

    def build_layers(self, config: ModelConfig, dtype: torch.dtype) -> list[nn.Module]:
        sb, n_uses = config.shared_blocks, config.layer_types.count(self.hybrid_kind)
        blocks = [_shared_block(config, sb, b, n_uses, dtype) for b in range(sb.num_blocks)] if sb is not None else []
        layers: list[nn.Module] = []
        for i, kind in enumerate(config.layer_types):
            if kind == self.hybrid_kind and sb is not None:
                use = config.layer_types[:i].count(self.hybrid_kind)
                if sb.shared:
                    block, first = blocks[use % sb.num_blocks], use < sb.num_blocks
                else:  # an unshared copy of the block this use would share
                    first = True
                    block = blocks[use] if use < sb.num_blocks else _shared_block(config, sb, use % sb.num_blocks,
                                                                                  n_uses, dtype)  # fmt: skip
                layers.append(self.hybrid_layer(config, use, block, first, dtype))
            elif kind == self.mamba_kind:
                layers.append(MambaLayer(config, dtype))
            else:
                raise ValueError(f"{type(self).__name__} layer {i}: unexpected layer type {kind!r}")
        return layers

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        emb = h = self.embed(batch.input_ids)  # the shared blocks read the embeddings at every use
        out: torch.Tensor | None = None  # the pending residual add (models/residual_block.py)
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer, HybridLayer):
                h, out = layer.forward_residual(h, out, emb, batch, caches, i)
            else:
                h, out = layer.forward_residual(h, out, batch, caches, i)
        return add_norm(self.final_norm(), h, out)[0]
