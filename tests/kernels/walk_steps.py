"""Random packed steps and their checks, shared by the native prefill walks' tests (test_gdn_walk.py,
test_ssd_walk.py): a step's rows with random context lengths, padding rows and checkpoints; the fast and the slow op
run from the same random slots; outputs, every slot's state and slot_positions compared, the slots the step does not
write bit for bit unchanged, padding rows' outputs zero."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import SeqSpec, SSMMetadata

SLOTS = 24


def random_step(rnd: random.Random, chunk_size: int, rows: int, max_len: int = 70,
                block_checkpoints: bool = False) -> tuple[SSMMetadata, set[int]]:  # fmt: skip
    """A packed step of `rows` rows (some padding) with random context lengths and up to 3 checkpoints anywhere
    (and up to 2 at 16-token block boundaries with `block_checkpoints`); the slots it writes (running and checkpoint
    slots of its valid rows)."""
    free = list(range(1, SLOTS))
    rnd.shuffle(free)
    specs, written = [], set()
    for _ in range(rows):
        n, ctx = rnd.randint(1, max_len), rnd.choice([0, 0, rnd.randint(1, 100)])
        if rnd.random() < 0.2:
            specs.append(SeqSpec([0] * n, ctx, state_slot=PAD_SLOT_ID, padding=True))
            continue
        slot = free.pop()
        cuts = set(rnd.sample(range(ctx + 1, ctx + n + 1), min(n, rnd.randint(0, 3))))
        if block_checkpoints:
            blocks = list(range((ctx // 16 + 1) * 16, ctx + n + 1, 16))
            cuts |= set(rnd.sample(blocks, min(len(blocks), rnd.randint(0, 2))))
        cps = [(p, free.pop()) for p in sorted(cuts)]
        specs.append(SeqSpec([0] * n, ctx, state_slot=slot, checkpoints=cps))
        written |= {slot, *(s for _, s in cps)}
    fb = build_forward_batch(specs, block_size=16, chunk_size=chunk_size, with_attention=False, with_ssm=True)
    assert fb.ssm is not None
    return fb.ssm, written


def run_both(fast: Callable[..., torch.Tensor], slow: Callable[..., torch.Tensor], args: tuple, meta: SSMMetadata,
             state_shape: tuple[int, ...], scale: float, gen: torch.Generator, **kw: object) -> tuple:  # fmt: skip
    """(fast's y, state, slot_positions), (slow's), the state before and the positions before, both ops run from the
    same random slots (SLOTS of state_shape, normal times `scale`)."""
    before = torch.randn(SLOTS, *state_shape, generator=gen) * scale
    pos = torch.randint(0, 50, (SLOTS,), generator=gen)
    out = []
    for fn in (fast, slow):
        s, p = before.clone(), pos.clone()
        out.append((fn(*args, s, meta, p, **kw), s, p))
    return out[0], out[1], before, pos


def assert_step(fast: tuple, slow: tuple, before: torch.Tensor, pos: torch.Tensor, written: set[int],
                meta: SSMMetadata, tol: float = 2e-5) -> None:  # fmt: skip
    (y, s, p), (y_ref, s_ref, p_ref) = fast, slow
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(s, s_ref, rtol=tol, atol=tol)
    assert torch.equal(p, p_ref)
    untouched = [i for i in range(SLOTS) if i not in written]
    assert torch.equal(s[untouched], before[untouched]) and torch.equal(p[untouched], pos[untouched])
    qsl = meta.query_start_loc_list
    for r in (meta.state_indices == PAD_SLOT_ID).nonzero().flatten().tolist():  # padding rows output zeros
        assert not y[qsl[r] : qsl[r + 1]].any()
