"""The ops one attention layer dispatches in a batch-1 decode step, per kernel set (a proxy for GPU launches).

    PYTHONPATH=. .venv/bin/python benchmarks/count_attention_ops.py [--archs qwen3_5 lfm3] [--prompt 20]

On a tiny random checkpoint of each family (model/testing.py), after a prefill of --prompt tokens, one decode
step runs through TorchBackend with each kernel set: "torch" (the module ops), "triton, no rope_qk" (the norms
fused, q/k preparation in module ops: the kernel set before rope_qk) and "triton" (q/k norms, RoPE, the gate
and the K/V cache store in one rope_qk launch). A TorchDispatchMode counts every aten op dispatched inside each
attention layer's forward; a Triton launch (under TRITON_INTERPRET=1 on a CPU, its grid call) counts as one
launch and the interpreter's own tensor traffic inside it is not counted. "launching" = compute ops + Triton
launches (views and empty allocations launch nothing on a GPU). Figures are per attention layer (identical
across layers).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from recap.backends.eager import TorchBackend  # noqa: E402
from recap.kernels.kernel_set import TORCH_KERNELS, KernelSet  # noqa: E402
from recap.kernels.metadata import SeqSpec  # noqa: E402
from recap.kernels.triton.kernel_set import TRITON_KERNELS  # noqa: E402
from recap.model.cache import ModelCaches  # noqa: E402
from recap.model.layers.qk_rope import QKRope  # noqa: E402
from recap.model.loader import load_model  # noqa: E402
from recap.model.testing import forward_step, make_tiny_checkpoint  # noqa: E402

NO_LAUNCH = {"empty.memory_format", "empty_strided.default", "empty_like.default"}


class OpCounter(TorchDispatchMode):
    """Counts aten ops while `active`, and Triton grid calls as launches (their insides not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.active, self.in_triton = False, False
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if self.active and not self.in_triton:
            kind = "alloc" if func.__name__ in NO_LAUNCH else "view" if _aliases(func, args, out) else "op"
            self.ops[f"{kind} {func.__name__}"] += 1
        return out


def _aliases(func: Any, args: tuple[Any, ...], out: Any) -> bool:
    """Whether a view op returned a view of its input (`to` to another dtype is a view op that copies)."""
    first = args[0] if args else None
    if not func.is_view or not isinstance(out, torch.Tensor) or not isinstance(first, torch.Tensor):
        return bool(func.is_view)
    return out.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()


def count_triton(counter: OpCounter) -> Any:
    """Wrap the interpreter's grid call: one launch each, its own torch ops hidden. Returns the original."""
    original = interpreter.GridExecutor.__call__

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if counter.active and not counter.in_triton:
            counter.ops[f"triton {self.fn.__name__}"] += 1
        outer, counter.in_triton = counter.in_triton, True
        try:
            return original(self, *args, **kwargs)
        finally:
            counter.in_triton = outer

    interpreter.GridExecutor.__call__ = call  # type: ignore[method-assign]
    return original


def count_decode(path: Path, kernels: KernelSet, prompt: int) -> tuple[Counter[str], int]:
    """(ops of one attention layer in a decode step, attention layers) through TorchBackend(kernels)."""
    model = load_model(path, linear_backend="torch").model
    backend = TorchBackend(kernels=kernels)
    backend.prepare(model)
    caches = ModelCaches.allocate(model.config, 8, 16, 2, model.dtype, num_window_blocks=8)
    tokens = list(range(3, 3 + prompt))
    forward_step(model, caches, [SeqSpec(tokens, context_len=0, block_ids=[1, 2, 3], state_slot=1)], backend)
    layers = [m for m in model.modules() if isinstance(m, QKRope)]
    counter = OpCounter()
    original = count_triton(counter)
    hooks = [h for m in layers[:1] for h in (
        m.register_forward_pre_hook(lambda *_: setattr(counter, "active", True)),
        m.register_forward_hook(lambda *_: setattr(counter, "active", False)))]  # fmt: skip
    try:
        with counter, torch.no_grad():
            spec = SeqSpec([7], context_len=prompt, block_ids=[1, 2, 3], state_slot=1)
            forward_step(model, caches, [spec], backend)
    finally:
        interpreter.GridExecutor.__call__ = original  # type: ignore[method-assign]
        for h in hooks:
            h.remove()
    return counter.ops, len(layers)


def launching(ops: Counter[str]) -> int:
    """The compute ops and Triton launches of a count (what launches a kernel on a GPU)."""
    return sum(c for k, c in ops.items() if k.split()[0] in ("op", "triton"))


def each_model_and_set(doc: str, default_archs: list[str], sets: dict[str, KernelSet],
                       **extra: Any) -> Iterator[tuple[argparse.Namespace, str, Path, str, KernelSet]]:
    """The counters' command line (--archs, --prompt, and `extra` flags: name -> argparse kwargs), then each tiny
    checkpoint of --archs with each kernel set of `sets` (1 torch thread)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", nargs="+", default=default_archs)
    ap.add_argument("--prompt", type=int, default=20)
    for flag, kwargs in extra.items():
        ap.add_argument(flag, **kwargs)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs:
            path = make_tiny_checkpoint(arch, Path(tmp) / arch)
            for name, kernels in sets.items():
                yield args, arch, path, name, kernels


def main() -> None:
    sets = {"torch": TORCH_KERNELS, "triton, no rope_qk": dataclasses.replace(TRITON_KERNELS, rope_qk=None),
            "triton": TRITON_KERNELS}  # fmt: skip
    for args, arch, path, name, kernels in each_model_and_set(__doc__, ["qwen3_5", "lfm3"], sets):
        ops, n = count_decode(path, kernels, args.prompt)
        print(f"{arch} ({n} attention layers), {name}: {sum(ops.values())} ops, {launching(ops)} launching")
        print("   ", ", ".join(f"{k} x{c}" if c > 1 else k for k, c in sorted(ops.items())))

if __name__ == "__main__":
    main()
