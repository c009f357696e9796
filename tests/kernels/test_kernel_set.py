"""The kernel set: layers call the step's kernels, so a backend swaps every op without touching the model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from recap.kernels.batch import build_forward_batch
from recap.kernels.kernel_set import TORCH_KERNELS, KernelSet
from recap.kernels.metadata import SeqSpec
from recap.model.cache import ModelCaches
from recap.model.loader import load_model
from recap.model.testing import make_tiny_checkpoint


def test_every_op_is_callable_and_named() -> None:
    assert TORCH_KERNELS.name == "torch"
    for name in KernelSet.op_names():
        assert callable(getattr(TORCH_KERNELS, name)), name


def test_layers_call_the_batch_kernels(tmp_path: Path) -> None:
    """A kernel set that counts its calls sees every recurrent and attention op of a hybrid's forward."""
    loaded = load_model(make_tiny_checkpoint("nemotron_h", tmp_path / "m"), linear_backend="torch")
    model, config = loaded.model, loaded.config
    caches = ModelCaches.allocate(config, num_kv_blocks=8, block_size=16, num_state_slots=2, dtype=torch.float32)
    calls: list[str] = []

    def counted(name: str) -> Callable[..., Any]:
        fn = getattr(TORCH_KERNELS, name)
        return lambda *a, **k: (calls.append(name), fn(*a, **k))[1]

    counting = dataclasses.replace(TORCH_KERNELS, name="counting", **{n: counted(n) for n in KernelSet.op_names()})
    spec = SeqSpec(token_ids=list(range(5, 25)), block_ids=[1, 2], state_slot=0)
    kw = dict(block_size=16, chunk_size=config.ssm_chunk_size, with_attention=True, with_ssm=True)
    ref = model(build_forward_batch([spec], **kw), caches)
    caches2 = ModelCaches.allocate(config, num_kv_blocks=8, block_size=16, num_state_slots=2, dtype=torch.float32)
    out = model(build_forward_batch([spec], kernels=counting, **kw), caches2)
    assert torch.equal(ref, out)
    assert {"ssd", "causal_conv1d", "paged_attention"} <= set(calls)


def test_indexed_mla_calls_the_batch_kernels(tmp_path: Path) -> None:
    """GLM-5.3-Flash's indexer and sparse attention go through the step's kernel set too."""
    loaded = load_model(make_tiny_checkpoint("glm5_next", tmp_path / "m"), linear_backend="torch")
    calls: list[str] = []

    def counted(name: str) -> Callable[..., Any]:
        fn = getattr(TORCH_KERNELS, name)
        return lambda *a, **k: (calls.append(name), fn(*a, **k))[1]

    counting = dataclasses.replace(TORCH_KERNELS, name="counting", **{n: counted(n) for n in KernelSet.op_names()})
    caches = ModelCaches.allocate(loaded.config, num_kv_blocks=8, block_size=16, num_state_slots=2,
                                  dtype=torch.float32)  # fmt: skip
    spec = SeqSpec(token_ids=list(range(5, 25)), block_ids=[1, 2], state_slot=0)
    kw = dict(block_size=16, chunk_size=loaded.config.ssm_chunk_size, with_attention=True, with_ssm=True)
    loaded.model(build_forward_batch([spec], kernels=counting, **kw), caches)
    assert calls.count("paged_dsa_select") == 2 and calls.count("paged_sparse_mla_attention") == 3
    assert "kda" in calls


def test_rglru_calls_the_batch_kernels(tmp_path: Path) -> None:
    """RecurrentGemma's RG-LRU scan and its sliding-window attention go through the step's kernel set."""
    loaded = load_model(make_tiny_checkpoint("recurrent_gemma", tmp_path / "m"), linear_backend="torch")
    calls: list[str] = []

    def counted(name: str) -> Callable[..., Any]:
        fn = getattr(TORCH_KERNELS, name)
        return lambda *a, **k: (calls.append(name), fn(*a, **k))[1]

    counting = dataclasses.replace(TORCH_KERNELS, name="counting", **{n: counted(n) for n in KernelSet.op_names()})
    caches = ModelCaches.allocate(loaded.config, num_kv_blocks=8, block_size=16, num_state_slots=2,
                                  dtype=torch.float32)  # fmt: skip
    spec = SeqSpec(token_ids=list(range(5, 25)), block_ids=[1, 2], state_slot=0)
    kw = dict(block_size=16, chunk_size=loaded.config.ssm_chunk_size, with_attention=False, with_ssm=True,
              with_window=True)  # fmt: skip
    loaded.model(build_forward_batch([spec], kernels=counting, **kw), caches)
    assert calls.count("rglru_scan") == 3 and calls.count("causal_conv1d") == 3 and calls.count("paged_attention") == 1


def test_rwkv_calls_the_batch_kernels(tmp_path: Path) -> None:
    """RWKV's WKV scan and its two token shifts per layer (conv windows) go through the step's kernel set."""
    loaded = load_model(make_tiny_checkpoint("rwkv", tmp_path / "m"), linear_backend="torch")
    calls: list[str] = []

    def counted(name: str) -> Callable[..., Any]:
        fn = getattr(TORCH_KERNELS, name)
        return lambda *a, **k: (calls.append(name), fn(*a, **k))[1]

    counting = dataclasses.replace(TORCH_KERNELS, name="counting", **{n: counted(n) for n in KernelSet.op_names()})
    caches = ModelCaches.allocate(loaded.config, num_kv_blocks=8, block_size=16, num_state_slots=2,
                                  dtype=torch.float32)  # fmt: skip
    spec = SeqSpec(token_ids=list(range(5, 25)), state_slot=0)
    kw = dict(block_size=16, chunk_size=loaded.config.ssm_chunk_size, with_attention=False, with_ssm=True)
    loaded.model(build_forward_batch([spec], kernels=counting, **kw), caches)
    assert calls.count("wkv_scan") == 4 and calls.count("causal_conv1d") == 8 and len(calls) == 12


def test_xlstm_calls_the_batch_kernels(tmp_path: Path) -> None:
    """xLSTM's mLSTM scan (one per layer) goes through the step's kernel set, and nothing else does."""
    loaded = load_model(make_tiny_checkpoint("xlstm", tmp_path / "m"), linear_backend="torch")
    calls: list[str] = []

    def counted(name: str) -> Callable[..., Any]:
        fn = getattr(TORCH_KERNELS, name)
        return lambda *a, **k: (calls.append(name), fn(*a, **k))[1]

    counting = dataclasses.replace(TORCH_KERNELS, name="counting", **{n: counted(n) for n in KernelSet.op_names()})
    caches = ModelCaches.allocate(loaded.config, num_kv_blocks=8, block_size=16, num_state_slots=2,
                                  dtype=torch.float32)  # fmt: skip
    spec = SeqSpec(token_ids=list(range(5, 25)), state_slot=0)
    kw = dict(block_size=16, chunk_size=loaded.config.ssm_chunk_size, with_attention=False, with_ssm=True)
    loaded.model(build_forward_batch([spec], kernels=counting, **kw), caches)
    assert calls == ["mlstm_scan"] * 3
