"""Every family whose attention layers prepare q/k through layers/qk_rope.py, with the fused kernel (Triton's
rope_qk) against the module ops, model-wide: a prefill and two decode steps of a tiny random checkpoint through
the torch kernel set with and without `rope_qk` (nothing else differs), final hidden states compared, and the
kernel seen to run. Families: Attention's (Bamba, Falcon-H1, LFM2 / LFM3 with per-head norms and proportional
RoPE, MiniMax, RecurrentGemma's partial RoPE, Zamba2's shared block), GatedAttention's (Qwen3.5 / Qwen3-Next,
OLMo-Hybrid's all-heads norms) and Zaya's CCA (RoPE after its own L2 norms).

The fused residual add + norm (Triton's add_rms_norm, models/residual_block.py) likewise, on the families whose
blocks are ResidualBlocks (plain and zero-centred norms, LFM3's sandwich, Nemotron-H's MLP-only layers, Granite's
residual multiplier, MiniMax's scaled post-norm residuals, xLSTM's norms, Zamba / Zamba2's Mamba layers): each
fused call takes the place of one add and one norm launch (counted).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from recap.backends.eager import TorchBackend
from recap.kernels.kernel_set import TORCH_KERNELS
from recap.kernels.metadata import SeqSpec
from recap.kernels.triton.add_rms_norm import add_rms_norm
from recap.kernels.triton.rms_norm import rms_norm
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


class _Launches(TorchDispatchMode):
    """Counts the aten adds dispatched, and the norm and add + norm kernels' calls (their insides not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.adds, self.norms, self.fused, self.inside = 0, 0, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.adds += not self.inside and func.overloadpacket is torch.ops.aten.add
        return func(*args, **(kwargs or {}))

    @contextmanager
    def kernel(self) -> Iterator[None]:
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


ADD_NORM_ARCHS = ["bamba", "granite_hybrid", "lfm3", "minimax", "nemotron_h", "qwen3_5", "recurrent_gemma", "xlstm",
                  "zamba", "zamba2"]  # fmt: skip
# Fused calls per step where fewer than one per layer: Zamba's hybrid layers norm h + the shared block's output, not
# the stream (the Mamba layer after the first one and the final norm fuse).
FUSED_PER_STEP = {"zamba": 2, "zamba2": 2}


@pytest.mark.parametrize("arch", ADD_NORM_ARCHS)
def test_a_family_with_fused_residual_norms_equals_its_module_ops(tmp_path: Path, arch: str) -> None:
    with torch.device("cpu"):
        path = make_tiny_checkpoint(arch, tmp_path / arch)
    model = load_model(path, linear_backend="torch", device=DEVICE).model

    def run(fused: bool) -> tuple[list[torch.Tensor], _Launches]:
        launches = _Launches()

        def norm(*args: Any, **kwargs: Any) -> Any:
            launches.norms += 1
            with launches.kernel():
                return rms_norm(*args, **kwargs)

        def add_norm(*args: Any, **kwargs: Any) -> Any:
            launches.fused += 1
            with launches.kernel():
                return add_rms_norm(*args, **kwargs)

        kernels = dataclasses.replace(TORCH_KERNELS, rms_norm=norm, add_rms_norm=add_norm if fused else None)
        with torch.no_grad(), launches:
            return _steps(model, TorchBackend(kernels=kernels)), launches

    want, unfused = run(False)
    got, fused = run(True)
    per_step = FUSED_PER_STEP.get(arch, model.config.num_layers)
    assert unfused.fused == 0 and fused.fused >= 3 * per_step, f"{arch}: {fused.fused} fused calls"
    assert unfused.adds - fused.adds == fused.fused, f"{arch}: each fused call replaces one add"
    assert unfused.norms - fused.norms == fused.fused, f"{arch}: each fused call replaces one norm"
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"{arch} step {step}")
