"""Whole models with int4 linear weights (kernels/linear_int4.py): decode equals the full forward, the decode
graph and the eager backend give the same tokens, and the logits stay near the fp32 model's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from recap.backends import CpuBackend, TorchBackend, prepare
from recap.kernels.metadata import SeqSpec
from recap.model.cache import ModelCaches
from recap.model.layers.int4_linear import Int4Linear
from recap.model.layers.linear import Int8Linear, Linear
from recap.model.loader import load_model
from recap.model.testing import forward_step, greedy_generate

BLOCK = 16


def _blocks() -> list[int]:
    return list(range(1, 9))


@pytest.mark.parametrize("quantization", ["int4", "int4_k"])  # int4_k: the super-block format
@pytest.mark.parametrize("arch", ["mamba2", "bamba"])
def test_int4_decode_equals_full_forward(arch: str, quantization: str, tiny_checkpoint: Callable[[str], Path]) -> None:
    """Each row's int4 product does not depend on how many rows a step has. Mamba2's decode and forward run the
    same fp32 arithmetic into the linears, so they agree as closely as fp32 does; Bamba's attention decode
    kernel rounds differently in fp32, and where that moves an activation across a rounding edge of its int8
    code, an output moves by one code step (~1% of the logit scale here; int8 does the same)."""
    lm = load_model(tiny_checkpoint(arch), quantization=quantization)
    backend = prepare(lm)
    head = lm.model.head()  # int8 under int4 by default (model/head_format.py; tests/model/test_head_quantization.py)
    assert isinstance(head.impl, Int8Linear)
    linears = [m for m in lm.model.modules() if isinstance(m, Linear) and m is not head]
    assert all(isinstance(m.impl, Int4Linear) for m in linears) and lm.linear_backend == quantization
    assert all(m.backend == quantization and m.impl.quantized.superblock == (quantization == "int4_k") for m in linears)
    cfg = lm.config
    ids = torch.randint(0, cfg.vocab_size, (45,), generator=torch.Generator().manual_seed(5)).tolist()
    prompt = 20

    def caches() -> ModelCaches:
        return ModelCaches.allocate(cfg, 9, BLOCK, 2, torch.float32)

    with torch.inference_mode():
        full, _ = forward_step(lm.model, caches(), [SeqSpec(ids, 0, _blocks(), state_slot=1)], backend)
        ref = lm.model.compute_logits(full)[prompt - 1 :]
        c = caches()
        hidden, _ = forward_step(lm.model, c, [SeqSpec(ids[:prompt], 0, _blocks(), state_slot=1)], backend)
        got = [lm.model.compute_logits(hidden[-1:])]
        for pos in range(prompt, len(ids)):
            hidden, _ = forward_step(lm.model, c, [SeqSpec(ids[pos : pos + 1], pos, _blocks(), state_slot=1)],
                                     backend)  # fmt: skip
            got.append(lm.model.compute_logits(hidden))
    err = (torch.cat(got) - ref).abs().max().item()
    tol = 1e-4 if arch == "mamba2" else 3e-2
    assert err <= tol * max(ref.abs().max().item(), 1.0), err


def test_int4_graph_eager_and_fp32_agree(tiny_checkpoint: Callable[[str], Path]) -> None:
    path = tiny_checkpoint("bamba")
    fast_lm, eager_lm = load_model(path, quantization="int4"), load_model(path, quantization="int4",
                                                                          native_decode=False)  # fmt: skip
    fast, eager = prepare(fast_lm), prepare(eager_lm)
    assert isinstance(fast, CpuBackend) and type(eager) is TorchBackend
    prompt = torch.randint(0, fast_lm.config.vocab_size, (19,), generator=torch.Generator().manual_seed(6)).tolist()
    out = greedy_generate(fast_lm.model, prompt, 10, backend=fast)
    assert greedy_generate(eager_lm.model, prompt, 10, backend=eager) == out
    fp32 = load_model(path)
    prepare(fp32)
    hidden = torch.randn(4, fp32.config.hidden_size, generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        want, got = fp32.model.compute_logits(hidden), fast_lm.model.compute_logits(hidden)
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < 0.15, rel  # the int8 head's error (int4 linears before it do not enter: same hidden)
