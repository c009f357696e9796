"""Model-level equivalences over the kernels: decode vs full forward, chunked vs one-shot prefill,
packed vs alone, checkpoint state vs prefix state, and inert padding rows."""

from __future__ import annotations

import random

import pytest
import torch

from recap.kernels.metadata import SeqSpec
from recap.model.cache import ModelCaches
from recap.model.testing import TINY_ARCHS, forward_step

ARCHS = tuple(TINY_ARCHS)
BLOCK = 16
BLOCKS_PER_SEQ = 8  # up to 128 tokens per sequence
RTOL = 1e-4  # of the logit scale; HF_NOTES measured path-vs-path gaps up to ~5e-5 of it


def _tokens(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _blocks(seq: int) -> list[int]:
    """Disjoint block tables per test sequence (block 0 is the null block)."""
    return list(range(1 + seq * BLOCKS_PER_SEQ, 1 + (seq + 1) * BLOCKS_PER_SEQ))


def _caches(cfg, slots: int = 8) -> ModelCaches:  # noqa: ANN001
    return ModelCaches.allocate(cfg, 1 + 4 * BLOCKS_PER_SEQ, BLOCK, slots, torch.float32)


def _slot_state(caches: ModelCaches, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for t in caches.state_tensors()]


def _assert_close(a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> None:
    assert a.shape == b.shape
    err = (a - b).abs().max().item()
    assert err <= RTOL * max(scale, 1.0), err


def _assert_states_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        _assert_close(x, y, y.abs().max().item())


def _logits(lm, hidden: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    return lm.model.compute_logits(hidden)


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_equals_full_forward(arch, tiny_model, tiny_backend) -> None:  # noqa: ANN001
    lm, backend = tiny_model(arch), tiny_backend(arch)
    ids = _tokens(lm.config.vocab_size, 45, seed=2)
    prompt = 20
    full, _ = forward_step(lm.model, _caches(lm.config), [SeqSpec(ids, 0, _blocks(0), state_slot=1)], backend)
    ref = _logits(lm, full)
    caches = _caches(lm.config)
    hidden, _ = forward_step(lm.model, caches, [SeqSpec(ids[:prompt], 0, _blocks(0), state_slot=1)], backend)
    got = [_logits(lm, hidden[-1:])]
    for pos in range(prompt, len(ids)):
        spec = SeqSpec(ids[pos : pos + 1], pos, _blocks(0), state_slot=1)
        hidden, batch = forward_step(lm.model, caches, [spec], backend)
        assert batch.ssm is None or batch.ssm.is_decode
        got.append(_logits(lm, hidden))
    _assert_close(torch.cat(got), ref[prompt - 1 :], ref.abs().max().item())


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_equals_one_shot(arch, tiny_model, tiny_backend) -> None:  # noqa: ANN001
    lm, backend = tiny_model(arch), tiny_backend(arch)
    n = 75  # crosses the 32-token SSD chunk grid and several KV blocks
    ids = _tokens(lm.config.vocab_size, n, seed=3)
    one = _caches(lm.config)
    ref_hidden, _ = forward_step(lm.model, one, [SeqSpec(ids, 0, _blocks(0), state_slot=1)], backend)
    ref = _logits(lm, ref_hidden)
    rng = random.Random(arch)
    # [31]: a first chunk of one token (it completes the 32-grid cell); [5, 6]: a one-token (decode) step.
    for cuts in ([31], [5, 6, 40], sorted(rng.sample(range(1, n), 3)), sorted(rng.sample(range(1, n), 4))):
        caches = _caches(lm.config)
        parts = []
        for lo, hi in zip([0, *cuts], [*cuts, n]):
            hidden, _ = forward_step(lm.model, caches, [SeqSpec(ids[lo:hi], lo, _blocks(0), state_slot=1)], backend)
            parts.append(hidden)
        _assert_close(_logits(lm, torch.cat(parts)), ref, ref.abs().max().item())
        _assert_states_close(_slot_state(caches, 1), _slot_state(one, 1))
        assert caches.slot_positions[1].item() == (n if lm.config.has_ssm else -1)


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_batch_equals_each_alone(arch, tiny_model, tiny_backend) -> None:  # noqa: ANN001
    lm, backend = tiny_model(arch), tiny_backend(arch)
    v = lm.config.vocab_size
    a, b, c_prefix, c_new = _tokens(v, 37, 4), _tokens(v, 5, 5), _tokens(v, 20, 6), _tokens(v, 13, 7)
    specs = [
        SeqSpec(a, 0, _blocks(0), state_slot=1),
        SeqSpec(b, 0, _blocks(1), state_slot=2),
        SeqSpec(c_new, 20, _blocks(2), state_slot=3),
    ]
    packed = _caches(lm.config)
    forward_step(lm.model, packed, [SeqSpec(c_prefix, 0, _blocks(2), state_slot=3)], backend)
    hidden, batch = forward_step(lm.model, packed, specs, backend)
    qsl = batch.query_start_loc.tolist()
    for row, spec in enumerate(specs):
        alone = _caches(lm.config)
        if spec.context_len:
            forward_step(lm.model, alone, [SeqSpec(c_prefix, 0, spec.block_ids, state_slot=spec.state_slot)], backend)
        h, _ = forward_step(lm.model, alone, [spec], backend)
        ref = _logits(lm, h)
        _assert_close(_logits(lm, hidden[qsl[row] : qsl[row + 1]]), ref, ref.abs().max().item())
        _assert_states_close(_slot_state(packed, spec.state_slot), _slot_state(alone, spec.state_slot))


@pytest.mark.parametrize("arch", ["mamba", "jamba", "mamba2", "bamba"])
def test_checkpoint_state_equals_prefix_state(arch, tiny_model, tiny_backend) -> None:  # noqa: ANN001
    lm, backend = tiny_model(arch), tiny_backend(arch)
    ids = _tokens(lm.config.vocab_size, 50, seed=8)
    caches = _caches(lm.config)
    spec = SeqSpec(ids, 0, _blocks(0), state_slot=1, checkpoints=[(16, 4), (40, 5)])
    _, batch = forward_step(lm.model, caches, [spec], backend)
    assert batch.planned_checkpoints == [(0, 16, 4), (0, 40, 5)]
    for pos, slot in ((16, 4), (40, 5)):
        assert caches.slot_positions[slot].item() == pos
        prefix = _caches(lm.config)
        forward_step(lm.model, prefix, [SeqSpec(ids[:pos], 0, _blocks(0), state_slot=2)], backend)
        _assert_states_close(_slot_state(caches, slot), _slot_state(prefix, 2))
    # A checkpoint planned on a decode step is the running state after that token, bit for bit.
    spec = SeqSpec(ids[:1], 50, _blocks(0), state_slot=1, checkpoints=[(51, 6)])
    _, batch = forward_step(lm.model, caches, [spec], backend)
    assert batch.ssm is not None and batch.ssm.is_decode
    assert caches.slot_positions[6].item() == 51 and caches.slot_positions[1].item() == 51
    for x, y in zip(_slot_state(caches, 6), _slot_state(caches, 1), strict=True):
        assert torch.equal(x, y)


def _randomize(caches: ModelCaches) -> None:
    g = torch.Generator().manual_seed(0)
    for t in [*caches.state_tensors(), *(c.k_cache for c in caches.kv.values()),
              *(c.v_cache for c in caches.kv.values())]:  # fmt: skip
        t.copy_(torch.randn(t.shape, generator=g))
    caches.slot_positions.fill_(7)


def _snapshot(caches: ModelCaches) -> dict[str, torch.Tensor]:
    snap = {"pos": caches.slot_positions.clone()}
    for name, t in caches.named_state_tensors():
        snap[f"state.{name}"] = t.clone()
    for i, c in caches.kv.items():
        snap[f"k{i}"], snap[f"v{i}"] = c.k_cache.clone(), c.v_cache.clone()
    return snap


@pytest.mark.parametrize("arch", ["jamba", "bamba"])
@pytest.mark.parametrize("decode", [False, True])
def test_padding_rows_are_inert(arch, decode, tiny_model, tiny_backend) -> None:  # noqa: ANN001
    lm, backend = tiny_model(arch), tiny_backend(arch)
    v = lm.config.vocab_size
    n = 1 if decode else 9
    real = [SeqSpec(_tokens(v, n, 9), 20, _blocks(0), state_slot=1),
            SeqSpec(_tokens(v, n, 10), 5, _blocks(1), state_slot=2)]  # fmt: skip
    pad = SeqSpec([0] * n, padding=True)
    caches = _caches(lm.config)
    _randomize(caches)
    before = _snapshot(caches)
    hidden, batch = forward_step(lm.model, caches, [real[0], pad, real[1]], backend)
    after = _snapshot(caches)
    untouched_slots = [s for s in range(caches.num_state_slots) if s not in (1, 2)]
    for key in before:
        if key.startswith(("state.", "pos")):
            assert torch.equal(before[key][untouched_slots], after[key][untouched_slots]), key
        else:  # only the real rows' blocks may change
            others = [b for b in range(caches.num_kv_blocks) if b not in (*_blocks(0), *_blocks(1))]
            assert torch.equal(before[key][others], after[key][others]), key
    # The real rows compute what they compute without the padding row.
    alone = _caches(lm.config)
    _randomize(alone)
    ref, ref_batch = forward_step(lm.model, alone, real, backend)
    qsl, rqsl = batch.query_start_loc.tolist(), ref_batch.query_start_loc.tolist()
    for row, rrow in ((0, 0), (2, 1)):
        _assert_close(hidden[qsl[row] : qsl[row + 1]], ref[rqsl[rrow] : rqsl[rrow + 1]], ref.abs().max().item())
    assert batch.sample_rows == [0, 2]


@pytest.mark.parametrize("arch", ["mamba", "bamba"])
def test_one_token_prompt_ignores_stale_slot(arch, tiny_model, tiny_backend) -> None:  # noqa: ANN001
    """A one-token prompt is a decode-shaped step with no context: it must not read its slot's old state."""
    lm, backend = tiny_model(arch), tiny_backend(arch)
    spec = SeqSpec([5], 0, _blocks(0), state_slot=1)
    fresh = _caches(lm.config)
    ref, _ = forward_step(lm.model, fresh, [spec], backend)
    stale = _caches(lm.config)
    _randomize(stale)
    got, batch = forward_step(lm.model, stale, [spec], backend)
    assert batch.ssm is not None and batch.ssm.is_decode
    assert torch.equal(got, ref)
    _assert_states_close(_slot_state(stale, 1), _slot_state(fresh, 1))
