"""`CausalLM`: the forward every family shares, over blocks built from `config.layer_types`.

A family file only lays out the modules under the names its checkpoints use (so that the strict
loader can compare `state_dict()` keys with the file) and says where the embedding, the blocks,
the final norm and the head live.
"""

from __future__ import annotations

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.capture import DecodeCapture, GraphUnsupportedError, capture_norm, capture_part
from recap.model.layers.embedding import Embedding
from recap.model.layers.linear import Linear, tied_linear
from recap.model.layers.mlp import MLP
from recap.model.layers.moe import SparseMoE
from recap.model.layers.norm import RMSNorm
from recap.model.model_config import ModelConfig
from recap.model.models.residual_block import ResidualBlock, add_norm, settle


def build_mlp(config: ModelConfig, layer: int, dtype: torch.dtype, **moe_names: str) -> nn.Module | None:
    """The feed-forward of layer `layer` (None if it has none); `moe_names` name the MoE's parts as on disk."""
    kind = config.mlp_types[layer]
    if kind == "moe" and config.moe is not None:
        return SparseMoE(config.hidden_size, config.moe, dtype, **moe_names)
    if kind == "dense" and config.mlp is not None:
        return MLP(config.hidden_size, config.mlp, dtype)
    return None


class CausalLM(nn.Module):
    """Decoder-only LM over a packed batch: `forward` -> final hidden [T, D]; `compute_logits` -> [N, V].

    The model holds no execution strategy: the runner's backend (recap/backends/) picks the linear layers'
    implementation, switches the native kernels, places the weights and replays decode steps, through the
    parts' public switches and `capture_decode` (model/capture.py)."""

    # Checkpoint key prefixes this model deliberately does not load (a vision tower, an MTP head): the loader
    # skips, counts and logs them instead of refusing them as unexpected.
    ignored_checkpoint_prefixes: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype

    # Where the parts live (a family's layout decides).
    def embedding(self) -> Embedding:
        raise NotImplementedError

    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    def final_norm(self) -> RMSNorm:
        raise NotImplementedError

    def head(self) -> Linear:
        """The output projection: `lm_head`, or a view of the embedding when tied."""
        if self.config.tie_word_embeddings:
            if getattr(self, "_tied_head", None) is None:
                # Not registered as a submodule: the tied weight has one key on disk (the embedding's).
                object.__setattr__(self, "_tied_head", tied_linear(self.embedding().weight))
            return self._tied_head
        return self.lm_head

    def build_layers(self, config: ModelConfig, dtype: torch.dtype) -> list[nn.Module]:
        """The family's blocks for every layer of `config` (also the blocks of an MTP head: model/mtp_load.py)."""
        raise NotImplementedError

    def mtp_weight_name(self, key: str) -> str | None:
        """The MTP head parameter (model/layers/mtp.py's names) that checkpoint key `key` holds, for speculative
        method "mtp"; None: not a head weight. The family's layout decides; by default it has no head."""
        return None

    @staticmethod
    def rename_checkpoint_key(key: str) -> str | None:
        """Map a legacy on-disk key to this layout's key (identity by default); None: a weight the family
        knowingly does not use (named in its model file), skipped rather than refused."""
        return key

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Run every layer over the packed tokens; updates KV/state caches as the metadata says. A ResidualBlock
        leaves its last residual add to the next block's input norm or the final norm (models/residual_block.py)."""
        h, out = self.embed(batch.input_ids), None
        for i, block in enumerate(self.blocks()):
            if isinstance(block, ResidualBlock):
                h, out = block.forward_residual(h, out, batch, caches, i)
            else:
                h, out = block(settle(h, out), batch, caches, i), None
        return add_norm(self.final_norm(), h, out)[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embedding()(ids)
        m = self.config.embedding_multiplier
        return h if m == 1.0 else h * m

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] (rows of `forward`'s output) -> logits [N, V] in fp32 (times `logits_multiplier`, then
        soft-capped if the config says so)."""
        logits = self.head()(hidden.to(self.dtype)).float()
        if logits.shape[-1] > self.config.vocab_size:  # a head padded past the vocabulary (padded_vocab_size)
            logits = logits[:, : self.config.vocab_size]
        m, cap = self.config.logits_multiplier, self.config.logits_soft_cap
        if m != 1.0:
            logits.mul_(m)
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> each row's argmax token [N] (int64, on hidden's device): what a greedy row samples when
        nothing else is asked of its logits. It reads nothing on the host, so a decode graph can capture it."""
        return torch.argmax(self.compute_logits(hidden), dim=-1)

    def capture_decode(self, builder: DecodeCapture, caches: ModelCaches) -> torch.Tensor:
        """Record `forward`'s decode step (embed -> blocks -> final norm) on `builder` over `caches`
        (model/capture.py) -> the final hidden buffer [rows, D]. GraphUnsupportedError names the first part it
        cannot record: a family that overrides forward or embed, activations other than fp32. The embedding
        multiplier is recorded as the scale of the looked-up rows (the logits multiplier is compute_logits')."""
        cls = type(self)
        if cls.forward is not CausalLM.forward or cls.embed is not CausalLM.embed:
            raise GraphUnsupportedError(f"{cls.__name__} overrides forward or embed")
        if self.dtype != torch.float32:
            raise GraphUnsupportedError("activations other than fp32")
        embedding = self.embedding()
        if not hasattr(embedding, "capture_decode"):
            raise GraphUnsupportedError(f"embedding {type(embedding).__name__}")
        h = embedding.capture_decode(builder)
        if self.config.embedding_multiplier != 1.0:
            builder.scale(h, self.config.embedding_multiplier)
        for i, block in enumerate(self.blocks()):
            capture_part(block, f"layer {i}: block", builder, h, caches, i)
        return capture_norm(self.final_norm(), builder, h)
