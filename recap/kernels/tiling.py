"""How a step's packed rows are cut for the SSM kernels, in plain integers (one place for every kernel's cuts).

Glossary
- offset: a token's index in the packed batch; position: absolute, the tokens folded into a state after it.
- grid: the absolute multiples of chunk_size. Every cut below keeps the grid cuts, so that the first chunk
  completes the current grid cell and chunked prefill matches one-shot prefill.
- chunk (the metadata's): a run of one row's tokens, cut at the grid, at every checkpoint position and at
  the row end, so that the state at each checkpoint is the state at some chunk end (DESIGN invariant 3).
  SSMMetadata carries them; conv1d and the Mamba1 scan work per chunk.
- piece: a chunk cut into runs of at most `size` tokens from its start (the gated delta rule's unit of work,
  the Mamba1 scan's block).
- SSD chunk: a row's grid cell cut into runs of at most `sub` tokens from the cell start; checkpoints do not
  cut it. segment: an SSD chunk cut again at the checkpoint positions inside it, so every checkpoint is a
  segment end (the Mamba2 SSD kernels, torch and Triton).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from recap.core.output import PAD_SLOT_ID


class RowTokens(NamedTuple):
    """One row of a step as the tiling sees it."""

    context_len: int  # tokens already folded into the row's state
    num_tokens: int  # new tokens this step, >= 1
    checkpoints: Mapping[int, int]  # absolute position -> destination slot, each in (context_len, context_len + n]


@dataclass(frozen=True)
class Chunks:
    """A step's chunks (the SSMMetadata lists): a row's chunks are contiguous and in token order."""

    cu: list[int]  # [C+1] offsets of the chunk starts, then the step's token count
    rows: list[int]  # [C] the row of each chunk
    end_positions: list[int]  # [C] position at each chunk end
    dest_slots: list[int]  # [C] checkpoint slot written at the chunk end, or PAD_SLOT_ID

    def row_last(self, num_rows: int) -> list[int]:
        """[B] each row's last chunk (every row has at least one)."""
        last = [0] * num_rows
        for c, row in enumerate(self.rows):
            last[row] = c
        return last

    def checkpoints(self) -> list[tuple[int, int, int]]:
        """(row, position, slot) of every chunk end with a destination slot, in chunk order."""
        return [(r, p, d) for r, p, d in zip(self.rows, self.end_positions, self.dest_slots) if d != PAD_SLOT_ID]


