"""The ops each block of a model dispatches in a batch-1 decode step, per kernel set (a proxy for GPU launches).

    PYTHONPATH=. .venv/bin/python benchmarks/count_block_ops.py [--archs qwen3_5 lfm3 nemotron_h] [--prompt 20]

As benchmarks/count_attention_ops.py (its OpCounter: aten ops dispatched, a Triton grid call under
TRITON_INTERPRET=1 one launch with its insides hidden; "launching" = compute ops + Triton launches), but over
whole blocks and the whole step: on a tiny random checkpoint of each family, after a prefill of --prompt tokens,
one decode step through TorchBackend with the kernel sets "torch", "triton, no add_rms_norm" (each residual add
a launch of its own before the norm it feeds: the Triton set before the fused add + norm) and "triton". A block
is counted from its entry (forward, or forward_residual where CausalLM.forward calls that) to its return, so the
previous block's pending residual add, fused into this block's input norm, counts here. Each layer kind shows
its last block (past the first block of the model, which has no pending add, a kind's blocks count the same);
"step" is the model's whole forward (embedding and final norm included).
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from count_attention_ops import OpCounter, count_triton, each_model_and_set, launching  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from recap.backends.eager import TorchBackend  # noqa: E402
from recap.kernels.kernel_set import TORCH_KERNELS, KernelSet  # noqa: E402
from recap.kernels.metadata import SeqSpec  # noqa: E402
from recap.kernels.triton.kernel_set import TRITON_KERNELS  # noqa: E402
from recap.model.cache import ModelCaches  # noqa: E402
from recap.model.loader import load_model  # noqa: E402
from recap.model.testing import forward_step  # noqa: E402


def _counted(counter: OpCounter, fn: Callable[..., Any], sink: list[Counter[str]]) -> Callable[..., Any]:
    """fn, its ops counted into a fresh Counter appended to `sink` (nested counts stay in the outer one too)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        before, was = Counter(counter.ops), counter.active
        counter.active = True
        try:
            return fn(*args, **kwargs)
        finally:
            counter.active = was
            sink.append(counter.ops - before)

    return call


def count_decode(path: Path, kernels: KernelSet, prompt: int) -> tuple[dict[str, Counter[str]], Counter[str]]:
    """({layer kind: ops of its last block in a decode step}, ops of the whole step) through TorchBackend."""
    model = load_model(path, linear_backend="torch").model
    backend = TorchBackend(kernels=kernels)
    backend.prepare(model)
    caches = ModelCaches.allocate(model.config, 8, 16, 2, model.dtype, num_window_blocks=8)
    forward_step(model, caches, [SeqSpec(list(range(3, 3 + prompt)), 0, [1, 2, 3], 1)], backend)
    counter, blocks, step = OpCounter(), [], []
    for block in model.blocks():  # an instance attribute shadows the method CausalLM.forward / __call__ reach
        name = "forward_residual" if hasattr(block, "forward_residual") else "forward"
        setattr(block, name, _counted(counter, getattr(block, name), blocks))
    original = count_triton(counter)
    try:
        with counter, torch.no_grad():
            spec = SeqSpec([7], context_len=prompt, block_ids=[1, 2, 3], state_slot=1)
            _counted(counter, forward_step, step)(model, caches, [spec], backend)
    finally:
        interpreter.GridExecutor.__call__ = original  # type: ignore[method-assign]
    kinds: dict[str, Counter[str]] = {}
    for kind, ops in zip(model.config.layer_types, blocks, strict=True):
        kinds[kind] = ops  # the last block of each kind: past the first, every block takes a pending add
    return kinds, step[0]


def main() -> None:
    sets = {"torch": TORCH_KERNELS, "triton, no add_rms_norm": dataclasses.replace(TRITON_KERNELS, add_rms_norm=None),
            "triton": TRITON_KERNELS}  # fmt: skip
    ops_flag = {"--ops": {"action": "store_true", "help": "list each block's ops"}}
    for args, arch, path, name, kernels in each_model_and_set(__doc__, ["qwen3_5", "lfm3", "nemotron_h"], sets,
                                                              **ops_flag):
        kinds, step = count_decode(path, kernels, args.prompt)
        per = ", ".join(f"{kind} block {launching(ops)}" for kind, ops in kinds.items())
        print(f"{arch}, {name}: launching ops: {per}; whole step {launching(step)}")
        for kind, ops in kinds.items() if args.ops else ():
            print(f"    {kind}:", ", ".join(f"{k} x{c}" if c > 1 else k for k, c in sorted(ops.items())))

if __name__ == "__main__":
    main()
