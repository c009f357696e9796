"""A multi-token-prediction head, as vLLM runs them as drafters (Qwen3-Next / Qwen3.5 `mtp.*`, Nemotron-H
`mtp.layers.*`, DeepSeek-V3-style `model.layers.{N}.*`): a fusion of the target's final hidden state with the next
token's embedding, then one or more of the family's own decoder blocks, then a norm; it predicts the token after
next.

Row i of an MTP sequence pairs the target's final hidden state h_i (after its final norm: what the target's
lm_head reads) with the embedding of token x_{i+1}, at position i:
    u_i = fc(cat(pre_fc_norm_embedding(embed(x_{i+1})), pre_fc_norm_hidden(h_i)))
    o_i = norm(block_{B-1}(... block_0(u_i)))   (each block over the rows 0..i: attention, MLP / MoE)
and lm_head(o_i) predicts x_{i+2}. Further drafts chain: o_i stands in for h_{i+1}, the draft for x_{i+2}.
The parts keep Qwen's names (`fc`, `pre_fc_norm_*`, `layers.b`, `norm`); each family maps its checkpoint's names
onto them (CausalLM.mtp_weight_name): DeepSeek's `eh_proj`, `enorm`, `hnorm`, `shared_head.norm`, Nemotron-H's
`final_layernorm`. The embedding and lm_head are the target's. The blocks' K/V live in the drafter's own pool
(runner/mtp_drafter.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import PAD_SLOT_ID, ForwardBatch, SeqSpec
from recap.model.cache import ModelCaches
from recap.model.layers.linear import Linear
from recap.model.model_config import ModelConfig

if TYPE_CHECKING:
    from recap.model.models.base import CausalLM


class MTPHead(nn.Module):
    """`fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `layers` (the family's decoder blocks, built as the
    layers 0..B-1 of the head's own config: model/mtp_load.py) and `norm`."""

    def __init__(self, hidden_size: int, blocks: list[nn.Module], norm_cls: type[nn.Module], eps: float,
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        self.fc = Linear(2 * hidden_size, hidden_size, False, dtype)
        self.pre_fc_norm_embedding = norm_cls(hidden_size, eps, dtype)
        self.pre_fc_norm_hidden = norm_cls(hidden_size, eps, dtype)
        self.layers = nn.ModuleList(blocks)
        self.norm = norm_cls(hidden_size, eps, dtype)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                caches: ModelCaches) -> torch.Tensor:  # fmt: skip
        """embeds [T, D] (of x_{i+1}), hidden [T, D] (h_i) for the batch's rows -> o [T, D]; writes the blocks'
        K/V at the rows' positions."""
        u = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden.to(embeds.dtype))],
                              dim=-1))  # fmt: skip
        for b, block in enumerate(self.layers):
            u = block(u, batch, caches, b)
        return self.norm(u)


def _one_row(tokens: list[int], config: ModelConfig) -> tuple[ForwardBatch, ModelCaches]:
    blocks = -(-len(tokens) // 16)
    caches = ModelCaches.allocate(config, num_kv_blocks=blocks + 1, block_size=16, num_state_slots=1,
                                  dtype=torch.float32)  # fmt: skip
    row = SeqSpec(tokens, 0, list(range(1, blocks + 1)), 0 if config.ssm_layers else PAD_SLOT_ID, sample=False)
    return build_forward_batch([row], block_size=16, chunk_size=config.ssm_chunk_size,
                               with_attention=bool(config.attention_layers), with_ssm=bool(config.ssm_layers)), caches


@torch.inference_mode()
def reference_drafts(head: MTPHead, head_config: ModelConfig, target: CausalLM, tokens: list[int], k: int) -> list[int]:
    """The plain reference of the drafter (runner/mtp_drafter.py): k greedy drafts after `tokens` (N of them,
    committed), each from scratch in one row: the target's hidden states h_0..h_{N-2} over tokens[:N-1], then the
    head over rows 0..N-2 (x_1..x_{N-1}), then again with each draft appended (its hidden state the head's own
    output of the row before)."""
    batch, caches = _one_row(tokens[:-1], target.config)
    hidden = target(batch, caches)
    ids, drafts = list(tokens[1:]), []
    for _ in range(k):
        batch, caches = _one_row(ids, head_config)
        out = head(target.embed(batch.input_ids), hidden, batch, caches)
        drafts.append(int(torch.argmax(target.compute_logits(out[-1:]), dim=-1)))
        ids.append(drafts[-1])
        hidden = torch.cat([hidden, out[-1:].to(hidden.dtype)])
    return drafts
