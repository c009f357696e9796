"""The fused routed experts (recap/kernels/triton/fused_moe.py) against the MoE modules' per-expert loops, their
references, and the device-side pair alignment (recap/kernels/moe.py) against a plain one.

Random shapes: odd token counts, top-k 1, 2 and 8, experts that get no token, pad rows in every expert's last
block, expert ids outside the stack (Zaya's skip expert); every expert layout (per-expert modules, stacked,
interleaved gate/up rows), gated SwiGLU (with and without a clamp) and Nemotron-H's non-gated relu2; fp32 here
(the interpreter), bf16 too on a GPU. Experts the kernel cannot serve keep their loop, and say why.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from recap.kernels.moe import align_pairs, padded_rows
from recap.kernels.triton.fused_moe import fused_moe
from recap.model.feed_forward_configs import MoEConfig
from recap.model.layers.moe import ExpertList, StackedExperts
from recap.model.layers.zaya_moe import ZayaMoE

from .device_rows import DEVICE, TOL

DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def _plain_alignment(experts: list[list[int]], num_experts: int, block: int) -> tuple[list[int], list[int]]:
    """(pair id per row, expert per block): each expert's pairs in pair order, padded to whole blocks with n."""
    flat = [e for row in experts for e in row]
    n, rows, owners = len(flat), [], []
    for e in range(num_experts):
        mine = [p for p, x in enumerate(flat) if x == e]
        blocks = -(-len(mine) // block)
        rows += mine + [n] * (blocks * block - len(mine))
        owners += [e] * blocks
    total = padded_rows(n, num_experts, block)
    return rows + [n] * (total - len(rows)), owners + [-1] * (total // block - len(owners))


@pytest.mark.parametrize("seed", range(6))
def test_alignment_equals_a_plain_one(seed: int) -> None:
    rng = random.Random(seed)
    num_experts, block = rng.choice([(4, 4), (8, 16), (16, 16), (3, 8)])
    k = rng.choice([k for k in (1, 2, 8) if k <= num_experts])
    tokens = rng.choice([0, 1, 3, 7, 13])
    # ids past the stack (E, E + 1) and below it (-1): no row
    experts = [rng.sample(range(-1, num_experts + 2), k) for _ in range(tokens)]
    got = align_pairs(torch.tensor(experts, dtype=torch.long).view(tokens, k), num_experts, block)
    rows, owners = _plain_alignment(experts, num_experts, block)
    assert got.pair_ids.tolist() == rows
    assert got.block_expert.tolist() == owners


def _random_(module: torch.nn.Module, gen: torch.Generator) -> torch.nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module


def _routing(tokens: int, k: int, num_experts: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids [T, k] from half the experts (the other half get no token) and softmax weights [T, k]."""
    logits = torch.randn(tokens, num_experts, generator=gen)
    logits[:, num_experts // 2 :] -= 100.0 if k <= num_experts // 2 else 0.0
    weights, experts = torch.softmax(logits, -1).topk(k, dim=-1)
    return experts, weights


CASES = [  # (layout, gated, activation, interleaved, swiglu_limit, experts, top-k)
    ("list", True, "silu", False, None, 8, 2),
    ("list", False, "relu2", False, None, 8, 1),
    ("stacked", True, "silu", False, None, 16, 8),
    ("stacked", True, "silu", True, 0.7, 4, 2),
    ("stacked", False, "gelu_pytorch_tanh", False, None, 8, 2),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[2]}-k{c[6]}{'-inter' if c[3] else ''}")
def test_fused_experts_equal_the_loop(case: tuple, dtype: torch.dtype) -> None:
    layout, gated, act, interleaved, limit, num_experts, k = case
    cfg = MoEConfig(num_experts, k, 24, act, gated=gated, expert_layout=layout, interleaved_gate_up=interleaved,
                    swiglu_limit=limit)  # fmt: skip
    gen = torch.Generator(device=DEVICE).manual_seed(num_experts * 10 + k)
    cls = ExpertList if layout == "list" else StackedExperts
    experts_mod = _random_(cls(40, cfg, dtype), gen)
    for tokens in (1, 5, 13):
        x = torch.randn(tokens, 40, generator=gen).to(dtype)
        ids, w = _routing(tokens, k, num_experts, gen)
        want = experts_mod.run(x, ids, w.to(dtype))
        experts_mod.set_moe_kernel(fused_moe)
        assert experts_mod.moe_kernel is fused_moe and experts_mod.moe_refusal is None
        got = experts_mod.run(x, ids, w.to(dtype))
        experts_mod.set_moe_kernel(None)
        assert torch.equal(experts_mod.run(x, ids, w.to(dtype)), want), "the loop is unchanged (list: stacked views)"
        # bf16: the loop sums the k weighted outputs in bf16, the kernel in fp32 then rounds once
        tol = TOL * 10 if dtype == torch.float32 else 6e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=f"{case} T={tokens}")


def test_an_expert_list_shares_its_stacked_weights() -> None:
    """Stacking for the kernel leaves one copy: each expert's layers read views of the stacks."""
    cfg = MoEConfig(4, 2, 16, gated=True)
    mod = _random_(ExpertList(32, cfg, torch.float32), torch.Generator(device=DEVICE).manual_seed(0))
    gate = mod[2].gate_proj.weight.clone()
    mod.set_moe_kernel(fused_moe)
    w_in, w_out, _ = mod._stacked()
    assert torch.equal(w_in[2, :16], gate)
    assert mod[2].gate_proj.weight.data_ptr() == w_in[2].data_ptr()
    assert mod[3].down_proj.weight.data_ptr() == w_out[3].data_ptr()


def test_the_skip_expert_contributes_nothing() -> None:
    """Zaya's expert id E (no expert) gives zero rows, with the kernel as in the loop."""
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    moe = _random_(ZayaMoE(32, 16, 4, 24, 1e-6, True, torch.float32), gen)
    x = torch.randn(7, 32, generator=gen)
    index = torch.tensor([0, 4, 2, 4, 4, 1, 0])
    weight = torch.rand(7, generator=gen)
    got = fused_moe(x, moe.experts.gate_up_proj, moe.experts.down_proj, index[:, None], weight[:, None])
    assert torch.equal(got[[1, 3, 4]], torch.zeros(3, 32))
    want, _ = moe(x, None)
    moe.set_moe_kernel(fused_moe)
    got, _ = moe(x, None)
    torch.testing.assert_close(got, want, rtol=TOL * 10, atol=TOL * 10)


def test_what_it_cannot_serve_keeps_the_loop_or_is_refused() -> None:
    softcapped = StackedExperts(16, MoEConfig(4, 2, 8, expert_layout="stacked", softcaps=(1.0, 2.0)), torch.float32)
    softcapped.set_moe_kernel(fused_moe)
    assert softcapped.moe_kernel is None and "soft-capped" in str(softcapped.moe_refusal)
    gelu = ExpertList(16, MoEConfig(4, 2, 8, activation="gelu"), torch.float32)
    gelu.set_moe_kernel(fused_moe)
    assert gelu.moe_kernel is None and "'gelu'" in str(gelu.moe_refusal)
    with torch.device("cpu"):  # int4 layers are the CPU backend's
        packed = _random_(ExpertList(16, MoEConfig(4, 2, 8), torch.float32), torch.Generator())
        packed[1].up_proj.set_backend("int4")
        packed.set_moe_kernel(fused_moe)
    assert packed.moe_kernel is None and "quantized" in str(packed.moe_refusal)
    x, ids, w = torch.randn(3, 16), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    with pytest.raises(TypeError, match="int8"):
        fused_moe(x, torch.zeros(4, 16, 16, dtype=torch.int8), torch.zeros(4, 16, 8), ids, w)
    with pytest.raises(ValueError, match="no activation"):
        fused_moe(x, torch.zeros(4, 16, 16), torch.zeros(4, 16, 8), ids, w, activation="gelu")
    with pytest.raises(ValueError, match="w_out"):
        fused_moe(x, torch.zeros(4, 16, 16), torch.zeros(4, 16, 9), ids, w)


def test_a_backend_hands_its_kernel_sets_experts_to_every_moe(tmp_path: Path) -> None:
    """The Triton kernel set's backend puts a Nemotron-H hybrid's routed experts on the fused kernel; preparing
    the model for the torch kernel set gives them back their loop."""
    from recap.backends.base import model_parts
    from recap.backends.eager import TorchBackend
    from recap.kernels.triton.kernel_set import TRITON_KERNELS
    from recap.model.layers.moe import FusedExperts
    from recap.model.loader import load_model
    from recap.model.testing import make_tiny_checkpoint

    model = load_model(make_tiny_checkpoint("nemotron_h", tmp_path / "m"), linear_backend="torch").model
    experts = [m for m in model_parts(model) if isinstance(m, FusedExperts)]
    assert len(experts) == 2
    TorchBackend(kernels=TRITON_KERNELS).prepare(model)
    assert all(m.moe_kernel is fused_moe for m in experts)
    TorchBackend().prepare(model)
    assert all(m.moe_kernel is None for m in experts)
