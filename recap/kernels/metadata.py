"""Per-step metadata handed to every layer: the packed batch, KV paging, state slots and SSM chunks.

Glossary
- T: tokens in the packed batch; B: sequences (rows); C: SSM chunks; S: state slots.
- context_len: tokens of a row already computed (in the KV cache / folded into its state).
- chunk: a run of one row's tokens that the SSM kernels process as a unit. Rows are cut at
  absolute multiples of `chunk_size` (so the first chunk completes the current chunk-grid cell and
  chunked prefill matches one-shot prefill) and at every requested checkpoint position, so that the
  state at each checkpoint is the state at some chunk end (DESIGN invariant 3). kernels/tiling.py
  makes these cuts and the kernels' own finer ones.
- PAD_SLOT_ID (-1): a padding row's state slot and a padding token's KV slot; kernels skip it.

The dataclasses only: kernels/batch.py packs rows into a ForwardBatch (the kernel modules import this module,
the builder imports the kernel set).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.tiling import Chunks, SegmentPlan, plan_segments

T = TypeVar("T")

if TYPE_CHECKING:
    from recap.kernels.kernel_set import KernelSet


@dataclass(frozen=True)
class SeqSpec:
    """One row of a step, in plain integers."""

    token_ids: Sequence[int]
    context_len: int = 0
    block_ids: Sequence[int] = ()
    state_slot: int = PAD_SLOT_ID
    # (absolute position p, destination slot): write the state after exactly p tokens.
    checkpoints: Sequence[tuple[int, int]] = ()
    sample: bool = True
    padding: bool = False  # a padding row: no KV slots, no state slot, never sampled
    # The window group's table (sliding-window layers; out-of-window entries are the null block 0).
    # None: the same table as block_ids (one-sequence helpers whose pools mirror each other).
    window_block_ids: Sequence[int] | None = None


class KVWrite(NamedTuple):
    """Where a fused q/k preparation also stores the new keys and values (the kernel set's `rope_qk`): v [T, Hkv, Dh],
    the layer's caches [NB, block_size, Hkv, Dh] and the step's slot_mapping [T] (PAD_SLOT_ID rows store nothing).
    The attention op is then told not to write them again (`kv_written`)."""

    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor


@dataclass
class AttentionMetadata:
    block_size: int
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset; PAD_SLOT_ID for padding
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with PAD_SLOT_ID
    context_lens: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, context + new tokens
    query_start_loc: torch.Tensor  # [B+1] int64
    # The same as Python lists, for per-row loops in reference kernels.
    context_lens_list: list[int]
    seq_lens_list: list[int]
    query_start_loc_list: list[int]
    is_padding: list[bool]
    is_decode: bool  # every row has exactly one new token


@dataclass
class SSMMetadata:
    chunk_size: int
    state_indices: torch.Tensor  # [B] int64 running slot per row; PAD_SLOT_ID for padding rows
    has_initial_state: torch.Tensor  # [B] bool: context_len > 0 (read the running slot first)
    query_start_loc: torch.Tensor  # [B+1] int64
    cu_chunk_seqlens: torch.Tensor  # [C+1] int64, token offsets of chunk starts in the packed batch
    chunk_seq_idx: torch.Tensor  # [C] int64, the row of each chunk
    last_chunk_indices: torch.Tensor  # [B] int64, each row's last chunk
    chunk_dest_slots: torch.Tensor  # [C] int64, checkpoint slot written at the chunk end, or PAD_SLOT_ID
    chunk_end_positions: torch.Tensor  # [C] int64, absolute position (tokens folded in) at the chunk end
    # Python copies for loops in reference kernels.
    state_indices_list: list[int]
    has_initial_state_list: list[bool]
    query_start_loc_list: list[int]
    cu_chunk_seqlens_list: list[int]
    chunk_seq_idx_list: list[int]
    chunk_dest_slots_list: list[int]
    chunk_end_positions_list: list[int]
    is_decode: bool  # every row has exactly one new token
    # A decode step in its common form: no padding row, every row continues its slot. Decode fast paths
    # (layers/mamba2_decode.py, backends/decode_graph.py) take only these steps; a row whose token completes a
    # block (a planned checkpoint) gets its new state copied to the checkpoint slot after the step.
    plain_decode: bool = False
    # What kernels derive from this step's cut (segment plans, index tensors): every layer of the step cuts it
    # the same way, so it is derived once per step (cached), not once per layer.
    _derived: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def cached(self, key: Hashable, build: Callable[[], T]) -> T:
        """`build()` the first time `key` is asked of this step's metadata; the same value after that."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    def segment_plan(self, sub_chunk: int) -> SegmentPlan:
        """The SSD kernels' chunks and segments of this step (tiling.plan_segments), once per step."""
        return self.cached(("segments", sub_chunk), lambda: plan_segments(
            self.chunks, self.state_indices_list, self.chunk_size, sub_chunk))  # fmt: skip

    @property
    def chunks(self) -> Chunks:
        """The chunks in plain integers, which the kernels cut further (kernels/tiling.py)."""
        return Chunks(
            self.cu_chunk_seqlens_list, self.chunk_seq_idx_list, self.chunk_end_positions_list,
            self.chunk_dest_slots_list,
        )  # fmt: skip


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute positions
    query_start_loc: torch.Tensor  # [B+1] int64
    logits_indices: torch.Tensor  # [R] int64, last token of every row with sample=True
    sample_rows: list[int]  # the row of each logits index
    attn: AttentionMetadata | None
    ssm: SSMMetadata | None
    num_seqs: int
    num_tokens: int
    # The ops the layers call this step (kernels/kernel_set.py): the runner's backend chooses them.
    kernels: KernelSet
    # (row, position, slot) of every checkpoint the SSM kernels write this step.
    planned_checkpoints: list[tuple[int, int, int]] = field(default_factory=list)
    # The sliding-window layers' paging (their own block pool and tables); None without such layers.
    window_attn: AttentionMetadata | None = None
    # Draft tokens among the step's tokens (docs/speculative.md): a row with d of them is a verify row of
    # [decode token, d drafts]; set by the runner, 0 in any other step.
    num_draft_tokens: int = 0
    # The one device buffer the metadata tensors are views of (kernels/batch.py's batch_on), or None (a host batch).
    packed: torch.Tensor | None = None
