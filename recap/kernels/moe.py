"""The kernel set's fused routed experts (`moe_experts`; kernels/triton/fused_moe.py), their device-only parts:
what they serve, and the token-expert pairs sorted by expert into blocks of one expert each, on the device, in
shapes fixed by the pair count (the GEMMs' first step; vLLM's moe_align_block_size in spirit). `align_pairs` is
the reference and the CPU path; the Triton kernel set aligns in one launch (kernels/triton/moe_align.py).

The op's reference is the MoE modules' own per-expert loop (model/layers/moe.py), which a backend replaces with
the kernel (Backend.prepare, `set_moe_kernel`) where the experts are dense fp32/bf16/fp16 weights, without
biases or soft caps, and their activation is one of MOE_ACTIVATIONS; other experts keep their loop.

Pair p = t * k + j is token t's j-th choice (`experts[t, j]`). Each expert's pairs, in pair order, fill
ceil(count / block) blocks of `block` rows; the rest of its last block is padding (the pair id n = T * k, which
the GEMM kernels skip). No value is read on the host, so a CUDA graph can hold this step: the number of rows is
the bound below whatever the routing, and the blocks past the used ones say so (expert -1). Expert ids outside
[0, E) (Zaya's skip expert) get no row: their pairs contribute nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The activations the fused experts compute (HF config names), gated (act(gate) * up) or not (act(up)).
MOE_ACTIVATIONS = ("silu", "swish", "relu", "relu2", "gelu_pytorch_tanh", "gelu_new")


def padded_rows(pairs: int, num_experts: int, block: int) -> int:
    """The most rows the aligned pairs can take: each expert's last block wastes at most block - 1 rows, and
    no block is empty (so at most one block per pair), rounded up to whole blocks."""
    rows = min(pairs + num_experts * (block - 1), pairs * block)
    return -(-rows // block) * block


@dataclass(frozen=True)
class AlignedPairs:
    """pair_ids [rows]: the pair at each row (n for padding); block_expert [rows / block]: each block's
    expert (-1: unused, past the last expert's blocks)."""

    pair_ids: torch.Tensor
    block_expert: torch.Tensor
    block: int


def align_pairs(experts: torch.Tensor, num_experts: int, block: int) -> AlignedPairs:
    """`experts` [T, k] (int) -> the pairs aligned to blocks of `block` rows per expert (module docstring)."""
    flat = experts.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    rows = padded_rows(n, num_experts, block)
    # Out-of-range ids go to bucket E (never laid out).
    bucket = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, bucket, torch.ones_like(flat))
    padded = (counts[:num_experts] + block - 1) // block * block
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(bucket, stable=True)  # pairs grouped by expert, in pair order within one
    sorted_bucket = bucket[order]
    first = torch.cumsum(counts, 0) - counts  # each bucket's first index in `order`
    rank = torch.arange(n, device=dev) - first[sorted_bucket]
    starts = ends - padded
    laid_out = sorted_bucket < num_experts
    dest = torch.where(laid_out, starts[sorted_bucket.clamp(max=num_experts - 1)] + rank, rows)
    pair_ids = torch.full((rows + 1,), n, dtype=torch.int32, device=dev)  # row `rows`: the dropped pairs' sink
    pair_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, rows, block, device=dev)
    owner = torch.searchsorted(ends, block_starts, right=True)  # the expert whose rows hold the block's first row
    block_expert = torch.where(owner < num_experts, owner, -1).to(torch.int32)
    return AlignedPairs(pair_ids[:rows], block_expert, block)
