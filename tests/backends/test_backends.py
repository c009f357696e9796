"""The backend seam: the model package knows no backend, the loaded model's flags pick one, the runner owns
and runs it."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import recap.model
from recap.backends import CpuBackend, CudaBackend, TorchBackend, backend_for
from recap.backends.decode_graph import DecodeGraph
from recap.config import CacheConfig, SchedulerConfig
from recap.core.output import ScheduledRequest, SchedulerOutput
from recap.kernels.kernel_set import TORCH_KERNELS
from recap.kernels.linear_rows import linear_rows_available
from recap.model.layers.linear import Linear
from recap.model.loader import load_model
from recap.runner.model_runner import ModelRunner, RunnerConfig

MODEL_DIR = Path(recap.model.__file__).parent

IMPORT_ALL = """
import importlib, pkgutil, sys
import recap.model
names = [m.name for m in pkgutil.walk_packages(recap.model.__path__, "recap.model.")]
for name in names:
    importlib.import_module(name)
assert not [m for m in sys.modules if m.startswith("recap.backends")], "recap.backends imported by recap.model"
print(len(names))
"""


def _imports(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):  # module level and inside functions alike
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            found.add(node.module)
    return found


def test_the_model_package_imports_nothing_from_the_backends() -> None:
    """The seam points one way: backends drive the model through its public protocols, never the reverse."""
    files = sorted(MODEL_DIR.rglob("*.py"))
    assert len(files) >= 30
    for f in files:
        bad = sorted(m for m in _imports(ast.parse(f.read_text())) if m == "recap.backends" or
                     m.startswith(("recap.backends.", "recap.runner", "recap.engine")))  # fmt: skip
        assert not bad, f"{f.relative_to(MODEL_DIR.parent)} imports {bad}"
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True,
                          cwd=MODEL_DIR.parents[1])  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) >= 30  # every module was imported


def test_the_loaded_flags_pick_the_backend(tiny_checkpoint: Callable[[str], Path]) -> None:
    path = tiny_checkpoint("mamba2")
    assert type(backend_for(load_model(path, native_decode=False))) is TorchBackend
    eager = backend_for(load_model(path, linear_backend="torch"))  # the reference linears take no native kernels
    assert type(eager) is TorchBackend and eager.linear_backend == "torch" and eager.kernels is TORCH_KERNELS
    # Off the CPU fast path's ground the module path runs with the given kernels: another kernel set on a CPU, a
    # GPU with --enforce-eager; a GPU otherwise replays decode steps from CUDA graphs (backends/cuda.py).
    triton_set = dataclasses.replace(TORCH_KERNELS, name="triton")
    cases = (("cpu", True, TorchBackend), ("cuda", False, TorchBackend), ("cuda", True, CudaBackend))
    for device, native, want in cases:
        other = backend_for(load_model(path, native_decode=native), device, triton_set)
        assert type(other) is want and other.kernels is triton_set
    if linear_rows_available():
        fast = backend_for(load_model(path, quantization="int8"))
        assert isinstance(fast, CpuBackend) and fast.linear_backend == "int8"
    with pytest.raises(ValueError, match="linear backend"):
        TorchBackend("int3")


@pytest.mark.parametrize("native_decode", [True, False])
def test_the_runner_prepares_its_backend_and_runs_every_step_through_it(
    native_decode: bool, tiny_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner builds the backend from the loaded model, prepares the model, builds batches with the
    backend's kernel set, places the pools with its allocator and runs steps through its forward."""
    loaded = load_model(tiny_checkpoint("mamba2"), native_decode=native_decode)
    runner = ModelRunner(loaded, CacheConfig(), SchedulerConfig(max_num_seqs=2), RunnerConfig())
    backend = runner.backend
    fast = native_decode and linear_rows_available()
    assert isinstance(backend, CpuBackend) == fast and backend.serves(loaded.model)
    linears = [m for m in loaded.model.modules() if isinstance(m, Linear)]
    assert all(m.backend == loaded.linear_backend and m.impl.native == fast for m in linears)
    replays: list[int] = []
    real = DecodeGraph.run
    monkeypatch.setattr(DecodeGraph, "run", lambda self, b, c: (replays.append(b.num_seqs), real(self, b, c))[1])
    steps: list[object] = []
    forward = type(backend).forward
    monkeypatch.setattr(type(backend), "forward",
                        lambda self, m, b, c: (steps.append(b.kernels), forward(self, m, b, c))[1])  # fmt: skip
    prompt, blocks = list(range(3, 20)), [1, 2]
    req = ScheduledRequest(request_id="a", token_ids=prompt, num_computed_tokens=0, block_ids=blocks, state_slot=1,
                           prompt_token_ids=prompt, sample=True)  # fmt: skip
    out = runner.execute(SchedulerOutput(step=0, scheduled=[req]))
    token = out.sampled_token_ids["a"]
    req = ScheduledRequest(request_id="a", token_ids=[token], num_computed_tokens=len(prompt), block_ids=blocks,
                           state_slot=1, prompt_token_ids=prompt, output_token_ids=[token], sample=True)  # fmt: skip
    runner.execute(SchedulerOutput(step=0, scheduled=[req]))
    assert steps == [backend.kernels, backend.kernels]
    assert replays == ([1] if fast else [])  # the decode step replayed its graph on the CPU backend
    assert torch.equal(runner.caches.slot_positions[1], torch.tensor(len(prompt) + 1))
