"""mamba2_decode (the plain-decode fast path) against Mamba2Mixer.forward_ref: outputs, conv and SSM states,
slot positions, on random hidden states and random slot contents; across the families' Mamba2 options
(Falcon-H1's multipliers and gate orders, Granite, Zamba2), and the reference fallback for what the fast
path does not implement (a conv activation other than silu)."""

from __future__ import annotations

import pytest
import torch

from recap.backends import prepare
from recap.kernels.batch import build_forward_batch
from recap.kernels.mamba2_step import mamba2_step_available
from recap.kernels.metadata import SeqSpec
from recap.model.cache import ModelCaches
from recap.model.layers.mamba2 import Mamba2Mixer
from recap.model.layers.mamba2_decode import mamba2_decode
from recap.model.loader import LoadedModel, load_model
from recap.model.testing import forward_step, make_tiny_checkpoint

BLOCK = 16


def _mixer_and_layer(lm: LoadedModel) -> tuple[Mamba2Mixer, int]:
    """The first Mamba2 mixer and its layer, wherever the family's block keeps it (mixer, mamba, mamba_decoder)."""
    for i, block in enumerate(lm.model.blocks()):
        mixer = next((m for m in block.modules() if isinstance(m, Mamba2Mixer)), None)
        if mixer is not None:
            return mixer, i
    raise AssertionError("no Mamba2 layer")


def _random_caches(cfg, slots: int, seed: int) -> ModelCaches:  # noqa: ANN001
    caches = ModelCaches.allocate(cfg, 1 + 4 * slots, BLOCK, slots + 2, torch.float32)
    g = torch.Generator().manual_seed(seed)
    for st in caches.state.values():
        st["conv"].copy_(torch.randn(st["conv"].shape, generator=g))
        st["ssm"].copy_(torch.randn(st["ssm"].shape, generator=g) * 0.5)
    return caches


@pytest.fixture(scope="module")
def variant_model(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """(arch, overrides as a sorted item tuple) -> a loaded tiny checkpoint of that config variant."""
    loaded: dict[tuple, LoadedModel] = {}

    def get(arch: str, overrides: tuple = ()) -> LoadedModel:
        key = (arch, overrides)
        if key not in loaded:
            path = make_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch), seed=3, **dict(overrides))
            loaded[key] = load_model(path)
            prepare(loaded[key])  # the linear layers of the backend its flags ask for, as a runner runs them
        return loaded[key]

    return get


# Families and config variants whose Mamba2 options the fast path follows (the default tiny falcon_h1 has
# input, in_proj and output multipliers and norm-before-gate; the variants the two other gate orders).
FAST_VARIANTS = [
    ("mamba2", ()), ("bamba", ()), ("granite_hybrid", ()), ("zamba2", ()), ("falcon_h1", ()),
    ("falcon_h1", (("mamba_norm_before_gate", False),)),
    ("falcon_h1", (("mamba_rms_norm", False), ("projectors_bias", True), ("mamba_proj_bias", True))),
]  # fmt: skip


@pytest.mark.parametrize(("arch", "overrides"), FAST_VARIANTS)
@pytest.mark.parametrize(("rows", "seed"), [(1, 0), (3, 1), (5, 2), (8, 3)])
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_mamba2_decode_matches_reference(arch, overrides, rows, seed, native, variant_model) -> None:  # noqa: ANN001
    """Both fast paths (the native kernel of kernels/mamba2_step.py and the torch ops) against forward_ref."""
    if native and not mamba2_step_available():
        pytest.skip("the native kernel cannot be built here (no C compiler)")
    lm = variant_model(arch, overrides)
    mixer, layer = _mixer_and_layer(lm)
    assert mixer.fast_decode
    mixer.set_native(native)
    assert (mixer.native_step is not None) == native
    g = torch.Generator().manual_seed(100 + seed)
    slots = torch.randperm(rows + 1, generator=g)[:rows].add(1).tolist()  # distinct, shuffled running slots
    contexts = torch.randint(1, 60, (rows,), generator=g).tolist()
    specs = [  # some rows' token completes a block: checkpoint slots rows + 2 + r
        SeqSpec([5], ctx, list(range(1 + 4 * r, 5 + 4 * r)), state_slot=s,
                checkpoints=[(ctx + 1, rows + 2 + r)] if r % 2 == seed % 2 else [])
        for r, (ctx, s) in enumerate(zip(contexts, slots))
    ]  # fmt: skip
    batch = build_forward_batch(
        specs, block_size=BLOCK, chunk_size=lm.config.ssm_chunk_size, with_attention=lm.config.has_attention,
        with_ssm=True,
    )  # fmt: skip
    assert batch.ssm is not None and batch.ssm.plain_decode and batch.planned_checkpoints
    hidden = torch.randn(rows, lm.config.hidden_size, generator=g)
    outs, states = [], []
    for fast in (True, False):
        caches = _random_caches(lm.config, 2 * rows + 1, seed)
        conv, ssm = caches.state[layer]["conv"], caches.state[layer]["ssm"]
        with torch.inference_mode():
            if fast:
                y = mamba2_decode(mixer, hidden, batch, conv, ssm, caches.slot_positions)
            else:
                y = mixer.forward_ref(hidden, batch, conv, ssm, caches.slot_positions)
        outs.append(y)
        states.append((conv.clone(), ssm.clone(), caches.slot_positions.clone()))
    mixer.set_native(True)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[0][0], states[1][0], rtol=0, atol=0)  # the rolled window: a copy
    torch.testing.assert_close(states[0][1], states[1][1], rtol=1e-5, atol=1e-5)
    assert torch.equal(states[0][2], states[1][2])
    assert states[0][2][slots].tolist() == [c + 1 for c in contexts]
    for row, position, dest in batch.planned_checkpoints:  # the new states, copied whole
        assert states[0][2][dest] == position == contexts[row] + 1
        assert torch.equal(states[0][0][dest], states[0][0][slots[row]])
        assert torch.equal(states[0][1][dest], states[0][1][slots[row]])


