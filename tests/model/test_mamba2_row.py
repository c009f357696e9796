"""mamba2_row (the compiled batch-1 Mamba2 decode, layers/mamba2_row.py) and its reference against the mixer's
general path (Mamba2Mixer.forward_ref): output, conv and SSM states, slot positions, on random states."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from recap.kernels.metadata import SeqSpec, build_forward_batch
from recap.model.cache import ModelCaches
from recap.model.layers.mamba2 import Mamba2Mixer
from recap.model.layers.mamba2_row import mamba2_row, mamba2_row_ref, mixer_row_args, row_supported
from recap.model.loader import load_model

BLOCK = 16


def _mixers(path: Path) -> list[tuple[int, Mamba2Mixer]]:
    lm = load_model(path)
    found = []
    for i, block in enumerate(lm.model.blocks()):
        found += [(i, m) for m in block.modules() if isinstance(m, Mamba2Mixer)]
    return found


def _caches(lm_config, seed: int) -> ModelCaches:  # noqa: ANN001
    caches = ModelCaches.allocate(lm_config, 9, BLOCK, 4, torch.float32)
    g = torch.Generator().manual_seed(seed)
    for st in caches.state.values():
        st["conv"].copy_(torch.randn(st["conv"].shape, generator=g))
        st["ssm"].copy_(torch.randn(st["ssm"].shape, generator=g) * 0.5)
    return caches


# Compiling mamba2_row takes 30-50 s on 2 shared cores (the on-disk cache did not shorten it): run on request.
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mamba2", "bamba", "granite_hybrid", "zamba2"])
@pytest.mark.parametrize("seed", [0, 1])
def test_compiled_row_matches_general_path(arch: str, seed: int, tiny_checkpoint: Callable[[str], Path]) -> None:
    lm = load_model(tiny_checkpoint(arch))
    layer, mixer = next((i, m) for i, b in enumerate(lm.model.blocks()) for m in b.modules()
                        if isinstance(m, Mamba2Mixer))  # fmt: skip
    assert row_supported(mixer)
    g = torch.Generator().manual_seed(seed)
    slot, ctx = seed + 2, int(torch.randint(1, 60, (1,), generator=g))
    spec = SeqSpec([5], ctx, [1, 2, 3, 4], state_slot=slot)
    batch = build_forward_batch([spec], block_size=BLOCK, chunk_size=lm.config.ssm_chunk_size,
                                with_attention=lm.config.has_attention, with_ssm=True)  # fmt: skip
    assert batch.ssm is not None and batch.ssm.plain_decode
    hidden = torch.randn(1, lm.config.hidden_size, generator=g)
    outs, states = [], []
    for compiled in (True, False):
        caches = _caches(lm.config, seed)
        conv, ssm = caches.state[layer]["conv"], caches.state[layer]["ssm"]
        mixer.set_compiled_row(compiled)
        if compiled and not mixer.compiled_row:
            pytest.skip("torch.compile cannot build mamba2_row here")
        with torch.inference_mode():
            fn = mixer.forward if compiled else mixer.forward_ref
            outs.append(fn(hidden, batch, caches.state[layer], caches.slot_positions) if compiled
                        else fn(hidden, batch, conv, ssm, caches.slot_positions))  # fmt: skip
        states.append((conv.clone(), ssm.clone(), caches.slot_positions.clone()))
    mixer.set_compiled_row(False)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(states[0][0], states[1][0], rtol=0, atol=0)  # the rolled window: a copy
    torch.testing.assert_close(states[0][1], states[1][1], rtol=1e-5, atol=1e-5)
    assert torch.equal(states[0][2], states[1][2]) and int(states[0][2][slot]) == ctx + 1


@pytest.mark.slow
def test_compiled_row_matches_its_reference(tiny_checkpoint: Callable[[str], Path]) -> None:
    """The compiled function against the same function run eagerly, on random slots and a time-step limit."""
    _, mixer = _mixers(tiny_checkpoint("bamba"))[0]
    mixer.set_compiled_row(True)
    if not mixer.compiled_row:
        pytest.skip("torch.compile cannot build mamba2_row here")
    c = mixer.cfg
    g = torch.Generator().manual_seed(7)
    conv = torch.randn(c.conv_dim, c.d_conv - 1, generator=g)
    ssm = torch.randn(c.n_groups, c.num_heads // c.n_groups, c.head_dim, c.d_state, generator=g)
    proj = torch.randn(1, c.in_proj_dim, generator=g)
    results = []
    for fn in (mamba2_row, mamba2_row_ref):
        args = list(mixer_row_args(mixer, proj, conv.clone(), ssm.clone()))
        args[-2:] = [torch.tensor(0.01), torch.tensor(0.3)]  # a time-step limit the clamp acts on
        with torch.inference_mode():
            results.append((fn(*args), args[1], args[2]))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_unsupported_options_keep_the_eager_path(tiny_checkpoint: Callable[[str], Path]) -> None:
    """Falcon-H1's default tiny config (in_proj multipliers, norm before gate) is not covered."""
    _, mixer = _mixers(tiny_checkpoint("falcon_h1"))[0]
    assert not row_supported(mixer)
    mixer.set_compiled_row(True)
    assert not mixer.compiled_row
