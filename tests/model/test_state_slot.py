"""One state slot holds every state tensor of every recurrent layer, whatever its kind.

A model mixing kinds (Mamba1 + Mamba2 + attention here; Gated DeltaNet joins in test_gdn_*) is allocated
in bf16: copy-on-write copies every tensor, bytes add up to the specs, and a disaggregated transfer
round-trips every tensor of the running slot and the checkpoints.
"""

from __future__ import annotations

import pytest
import torch

from recap.core.output import CheckpointWrite
from recap.core.request import Request
from recap.core.transfer import CheckpointOffer, CheckpointReceive, HeldRequest, ReceivePlan
from recap.disagg.worker import TransferDataError, from_frames, gather, scatter, to_frame
from recap.model.cache import UNWRITTEN, ModelCaches
from recap.model.config import AttentionConfig, Mamba1Config, Mamba2Config, ModelConfig
from recap.model.state_spec import StateTensorSpec


def mixed_config() -> ModelConfig:
    m1 = Mamba1Config(d_inner=24, d_state=4, d_conv=4, dt_rank=2, conv_bias=True, proj_bias=False)
    m2 = Mamba2Config(num_heads=4, head_dim=6, n_groups=2, d_state=5, d_conv=3, chunk_size=16, conv_bias=True,
                      proj_bias=False, time_step_limit=(0.0, float("inf")), norm_eps=1e-5)  # fmt: skip
    attn = AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=8, rope_theta=1e4, rotary_dim=8)
    return ModelConfig(
        architecture="test", vocab_size=32, hidden_size=12, layer_types=("mamba1", "attention", "mamba2", "mamba1"),
        mlp_types=("none",) * 4, norm_eps=1e-5, tie_word_embeddings=True, ssm_chunk_size=16, attention=attn,
        mamba1=m1, mamba2=m2,
    )  # fmt: skip


def _fill(caches: ModelCaches, slot: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in caches.state_tensors():
        t[slot].copy_(torch.randn(t.shape[1:], generator=g))


def test_specs_sizes_and_dtypes() -> None:
    cfg = mixed_config()
    caches = ModelCaches.allocate(cfg, 4, 16, 5, torch.bfloat16)
    assert sorted(caches.state) == [0, 2, 3] and sorted(caches.kv) == [1]
    expected = 0
    for i in cfg.ssm_layers:
        for spec in cfg.state_specs(i):
            t = caches.state[i][spec.name]
            assert t.shape == (5, *spec.shape)
            assert t.dtype == (torch.float32 if spec.name == "ssm" else torch.bfloat16)
            expected += spec.nbytes(torch.bfloat16)
    assert caches.state_bytes_per_slot() == cfg.state_bytes_per_slot(torch.bfloat16) == expected
    # Mamba1 x 2: conv 24 x 3 bf16 + ssm 24 x 4 fp32; Mamba2: conv (24 + 2*2*5) x 2 bf16 + ssm 4 x 6 x 5 fp32
    assert expected == 2 * (24 * 3 * 2 + 24 * 4 * 4) + (44 * 2 * 2 + 4 * 6 * 5 * 4)
    assert caches.total_bytes() == 4 * 16 * 8 * 2 * 2 + 5 * expected + 5 * 8  # K+V of 1 kv head x 8 in bf16
    with pytest.raises(ValueError, match="no recurrent state"):
        cfg.state_specs(1)


def test_spec_validation() -> None:
    with pytest.raises(ValueError):
        StateTensorSpec("a.b", (2,))
    with pytest.raises(ValueError):
        StateTensorSpec("conv", (3, 0))


def test_copy_and_clear_every_tensor() -> None:
    caches = ModelCaches.allocate(mixed_config(), 2, 16, 4, torch.bfloat16)
    _fill(caches, 1, seed=3)
    caches.slot_positions[1] = 32
    caches.copy_state(1, 2)
    assert len(caches.state_tensors()) == 6
    for t in caches.state_tensors():
        assert t[1].any() and torch.equal(t[2], t[1]) and not t[3].any()
    assert caches.slot_positions[2].item() == 32
    caches.clear_slot(1)
    assert all(not t[1].any() and t[2].any() for t in caches.state_tensors())
    assert caches.slot_positions[1].item() == UNWRITTEN


def _held_and_plan(caches: ModelCaches) -> tuple[HeldRequest, ReceivePlan]:
    request = Request("r", list(range(40)), max_tokens=4)
    held = HeldRequest(request, (1, 2, 3), 1, (CheckpointOffer(16, 2, 0xAB), CheckpointOffer(32, 3, 0xCD)), 7)
    receives = (CheckpointReceive(CheckpointWrite(16, 3), 0xAB), CheckpointReceive(CheckpointWrite(32, 4), 0xCD))
    plan = ReceivePlan("r", 40, 7, block_indices=(0, 1, 2), block_ids=(3, 2, 1), state_slot=1, checkpoints=receives,
                       num_local_blocks=0, local_checkpoint=0, hit_tokens=0)  # fmt: skip
    return held, plan


def test_disagg_transfer_round_trips_every_tensor() -> None:
    cfg = mixed_config()
    src = ModelCaches.allocate(cfg, 4, 16, 5, torch.bfloat16)
    dst = ModelCaches.allocate(cfg, 4, 16, 5, torch.bfloat16)
    for slot, pos in ((1, 40), (2, 16), (3, 32)):
        _fill(src, slot, seed=slot)
        src.slot_positions[slot] = pos
    for c in src.kv.values():
        c.k_cache.normal_()
        c.v_cache.normal_()
    held, plan = _held_and_plan(src)
    header, tensors = gather(src, held, [0, 1, 2], [16, 32])
    state_names = [m["name"] for m in header["tensors"] if m["name"].startswith("state.")]
    assert state_names == [f"state.{n}" for n, _ in src.named_state_tensors()]
    received = from_frames(header, [bytes(to_frame(t)) for t in tensors])
    writes = scatter(dst, plan, header, received)
    assert writes == [CheckpointWrite(16, 3), CheckpointWrite(32, 4)]
    for (_, a), (_, b) in zip(src.named_state_tensors(), dst.named_state_tensors(), strict=True):
        assert torch.equal(b[1], a[1]) and torch.equal(b[3], a[2]) and torch.equal(b[4], a[3])
    assert dst.slot_positions[[1, 3, 4]].tolist() == [40, 16, 32]
    for i, c in src.kv.items():  # blocks 1, 2, 3 land in 3, 2, 1
        assert torch.equal(dst.kv[i].k_cache[[3, 2, 1]], c.k_cache[[1, 2, 3]])


def test_disagg_transfer_refuses_a_state_of_another_shape() -> None:
    cfg = mixed_config()
    src = ModelCaches.allocate(cfg, 4, 16, 5, torch.bfloat16)
    dst = ModelCaches.allocate(cfg, 4, 16, 5, torch.bfloat16)
    src.slot_positions[[1, 2, 3]] = torch.tensor([40, 16, 32])
    held, plan = _held_and_plan(src)
    header, tensors = gather(src, held, [0, 1, 2], [16, 32])
    received = from_frames(header, [bytes(to_frame(t)) for t in tensors])
    name = next(n for n in received if n.endswith(".ssm"))
    broken = dict(received, **{name: received[name][..., :-1].contiguous()})
    with pytest.raises(TransferDataError, match=name):
        scatter(dst, plan, header, broken)
    with pytest.raises(TransferDataError, match="no place"):
        scatter(dst, plan, header, dict(received, **{"state.0.extra": received[name]}))
    assert all(not t.any() for t in dst.state_tensors())  # nothing written