def test_plain_decode_flag() -> None:
    """Only one-token rows that continue their slot, with no padding row, are plain (checkpoints allowed)."""

    def plain(specs: list[SeqSpec]) -> bool:
        b = build_forward_batch(specs, block_size=BLOCK, chunk_size=32, with_attention=False, with_ssm=True)
        assert b.ssm is not None
        return b.ssm.plain_decode

    assert plain([SeqSpec([1], 4, state_slot=1), SeqSpec([2], 9, state_slot=2)])
    assert not plain([SeqSpec([1, 2], 4, state_slot=1)])  # two tokens
    assert not plain([SeqSpec([1], 0, state_slot=1)])  # a one-token prompt: no initial state
    assert plain([SeqSpec([1], 4, state_slot=1, checkpoints=[(5, 3)])])  # a checkpoint: copied after the step
    assert not plain([SeqSpec([1], 4, state_slot=1), SeqSpec([0], 0, padding=True)])  # a padding row


def _decode_vs_forward(lm: LoadedModel, spy: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of one full forward, logits of prompt + one decode step per token) for 29 tokens."""
    ids = torch.randint(0, lm.config.vocab_size, (29,), generator=torch.Generator().manual_seed(5)).tolist()
    blocks, prompt = [1, 2, 3], 11

    def caches() -> ModelCaches:
        return ModelCaches.allocate(lm.config, 4, BLOCK, 2, torch.float32)

    with torch.inference_mode():
        full, _ = forward_step(lm.model, caches(), [SeqSpec(ids, 0, blocks, state_slot=1)])
        ref = lm.model.compute_logits(full[prompt - 1 :])
        cache = caches()
        hidden, _ = forward_step(lm.model, cache, [SeqSpec(ids[:prompt], 0, blocks, state_slot=1)])
        got = [lm.model.compute_logits(hidden[-1:])]
        spy.clear()
        for pos in range(prompt, len(ids)):
            hidden, batch = forward_step(lm.model, cache, [SeqSpec(ids[pos : pos + 1], pos, blocks, state_slot=1)])
            assert batch.ssm is not None and batch.ssm.plain_decode
            got.append(lm.model.compute_logits(hidden))
    return torch.cat(got), ref


@pytest.mark.parametrize(("arch", "overrides", "fast"), [
    ("falcon_h1", (), True),
    ("falcon_h1", (("mamba_rms_norm", False),), True),
    ("granite_hybrid", (), True),
    ("bamba", (("hidden_act", "gelu"),), False),  # a gelu conv: the fast path does not fuse it
])  # fmt: skip
def test_model_decode_equals_forward_on_either_path(arch, overrides, fast, variant_model, monkeypatch) -> None:  # noqa: ANN001
    """Whole-model decode steps equal one full forward, and plain decode steps take the fast path exactly when
    the mixer's options allow it (else forward_ref)."""
    import recap.model.layers.mamba2 as mamba2_module

    lm = variant_model(arch, overrides)
    mixers = [m for m in lm.model.modules() if isinstance(m, Mamba2Mixer)]
    assert mixers and all(m.fast_decode == fast for m in mixers)
    spy: list[str] = []
    real = mamba2_module.mamba2_decode
    monkeypatch.setattr(mamba2_module, "mamba2_decode", lambda *a: spy.append("fast") or real(*a))
    got, ref = _decode_vs_forward(lm, spy)
    assert len(spy) == (18 * len(mixers) if fast else 0)
    err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert err <= 1e-4 * max(scale, 1.0), err
