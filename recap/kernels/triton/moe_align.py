"""The token-expert pairs aligned to one-expert blocks in one Triton launch: the twin of `align_pairs`
(kernels/moe.py, its reference and the CPU path), with the same AlignedPairs row for row.

The reference dispatches 33 launching torch ops (counts, cumsums, a stable argsort, a searchsorted, the casts
and index arithmetic between them; benchmarks/count_moe_ops.py), each a launch in a decode step that launches
are the cost of. Here one program does it all in registers, over chunks of CHUNK pairs
against all experts at once (a [CHUNK, E] one-hot tile; vLLM's Triton moe_align_block_size spreads the same
steps over four launches, with per-program counts in memory):

1. counts[e] over every pair (ids outside [0, E) match no column: no row);
2. each expert's first row: the exclusive cumsum of the counts rounded up to whole blocks;
3. pair p's row = its expert's first row + the pairs of that expert before it: the pairs before its chunk
   (a running count) + those before it in the chunk (a cumsum of the one-hot down the chunk), so each expert's
   pairs keep pair order, as the reference's stable sort does;
4. every other row (the rest of each expert's last block, and the rows past the last expert) gets the pair id
   n = T * k, and each block the expert owning its first row (-1 past the last). These rows and step 3's are
   disjoint, so no write waits for another and no barrier is needed.

No atomics, no host reads; the shapes follow (T * k, E, block) only (padded_rows), so a CUDA graph holds it.
Limits: E <= MAX_EXPERTS (the one-hot tile lives in registers) and T * k <= MAX_PAIRS (one program walks every
pair twice: past that, at prefill, the reference's parallel ops win and launches no longer dominate).
`covers` says whether a size is within them; beyond them `align_pairs_triton` raises AlignmentSizeError.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from recap.kernels.moe import AlignedPairs, padded_rows

MAX_EXPERTS = 1024
MAX_PAIRS = 1 << 16
TILE = 4096  # elements of one [CHUNK, E] one-hot tile


class AlignmentSizeError(ValueError):
    """The routing is larger than the one-program alignment serves (module docstring: its limits)."""


@triton.jit
def _align_kernel(experts_ptr, pair_ptr, block_expert_ptr, n_pairs, n_rows, n_blocks, num_experts,
                  BLOCK: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """One program: pair_ids [n_rows] and block_expert [n_blocks] from experts [n_pairs] (module docstring)."""
    cols = tl.arange(0, E_PAD)
    col_ok = cols < num_experts
    # 1. counts per expert
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for p0 in range(0, n_pairs, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        e = tl.load(experts_ptr + p, mask=p < n_pairs, other=-1)
        hit = (e[:, None] == cols[None, :]) & col_ok[None, :]  # (CHUNK, E_PAD)
        counts += tl.sum(hit.to(tl.int32), axis=0)
    # 2. each expert's rows: [starts, starts + counts) pairs, then padding up to ends
    padded = (counts + BLOCK - 1) // BLOCK * BLOCK
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    # 3. each pair's row, in pair order within its expert
    seen = tl.zeros((E_PAD,), dtype=tl.int32)
    for p0 in range(0, n_pairs, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        e = tl.load(experts_ptr + p, mask=p < n_pairs, other=-1)
        hit = ((e[:, None] == cols[None, :]) & col_ok[None, :]).to(tl.int32)  # (CHUNK, E_PAD)
        before = tl.cumsum(hit, axis=0) - 1 + (starts + seen)[None, :]  # row if the pair were that expert's
        dest = tl.sum(hit * before, axis=1)
        tl.store(pair_ptr + dest, p.to(tl.int32), mask=tl.sum(hit, axis=1) > 0)
        seen += tl.sum(hit, axis=0)
    # 4. padding rows and each block's expert
    for r0 in range(0, n_rows, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        mine = (r[:, None] >= starts[None, :]) & (r[:, None] < ends[None, :])  # (CHUNK, E_PAD): the owner
        used = tl.sum(tl.where(mine, (starts + counts)[None, :], 0), axis=1)  # the owner's first padding row; 0: none
        pad = r >= used
        tl.store(pair_ptr + r, tl.zeros((CHUNK,), tl.int32) + n_pairs, mask=pad & (r < n_rows))
    for b0 in range(0, n_blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        first = b * BLOCK
        mine = (first[:, None] >= starts[None, :]) & (first[:, None] < ends[None, :])
        owner = tl.sum(tl.where(mine, cols[None, :] + 1, 0), axis=1) - 1  # -1: no expert owns it
        tl.store(block_expert_ptr + b, owner.to(tl.int32), mask=b < n_blocks)


def covers(pairs: int, num_experts: int) -> bool:
    """Whether `align_pairs_triton` serves T * k = `pairs` pairs over `num_experts` experts."""
    return 1 <= num_experts <= MAX_EXPERTS and pairs <= MAX_PAIRS


def align_pairs_triton(experts: torch.Tensor, num_experts: int, block: int) -> AlignedPairs:
    """`experts` [T, k] (int) -> align_pairs(experts, num_experts, block), in one launch (module docstring)."""
    if experts.dim() != 2 or experts.dtype.is_floating_point or experts.dtype == torch.bool:
        raise TypeError(f"the pair alignment takes integer expert ids [T, k], got {experts.dtype} "
                        f"{tuple(experts.shape)}")  # fmt: skip
    if block < 1:
        raise ValueError(f"the pair alignment needs a block of at least one row, got {block}")
    n = experts.numel()
    if not covers(n, num_experts):
        raise AlignmentSizeError(
            f"one-program pair alignment serves 1..{MAX_EXPERTS} experts and up to {MAX_PAIRS} pairs, got "
            f"{num_experts} experts and {n} pairs (use align_pairs)")  # fmt: skip
    rows = padded_rows(n, num_experts, block)
    pair_ids = torch.empty(rows, dtype=torch.int32, device=experts.device)
    block_expert = torch.empty(rows // block, dtype=torch.int32, device=experts.device)
    if rows == 0:
        return AlignedPairs(pair_ids, block_expert, block)
    e_pad = max(16, triton.next_power_of_2(num_experts))
    chunk = max(16, TILE // e_pad)
    _align_kernel[(1,)](experts.contiguous(), pair_ids, block_expert, n, rows, rows // block, num_experts,
                        BLOCK=block, E_PAD=e_pad, CHUNK=chunk, num_warps=4 if e_pad * chunk <= TILE else 8)  # fmt: skip
    return AlignedPairs(pair_ids, block_expert, block)
