"""mamba2_decode (the plain-decode fast path) against Mamba2Mixer.forward_ref: outputs, conv and SSM states,
slot positions, on random hidden states and random slot contents."""

from __future__ import annotations

import pytest
import torch

from recap.kernels.metadata import SeqSpec, build_forward_batch
from recap.model.cache import ModelCaches
from recap.model.layers.mamba2 import Mamba2Mixer
from recap.model.layers.mamba2_decode import mamba2_decode

BLOCK = 16


def _mixer_and_layer(lm) -> tuple[Mamba2Mixer, int]:  # noqa: ANN001
    for i, kind in enumerate(lm.config.layer_types):
        if kind == "mamba2":
            block = lm.model.blocks()[i]
            return (block.mixer if hasattr(block, "mixer") else block.mamba), i
    raise AssertionError("no Mamba2 layer")


def _random_caches(cfg, slots: int, seed: int) -> ModelCaches:  # noqa: ANN001
    caches = ModelCaches.allocate(cfg, 1 + 4 * slots, BLOCK, slots + 2, torch.float32)
    g = torch.Generator().manual_seed(seed)
    for st in caches.state.values():
        st.conv_state.copy_(torch.randn(st.conv_state.shape, generator=g))
        st.ssm_state.copy_(torch.randn(st.ssm_state.shape, generator=g) * 0.5)
    return caches


@pytest.mark.parametrize("arch", ["mamba2", "bamba"])
@pytest.mark.parametrize(("rows", "seed"), [(1, 0), (3, 1), (5, 2), (8, 3)])
def test_mamba2_decode_matches_reference(arch, rows, seed, tiny_model) -> None:  # noqa: ANN001
    lm = tiny_model(arch)
    mixer, layer = _mixer_and_layer(lm)
    g = torch.Generator().manual_seed(100 + seed)
    slots = torch.randperm(rows + 1, generator=g)[:rows].add(1).tolist()  # distinct, shuffled running slots
    contexts = torch.randint(1, 60, (rows,), generator=g).tolist()
    specs = [
        SeqSpec([5], ctx, list(range(1 + 4 * r, 5 + 4 * r)), state_slot=s)
        for r, (ctx, s) in enumerate(zip(contexts, slots))
    ]
    batch = build_forward_batch(
        specs, block_size=BLOCK, chunk_size=lm.config.ssm_chunk_size, with_attention=lm.config.has_attention,
        with_ssm=True,
    )  # fmt: skip
    assert batch.ssm is not None and batch.ssm.plain_decode
    hidden = torch.randn(rows, lm.config.hidden_size, generator=g)
    outs, states = [], []
    for fast in (True, False):
        caches = _random_caches(lm.config, rows + 1, seed)
        st = caches.state[layer]
        with torch.inference_mode():
            if fast:
                y = mamba2_decode(mixer, hidden, batch, st.conv_state, st.ssm_state, caches.slot_positions)
            else:
                y = mixer.forward_ref(hidden, batch, st.conv_state, st.ssm_state, caches.slot_positions)
        outs.append(y)
        states.append((st.conv_state.clone(), st.ssm_state.clone(), caches.slot_positions.clone()))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[0][0], states[1][0], rtol=0, atol=0)  # the rolled window: a copy
    torch.testing.assert_close(states[0][1], states[1][1], rtol=1e-5, atol=1e-5)
    assert torch.equal(states[0][2], states[1][2])
    assert states[0][2][slots].tolist() == [c + 1 for c in contexts]


def test_plain_decode_flag() -> None:
    """Only one-token rows that continue their slot, with no padding row and no checkpoint, are plain."""

    def plain(specs: list[SeqSpec]) -> bool:
        b = build_forward_batch(specs, block_size=BLOCK, chunk_size=32, with_attention=False, with_ssm=True)
        assert b.ssm is not None
        return b.ssm.plain_decode

    assert plain([SeqSpec([1], 4, state_slot=1), SeqSpec([2], 9, state_slot=2)])
    assert not plain([SeqSpec([1, 2], 4, state_slot=1)])  # two tokens
    assert not plain([SeqSpec([1], 0, state_slot=1)])  # a one-token prompt: no initial state
    assert not plain([SeqSpec([1], 4, state_slot=1, checkpoints=[(5, 3)])])  # a checkpoint
    assert not plain([SeqSpec([1], 4, state_slot=1), SeqSpec([0], 0, padding=True)])  # a padding row
