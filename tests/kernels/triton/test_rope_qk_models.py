"""Every family whose attention layers prepare q/k through layers/qk_rope.py, with the fused kernel (Triton's
rope_qk) against the module ops, model-wide: a prefill and two decode steps of a tiny random checkpoint through
the torch kernel set with and without `rope_qk` (nothing else differs), final hidden states compared, and the
kernel seen to run. Families: Attention's (Bamba, Falcon-H1, LFM2 / LFM3 with per-head norms and proportional
RoPE, MiniMax, RecurrentGemma's partial RoPE, Zamba2's shared block), GatedAttention's (Qwen3.5 / Qwen3-Next,
OLMo-Hybrid's all-heads norms) and Zaya's CCA (RoPE after its own L2 norms)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from recap.backends.eager import TorchBackend
from recap.kernels.kernel_set import TORCH_KERNELS
from recap.kernels.metadata import SeqSpec
from recap.kernels.triton.rope_qk import rope_qk
from recap.model.cache import ModelCaches
from recap.model.loader import load_model
from recap.model.testing import forward_step, make_tiny_checkpoint

from .device_rows import DEVICE

ARCHS = ["bamba", "falcon_h1", "lfm2", "lfm3", "minimax", "olmo_hybrid", "qwen3_5", "qwen3_next", "recurrent_gemma",
         "zamba2", "zaya"]  # fmt: skip
PROMPT = 21  # odd, past a 16-token block


def _steps(model: Any, backend: TorchBackend) -> list[torch.Tensor]:
    """Final hidden states of a prefill and two decode steps of one sequence through `backend`."""
    backend.prepare(model)
    caches = ModelCaches.allocate(model.config, 6, 16, 2, model.dtype, num_window_blocks=6)
    tokens, out = [(7 * i + 3) % 500 for i in range(PROMPT + 2)], []
    for start, end in ((0, PROMPT), (PROMPT, PROMPT + 1), (PROMPT + 1, PROMPT + 2)):
        spec = SeqSpec(tokens[start:end], context_len=start, block_ids=[1, 2, 3], state_slot=1)
        out.append(forward_step(model, caches, [spec], backend)[0])
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_a_family_with_fused_qk_preparation_equals_its_module_ops(tmp_path: Path, arch: str) -> None:
    with torch.device("cpu"):  # transformers builds the checkpoint on the host
        path = make_tiny_checkpoint(arch, tmp_path / arch)
    model = load_model(path, linear_backend="torch", device=DEVICE).model
    calls = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return rope_qk(*args, **kwargs)

    with torch.no_grad():
        want = _steps(model, TorchBackend())
        got = _steps(model, TorchBackend(kernels=dataclasses.replace(TORCH_KERNELS, rope_qk=counted)))
    assert calls, f"{arch}: no attention layer ran the fused kernel"
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=f"{arch} step {step}")
