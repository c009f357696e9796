"""A speculative verify step captured as a decode graph over its tokens (docs/speculative.md).

A verify row [decode token, d1..dk] is a tiny prefill; on the module path it cost ~3 plain decode steps on the
CPU, almost all of it Python around the kernels. Its arithmetic is a decode step's with every token as a row:
- embedding, norms, linear layers, MLPs: row-wise, so the decode graph's calls over T token rows;
- attention: the K/V of all T tokens is written first, then token j of a row attends as a decode row of its
  own with sequence length position_j + 1 over its row's block table: causal inside the row;
- Mamba2: the native step over the tokens in order, token j reading the state token j - 1 wrote and writing
  its own into the slot the runner asked for (recap_mamba2_chain): the per-position state writes rollback needs
  (DESIGN invariant 9) cost no copy, and the running slot ends after the row's last token.
- LFM2's short conv: likewise, token j's window read from the slot token j - 1 wrote (recap_short_conv_step);
- Gated DeltaNet (Qwen3.5): likewise, token j's conv window and matrix state read from the slot token j - 1 wrote
  (recap_gdn_step with destination slots: rows in order, each head's tokens in order).
So a VerifyGraph is a DecodeGraph of T rows whose recurrent calls take a source and a destination slot per token,
replayed with per-token block tables, sequence lengths and slots built from the step's metadata
(`token_inputs`). The module path stays the reference (tests/backends/test_verify_graph.py compares them on
random verify steps).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from recap.backends.decode_graph import CapturableModel, DecodeGraph
from recap.kernels.gdn_step import GdnStep
from recap.kernels.mamba2_step import Mamba2Step
from recap.kernels.metadata import PAD_SLOT_ID, ForwardBatch, SSMMetadata
from recap.model.cache import ModelCaches

# The most tokens of a verify step captured: batch 1 up to k = 15, or a few drafting rows (a graph per count,
# captured when a step of that many tokens first turns up).
MAX_VERIFY_TOKENS = 16


def chain_slots(ssm: SSMMetadata) -> tuple[list[int], list[int]]:
    """Per token of the step: the slot its recurrent step reads and the one it writes. Inside a row token j
    reads what token j - 1 wrote; a token ending a chunk with a checkpoint slot (a verify row's position
    writes, a block boundary) writes there, any other token into the row's running slot, so the running slot
    holds the state after the row's last token. A checkpoint at a row's last token is copied after the step."""
    qsl, cu = ssm.query_start_loc_list, ssm.cu_chunk_seqlens_list
    inner: dict[int, int] = {}  # token -> checkpoint slot, for chunk ends before their row's end
    for c, dest in enumerate(ssm.chunk_dest_slots_list):
        end = cu[c + 1]
        if dest != PAD_SLOT_ID and end != qsl[ssm.chunk_seq_idx_list[c] + 1]:
            inner[end - 1] = dest
    src: list[int] = []
    dst: list[int] = []
    for row, running in enumerate(ssm.state_indices_list):
        prev = running
        for t in range(qsl[row], qsl[row + 1]):
            d = inner.get(t, running)
            src.append(prev)
            dst.append(d)
            prev = d
    return src, dst


@dataclass
class TokenInputs:
    """A verify step's per-token inputs to the graph ([T] each; tables [T, max_blocks])."""

    src: torch.Tensor | None
    dst: torch.Tensor | None
    tables: torch.Tensor | None
    seq_lens: torch.Tensor | None


def token_inputs(batch: ForwardBatch) -> TokenInputs:
    src = dst = tables = seq_lens = None
    if batch.ssm is not None:
        s, d = chain_slots(batch.ssm)
        src, dst = torch.tensor(s, dtype=torch.int64, device="cpu"), torch.tensor(d, dtype=torch.int64, device="cpu")
    attn = batch.attn
    if attn is not None:
        counts = torch.diff(batch.query_start_loc)
        tables = torch.repeat_interleave(attn.block_tables, counts, dim=0).contiguous()
        seq_lens = batch.positions + 1  # token j of a row sees its row up to itself
    return TokenInputs(src, dst, tables, seq_lens)


class VerifyGraph(DecodeGraph):
    """A verify step of `rows` tokens over one cache set, captured (see the module docstring)."""

    max_rows = MAX_VERIFY_TOKENS

    def __init__(self, model: CapturableModel, caches: ModelCaches, rows: int) -> None:
        self._dst = ctypes.c_void_p()  # the per-token destination slots (the source ones: DecodeGraph's slots)
        super().__init__(model, caches, rows)

    def mamba2_step(
        self, step: Mamba2Step, proj: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, slot_positions: torch.Tensor
    ) -> torch.Tensor:
        fn, args, y = step.graph_call(proj, self._slot, self._pos, slot_positions, conv, ssm, self.threads, self._dst)
        self._keep.append(y)
        self.record((fn, args, None))
        self.has_state = True
        return y

    def short_conv(
        self, proj: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
        slot_positions: torch.Tensor, dst: ctypes.c_void_p | None = None,
    ) -> torch.Tensor:  # fmt: skip
        return super().short_conv(proj, weight, bias, state, slot_positions, self._dst)  # token j continues j - 1

    def gdn_step(
        self, step: GdnStep, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
        conv: torch.Tensor, state: torch.Tensor, slot_positions: torch.Tensor, dst: ctypes.c_void_p | None = None,
    ) -> torch.Tensor:  # fmt: skip
        return super().gdn_step(step, qkv, z, b, a, conv, state, slot_positions, self._dst)  # token j continues j - 1

    def takes(self, batch: ForwardBatch) -> bool:
        """Whether this graph replays the step: `rows` tokens, each row its decode token and its drafts (no
        prefill chunk), every row continuing its slot, no padding row, no sliding-window paging."""
        if batch.num_tokens != self.rows or batch.num_draft_tokens == 0:
            return False
        if batch.num_tokens != batch.num_seqs + batch.num_draft_tokens or batch.window_attn is not None:
            return False
        ssm = batch.ssm
        if self.has_state and (ssm is None or not all(ssm.has_initial_state_list)
                               or PAD_SLOT_ID in ssm.state_indices_list):  # fmt: skip
            return False
        attn = batch.attn
        return not self.has_attention or (attn is not None and not any(attn.is_padding))

    def run(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """The step's final hidden states [T, D] (a new tensor); `caches` updated as the module path does: the
        running slots after each row's last token, every planned state write in its slot."""
        assert caches is self._caches(), "a verify graph runs over the cache set it was captured over"
        inputs = token_inputs(batch)
        if self.has_state:
            assert inputs.dst is not None
            self._dst.value = inputs.dst.data_ptr()
        self.replay(batch, inputs.src, inputs.tables, inputs.seq_lens)
        if batch.planned_checkpoints:
            assert batch.ssm is not None
            qsl = batch.ssm.query_start_loc_list
            for row, position, slot in batch.planned_checkpoints:
                if position == _row_end(batch, row, qsl):
                    caches.copy_state(batch.ssm.state_indices_list[row], slot)  # a row-end checkpoint
                written = int(caches.slot_positions[slot])
                assert written == position, f"state slot {slot} holds position {written}, planned {position}"
        return self.hidden.clone()


def _row_end(batch: ForwardBatch, row: int, qsl: list[int]) -> int:
    """The position after a row's last token (tokens folded in once the row is done)."""
    return int(batch.positions[qsl[row + 1] - 1]) + 1