def row_chunk_ends(context_len: int, n: int, chunk_size: int, cuts: Sequence[int]) -> list[int]:
    """Relative end offsets of a row's chunks: grid cuts, the cuts at positions `cuts` and the row end."""
    ends = {n}
    first_grid = (context_len // chunk_size + 1) * chunk_size
    ends.update(range(first_grid - context_len, n, chunk_size))
    ends.update(p - context_len for p in cuts)
    return sorted(e for e in ends if 0 < e <= n)


def chunk_rows(rows: Sequence[RowTokens], chunk_size: int) -> Chunks:
    """The chunks of rows packed in order (row r's tokens follow row r - 1's)."""
    cu, chunk_row, dest, end_pos = [0], [], [], []
    for row, r in enumerate(rows):
        start = cu[-1]
        for e in row_chunk_ends(r.context_len, r.num_tokens, chunk_size, list(r.checkpoints)):
            cu.append(start + e)
            chunk_row.append(row)
            end_pos.append(r.context_len + e)
            dest.append(r.checkpoints.get(r.context_len + e, PAD_SLOT_ID))
    return Chunks(cu, chunk_row, end_pos, dest)


class Piece(NamedTuple):
    row: int
    start: int  # offsets [start, end)
    end: int
    chunk: int  # the chunk this piece ends, or -1


def cut_pieces(chunks: Chunks, size: int) -> list[Piece]:
    """Every chunk cut into pieces of at most `size` tokens from its start, in token order."""
    pieces = []
    for c, row in enumerate(chunks.rows):
        a, b = chunks.cu[c], chunks.cu[c + 1]
        for s in range(a, b, size):
            e = min(s + size, b)
            pieces.append(Piece(row, s, e, c if e == b else -1))
    return pieces


@dataclass(frozen=True)
class SegmentPlan:
    """How the SSD kernels cut a step: SSD chunks (intra-chunk outputs, state readout), segments (the states
    and their recurrence), and the slot writes."""

    cu: list[int]  # [R+1] offsets of the SSD chunks; a row's SSD chunks are contiguous and in order
    first: list[int]  # [B] each row's first SSD chunk
    counts: list[int]  # [B] each row's SSD chunk count
    segments: list[tuple[int, int, int]]  # (SSD chunk, start, end), offsets inside the SSD chunk, in token order
    seg_rows: list[int]  # the row of each segment
    chunk_last_seg: list[int]  # [R] the segment that ends each SSD chunk
    checkpoints: list[tuple[int, int, int]]  # (segment, slot, position): slot <- the state after the segment
    running: list[tuple[int, int, int]]  # (SSD chunk, slot, position): each valid row's final state

    @property
    def split(self) -> bool:
        """Some checkpoint falls inside an SSD chunk: segments are finer than SSD chunks."""
        return len(self.segments) > len(self.chunk_last_seg)


def _grid_cells(chunks: Chunks, chunk_size: int) -> Iterator[tuple[int, int, int, list[int]]]:
    """(row, start, end, inner cuts) of each row's grid cells in order: the chunks that end at a checkpoint
    only (neither at the grid nor at the row end) merged, their ends returned as the cell's inner cuts."""
    rows, start, cuts = chunks.rows, 0, []
    for c, row in enumerate(rows):
        end = chunks.cu[c + 1]
        if c + 1 < len(rows) and rows[c + 1] == row and chunks.end_positions[c] % chunk_size:
            cuts.append(end)
            continue
        yield row, start, end, cuts
        start, cuts = end, []


def plan_segments(chunks: Chunks, slots: Sequence[int], chunk_size: int, sub: int) -> SegmentPlan:
    """SSD chunks: each row's grid cells cut into runs of <= sub tokens from the cell start. Segments: the SSD
    chunks cut again at every checkpoint inside them. slots: each row's running slot (PAD_SLOT_ID: none).

    The math does not depend on where SSD chunks are cut, and 64-token ones are ~3x cheaper than 16-token
    ones, so checkpoints cut segments only. Every chunk end stays a segment end.
    """
    nb = len(slots)
    cu, first, counts = [0], [0] * nb, [0] * nb
    segments: list[tuple[int, int, int]] = []
    seg_rows: list[int] = []
    chunk_last_seg: list[int] = []
    seg_at_end: dict[int, int] = {}  # offset -> the segment ending there
    for row, start, end, cuts in _grid_cells(chunks, chunk_size):
        if counts[row] == 0:
            first[row] = len(cu) - 1
        for a in range(start, end, sub):
            b = min(a + sub, end)
            s0 = a
            for e in [x for x in cuts if a < x < b] + [b]:
                seg_at_end[e] = len(segments)
                segments.append((len(cu) - 1, s0 - a, e - a))
                seg_rows.append(row)
                s0 = e
            cu.append(b)
            chunk_last_seg.append(len(segments) - 1)
            counts[row] += 1
    pos = chunks.end_positions
    ends = zip(chunks.cu[1:], chunks.dest_slots, pos)
    checkpoints = [(seg_at_end[e], d, p) for e, d, p in ends if d != PAD_SLOT_ID]
    last = chunks.row_last(nb)
    running = [(first[r] + counts[r] - 1, s, pos[last[r]]) for r, s in enumerate(slots) if s != PAD_SLOT_ID]
    return SegmentPlan(cu, first, counts, segments, seg_rows, chunk_last_seg, checkpoints, running)
