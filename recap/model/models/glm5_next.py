"""GLM-5.3-Flash (`Glm5NextForConditionalGeneration`), loaded text-only: KDA and indexed (DSA-style sparse)
MLA layers, hyper-connections around every block, a dense MLP or an MoE with a shared expert.

Each token carries N residual streams (N copies of its embedding at first). Layer i:
    post, comb, x = attn_hc(S);  S = post (x) self_attn(input_layernorm(x)) + comb^T S
    post, comb, x = ffn_hc(S);   S = post (x) mlp(post_attention_layernorm(x)) + comb^T S
then norm(mean of the streams). A "shared" indexed layer attends with the selection of the layer just before
it (transformers passes it only from a full indexed layer to the next layer).
Layout: `model.language_model.{embed_tokens, layers.i.{self_attn, mlp, input_layernorm,
post_attention_layernorm, hc_attn_{fn,base,scale}, hc_ffn_{fn,base,scale}}, norm}` + `lm_head`; the vision
tower (`model.visual.*`) and the multi-token-prediction layer after the last one are skipped.
Not a ResidualBlock (models/residual_block.py): the norms read a mix of N hyper-connection streams, not one sum.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from recap.kernels.indexed_mla import Selections
from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layer_kinds import build_mixer
from recap.model.layers.hyper_connection import HyperConnection, hyper_head, hyper_streams
from recap.model.layers.indexed_mla import IndexedMLAttention
from recap.model.layers.norm import RMSNorm
from recap.model.model_config import ModelConfig
from recap.model.models.base import build_mlp
from recap.model.models.hybrid import HybridForCausalLM

NOT_LANGUAGE_MODEL = ("model.visual.",)
_HC = re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class Glm5NextBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        hc = config.hyper_connections
        if hc is None:
            raise ValueError("GLM-5.3-Flash blocks need hyper_connections")
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps, dtype)
        self.self_attn = build_mixer(config, layer, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps, dtype)
        ff = build_mlp(config, layer, dtype, router_name="gate", shared_name="shared_experts")
        if ff is None:
            raise ValueError(f"layer {layer}: GLM-5.3-Flash blocks always have a feed-forward")
        self.mlp = ff
        for name in ("attn_hc", "ffn_hc"):
            setattr(self, name, HyperConnection(config.hidden_size, hc.streams, hc.sinkhorn_iters, hc.eps,
                                                config.norm_eps, dtype))  # fmt: skip

    def forward(self, streams: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int,
                previous: Selections | None) -> tuple[torch.Tensor, Selections | None]:  # fmt: skip
        """streams [T, N, D] -> (new streams, this layer's selections if it is an indexed layer)."""
        post, comb, x = self.attn_hc.collapse(streams)
        x = self.input_layernorm(x)
        selections = None
        if isinstance(self.self_attn, IndexedMLAttention):
            shared = previous if self.self_attn.indexer is None else None
            out, selections = self.self_attn.attend(x, batch, caches, layer, shared)
        else:
            out = self.self_attn(x, batch, caches, layer)
        streams = HyperConnection.expand(out, post, comb, streams)
        post, comb, x = self.ffn_hc.collapse(streams)
        out = self.mlp(self.post_attention_layernorm(x))
        return HyperConnection.expand(out, post, comb, streams), selections


class Glm5NextForConditionalGeneration(HybridForCausalLM):
    block_class = Glm5NextBlock
    final_norm_name = "norm"
    ignored_checkpoint_prefixes = NOT_LANGUAGE_MODEL

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        hc = self.config.hyper_connections
        assert hc is not None
        streams = hyper_streams(self.embed(batch.input_ids), hc.streams)
        selections: Selections | None = None
        for i, block in enumerate(self.blocks()):
            streams, selections = block(streams, batch, caches, i, selections)
        return self.final_norm()(hyper_head(streams))

    def rename_checkpoint_key(self, key: str) -> str | None:  # type: ignore[override]
        if key.startswith("model.language_model."):
            key = "model." + key.removeprefix("model.language_model.")
        layer = _LAYER.match(key)
        if ".shared_head." in key or (layer is not None and int(layer.group(1)) >= self.config.num_layers):
            return None  # the MTP layer the hub stores after the last one (transformers skips it as well)
        return _HC.sub(lambda m: f".{m.group(1)}_hc.{m.group(2)}", key)
