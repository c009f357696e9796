"""The host side of the native prefill ops' step plan (csrc/step_slots.h's in C): a step's SSMMetadata integers as
the C kernels read them (int64 and contiguous; has_initial_state as bytes), derived once per step and shared by every
layer and op of it (conv taps, the gated delta rule's walk, the SSD walk), and the check of the slot_positions
tensor they write provenance into."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from recap.kernels.metadata import SSMMetadata
from recap.kernels.native import address as _p

_I64 = ctypes.c_int64


@dataclass(frozen=True)
class StepPlan:
    query_start_loc: torch.Tensor  # [B+1]
    cu: torch.Tensor  # [C+1] chunk starts in the packed tokens
    chunk_row: torch.Tensor  # [C]
    dest: torch.Tensor  # [C] checkpoint slot at the chunk end, or -1
    end_pos: torch.Tensor  # [C] the position a chunk's end state stands at
    slots: torch.Tensor  # [B] running slot, or -1 for a padding row
    has_init: torch.Tensor  # [B] bool bytes
    last_chunk: torch.Tensor  # [B]

    @classmethod
    def of(cls, meta: SSMMetadata) -> StepPlan:
        """This step's plan, built on its first use and the same object for the step's other layers and ops."""

        def build() -> StepPlan:
            m = meta
            ints = (m.query_start_loc, m.cu_chunk_seqlens, m.chunk_seq_idx, m.chunk_dest_slots, m.chunk_end_positions,
                    m.state_indices)  # fmt: skip
            return cls(*(v.to(torch.int64).contiguous() for v in ints), m.has_initial_state.to(torch.bool).contiguous(),
                       m.last_chunk_indices.to(torch.int64).contiguous())  # fmt: skip

        return meta.cached("native step plan", build)

    def walk_args(self) -> tuple[object, ...]:
        """The leading arguments of the walks' C entry points (recap_gdn_prefill, recap_ssd_prefill): num_chunks, cu,
        chunk_row, dest, end_pos, num_rows, slots, has_init, last_chunk."""
        return (_I64(self.chunk_row.numel()), _p(self.cu), _p(self.chunk_row), _p(self.dest), _p(self.end_pos),
                _I64(self.slots.numel()), _p(self.slots), _p(self.has_init), _p(self.last_chunk))  # fmt: skip


def check_slot_positions(slot_positions: torch.Tensor | None) -> None:
    """The C kernels write provenance through a raw int64 pointer: refuse any other tensor."""
    if slot_positions is not None and (slot_positions.dtype != torch.int64 or not slot_positions.is_contiguous()):
        raise ValueError("slot_positions must be a contiguous int64 tensor")
