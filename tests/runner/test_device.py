"""Device choice: `auto` resolves to what torch sees, a GPU asked for on a machine without one is a clear error,
a step's metadata moves in one copy, and a GPU's memory share is split between the pools."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from recap import cli
from recap.config import CacheConfig, SchedulerConfig
from recap.engine.vllm_compat import resolve_dtype
from recap.kernels.batch import batch_to_device, build_forward_batch
from recap.kernels.kernel_set import TORCH_KERNELS, kernel_set
from recap.kernels.metadata import SeqSpec
from recap.runner.device import DeviceUnavailableError, resolve_device
from recap.runner.memory import size_pools

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")


def test_auto_is_what_torch_sees() -> None:
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    for bad in ("tpu", "cpu:1", "gpu"):
        with pytest.raises(ValueError, match="device must be one of"):
            resolve_device(bad)


@no_gpu
def test_cuda_without_a_gpu_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(DeviceUnavailableError, match="sees no CUDA GPU; use --device cpu"):
        resolve_device("cuda")
    assert cli.main(["serve", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: device 'cuda'") and "Traceback" not in err


def test_auto_dtype_follows_the_device() -> None:
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("bf16", "cpu") == "bfloat16"
    assert resolve_dtype("auto", "auto") == ("bfloat16" if torch.cuda.is_available() else "float32")


def test_kernel_sets() -> None:
    assert kernel_set("auto", torch.device("cpu")) is TORCH_KERNELS
    assert kernel_set("torch", torch.device("cpu")) is TORCH_KERNELS
    with pytest.raises(ValueError, match="kernels must be"):
        kernel_set("cuda", torch.device("cpu"))


def _equal(a: object, b: object) -> None:
    for f in dataclasses.fields(a):  # type: ignore[arg-type]
        if f.name == "packed":  # the moved batch's one buffer (checked below)
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y.to(x.device)), f.name
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            _equal(x, y)
        else:
            assert x == y, f.name


def test_batch_moves_in_one_copy_unchanged() -> None:
    seqs = [
        SeqSpec(list(range(3, 40)), context_len=0, block_ids=[1, 2, 3], state_slot=2, checkpoints=[(16, 4), (32, 5)]),
        SeqSpec([7], context_len=21, block_ids=[4, 5], state_slot=1),
        SeqSpec([0, 0], padding=True, block_ids=[]),
    ]
    batch = build_forward_batch(seqs, block_size=16, chunk_size=64, with_attention=True, with_ssm=True)
    moved = batch_to_device(batch, torch.device("cpu"))
    _equal(batch, moved)
    # the moved tensors are views of one buffer: one transfer per step
    parts = (moved.input_ids, moved.attn.slot_mapping, moved.ssm.cu_chunk_seqlens)
    bases = {t.untyped_storage().data_ptr() for t in parts}
    assert len(bases) == 1
    assert moved.packed is not None and moved.packed.untyped_storage().data_ptr() in bases
    assert torch.equal(moved.packed[-moved.logits_indices.numel():], batch.logits_indices)  # the variable one last


def test_gpu_budget_is_split_between_the_pools() -> None:
    sched = SchedulerConfig(max_num_seqs=4, max_model_len=256)
    kv_tok, state_slot = 1024, 1 << 20
    sizes = size_pools(CacheConfig(), sched, kv_tok, state_slot, device_budget=1 << 30)
    want_state = (4 * 4 + 64) * state_slot
    assert sizes.state_bytes == want_state  # what the state pool wants, under half the budget
    assert sizes.kv_bytes == ((1 << 30) - want_state) // (kv_tok * 16) * kv_tok * 16  # the KV pool takes the rest
    small = size_pools(CacheConfig(), sched, kv_tok, state_slot, device_budget=64 << 20)
    assert small.state_bytes <= 32 << 20
    fixed = size_pools(CacheConfig(kv_cache_bytes=8 << 20), sched, kv_tok, state_slot, device_budget=1 << 30)
    assert fixed.kv_bytes <= 8 << 20
