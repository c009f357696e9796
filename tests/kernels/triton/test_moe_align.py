"""The one-launch pair alignment (recap/kernels/triton/moe_align.py) against `align_pairs` (kernels/moe.py), its
reference: the same pair ids row for row and the same expert per block.

Random routings (T 1..300, k 1..8, E 1..64 and one E at the kernel's bound), the block fused_moe uses and others
(1, odd), ids outside [0, E) (Zaya's skip expert, -1), experts that get no pair, and one expert taking every
pair; the size limits and fused_moe past them (the reference's ops). fp32 under the interpreter on a CPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from recap.backends.cuda_graph import HostReads
from recap.kernels.moe import align_pairs
from recap.kernels.triton.fused_moe import BLOCK_M, fused_moe
from recap.kernels.triton.moe_align import MAX_EXPERTS, MAX_PAIRS, AlignmentSizeError, align_pairs_triton, covers


def _assert_same(experts: torch.Tensor, num_experts: int, block: int) -> None:
    want = align_pairs(experts, num_experts, block)
    got = align_pairs_triton(experts, num_experts, block)
    assert got.block == block
    assert got.pair_ids.dtype == want.pair_ids.dtype and got.block_expert.dtype == want.block_expert.dtype
    assert torch.equal(got.pair_ids, want.pair_ids), (num_experts, block, experts.shape)
    assert torch.equal(got.block_expert, want.block_expert), (num_experts, block, experts.shape)


@pytest.mark.parametrize("seed", range(12))
def test_random_routings_align_as_the_reference(seed: int) -> None:
    """Top-k-like routings (distinct ids per token) over some of the experts, some ids out of range."""
    rng = random.Random(1000 + seed)
    num_experts = rng.choice([1, 2, 3, 5, 8, 16, 33, 64])
    k = rng.randint(1, min(8, num_experts + 2))
    tokens = rng.randint(1, 300)
    used = rng.sample(range(num_experts), rng.randint(1, num_experts))  # the rest get no pair
    pool = used + [-1, num_experts, num_experts + 1][: rng.randint(0, 3)]
    rows = [rng.sample(pool, min(k, len(pool))) + [num_experts] * max(0, k - len(pool)) for _ in range(tokens)]
    experts = torch.tensor(rows, dtype=rng.choice([torch.long, torch.int32]))
    for block in (BLOCK_M, rng.choice([1, 3, 8, 64])):
        _assert_same(experts, num_experts, block)


def test_one_expert_takes_every_pair() -> None:
    experts = torch.full((300, 4), 5, dtype=torch.long)
    _assert_same(experts, 8, BLOCK_M)
    _assert_same(experts[:1, :1], 8, BLOCK_M)  # one decode pair
    got = align_pairs_triton(experts, 8, BLOCK_M)
    assert got.pair_ids[:1200].tolist() == list(range(1200))
    assert got.block_expert[:75].eq(5).all() and got.block_expert[75:].eq(-1).all()


def test_ids_outside_the_stack_get_no_row() -> None:
    """Zaya's skip expert (id E), and ids far out on both sides; all out of range leaves every block unused."""
    gen = torch.Generator().manual_seed(7)
    experts = torch.randint(-3, 12, (97, 3), generator=gen)
    _assert_same(experts, 6, BLOCK_M)
    none = align_pairs_triton(torch.full((5, 2), 6), 6, BLOCK_M)
    assert none.pair_ids.eq(10).all() and none.block_expert.eq(-1).all()


def test_many_experts_up_to_the_bound() -> None:
    gen = torch.Generator().manual_seed(11)
    for num_experts, tokens, k in ((MAX_EXPERTS, 64, 8), (300, 200, 6)):
        experts = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(tokens)])
        _assert_same(experts, num_experts, BLOCK_M)


def test_it_reads_nothing_on_the_host() -> None:
    """A CUDA graph holds it: no op whose result needs a value on the host (cuda_graph.HostReads)."""
    experts = torch.randint(0, 8, (9, 2), generator=torch.Generator().manual_seed(2))
    with HostReads():
        got = align_pairs_triton(experts, 8, BLOCK_M)
    assert torch.equal(got.pair_ids, align_pairs(experts, 8, BLOCK_M).pair_ids)


def test_sizes_past_its_limits_are_refused() -> None:
    assert covers(MAX_PAIRS, MAX_EXPERTS) and not covers(MAX_PAIRS + 1, 8) and not covers(8, MAX_EXPERTS + 1)
    with pytest.raises(AlignmentSizeError, match="experts"):
        align_pairs_triton(torch.zeros(4, 2, dtype=torch.long), MAX_EXPERTS + 1, BLOCK_M)
    with pytest.raises(AlignmentSizeError, match="pairs"):
        align_pairs_triton(torch.zeros(MAX_PAIRS // 8 + 1, 8, dtype=torch.long), 8, BLOCK_M)
    with pytest.raises(TypeError, match="integer"):
        align_pairs_triton(torch.zeros(4, 2), 8, BLOCK_M)
    with pytest.raises(ValueError, match="block"):
        align_pairs_triton(torch.zeros(4, 2, dtype=torch.long), 8, 0)
    empty = align_pairs_triton(torch.zeros(0, 2, dtype=torch.long), 8, BLOCK_M)
    assert empty.pair_ids.numel() == 0 and empty.block_expert.numel() == 0


def test_fused_moe_past_the_bound_aligns_with_the_reference() -> None:
    """More experts than the one-program alignment serves: fused_moe takes align_pairs, and stays exact."""
    gen = torch.Generator().manual_seed(5)
    num_experts, d, inter = MAX_EXPERTS + 1, 16, 8
    x = torch.randn(3, d, generator=gen)
    w_in = torch.randn(num_experts, 2 * inter, d, generator=gen) * 0.3
    w_out = torch.randn(num_experts, d, inter, generator=gen) * 0.3
    ids = torch.tensor([[0, MAX_EXPERTS], [7, 3], [MAX_EXPERTS, 0]])
    weights = torch.rand(3, 2, generator=gen)
    got = fused_moe(x, w_in, w_out, ids, weights)
    want = torch.zeros(3, d)
    for t in range(3):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = (w_in[e] @ x[t]).split(inter)
            want[t] += weights[t, j] * (w_out[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
