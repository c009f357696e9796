"""Inkling-2's dynamic short conv (static taps through the conv kernels + per-token taps over the windows read
from the state slot) equals its plain whole-sequence formula, transformers' (zero-padded windows, taps = static +
projected), when a sequence arrives in random chunks and decodes beside another row; and the window it leaves
in the slot is the last K - 1 inputs."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import SeqSpec
from recap.model.layers.inkling2 import DynamicShortConv

C, HID, HEADS, K = 8, 6, 2, 4


def _plain(y: torch.Tensor, stream: torch.Tensor, conv: DynamicShortConv) -> torch.Tensor:
    """transformers' Inkling2DynamicShortConvolution over one whole sequence y [S, C]."""
    s = y.shape[0]
    taps = (stream @ conv.weight_proj.t()).view(s, HEADS, 1, K)
    weights = conv.static_w.t().reshape(HEADS, -1, K) + taps  # (s, h, c/h, k): tap k = k tokens back
    ctx = torch.nn.functional.pad(y.t(), (K - 1, 0))  # (c, k - 1 + s)
    windows = ctx.unfold(-1, K, 1).flip(-1).transpose(0, 1).reshape(s, HEADS, -1, K)
    return ((windows * weights).sum(-1).reshape(s, C) + y) / (2 * K + 1) ** 0.5


@pytest.mark.parametrize("seed", range(4))
def test_chunks_and_decodes_equal_the_whole_sequence(seed: int) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    conv = DynamicShortConv(C, HID, HEADS, K, torch.float32, "k")
    with torch.no_grad():
        conv.static_w.copy_(torch.randn(K, C, generator=gen))
        conv.weight_proj.copy_(torch.randn(HEADS * K, HID, generator=gen) * 0.3)
    lengths = [rng.randint(1, 20), rng.randint(1, 20)]
    ys = [torch.randn(n, C, generator=gen) for n in lengths]
    streams = [torch.randn(n, HID, generator=gen) for n in lengths]
    state = torch.full((3, C, K - 1), torch.nan)  # slots 1 and 2; never-read content may be anything
    caches = SimpleNamespace(state={0: {"conv_k": state}}, slot_positions=None)
    done, outs = [0, 0], [[], []]  # type: ignore[var-annotated]
    while any(d < n for d, n in zip(done, lengths)):
        parts = [(r, done[r], min(lengths[r], done[r] + rng.choice([1, 1, rng.randint(1, 8)])))
                 for r in range(2) if done[r] < lengths[r]]  # fmt: skip
        specs = [SeqSpec([0] * (b - a), a, state_slot=r + 1) for r, a, b in parts]
        batch = build_forward_batch(specs, block_size=4, chunk_size=8, with_attention=False, with_ssm=True)
        y = torch.cat([ys[r][a:b] for r, a, b in parts])
        stream = torch.cat([streams[r][a:b] for r, a, b in parts])
        out = conv(y, batch, caches, 0, stream=stream)  # type: ignore[arg-type]
        offset = 0
        for r, a, b in parts:
            outs[r].append(out[offset : offset + b - a])
            offset, done[r] = offset + b - a, b
    for r in range(2):
        with torch.no_grad():
            torch.testing.assert_close(torch.cat(outs[r]), _plain(ys[r], streams[r], conv), rtol=1e-5, atol=1e-5)
        tail = torch.nn.functional.pad(ys[r].t(), (K - 1, 0))[:, -(K - 1):]
        torch.testing.assert_close(state[r + 1], tail, rtol=0, atol=0)
