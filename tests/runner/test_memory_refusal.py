"""The memory plan's figures against what a process holds, and its refusal: before loading (the checkpoint's size
in the serving format), before allocating the pools (the measured weights), and in `recap serve` (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from recap import cli
from recap.config import CacheConfig, SchedulerConfig
from recap.engine.errors import MemoryPlanError
from recap.engine.llm import LLM
from recap.model.families import TINY_ARCHS
from recap.model.footprint import WeightBytes, held_weight_bytes
from recap.model.hf_config import read_hf_config, translate_config
from recap.model.layers.linear import onednn_available
from recap.runner import host_memory
from recap.runner.host_memory import MemoryLimit, process_memory_limit
from recap.runner.memory import RUNTIME_OVERHEAD_BYTES, plan_before_load

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("held_bytes_probe.py")
# A bamba big enough that its weights stand out of RSS noise (105 MB in fp32), small enough to build in a second.
PROBE_SHAPE = {"hidden_size": 1024, "intermediate_size": 2048, "vocab_size": 2048, "num_hidden_layers": 2,
               "mamba_n_heads": 16, "mamba_d_head": 128, "num_attention_heads": 8,
               "num_key_value_heads": 4}  # fmt: skip


@pytest.fixture(scope="module")
def probe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from recap.model.testing import make_tiny_checkpoint

    return make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("probe"), **PROBE_SHAPE)


@pytest.fixture(scope="module")
def tiny_bamba(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny bamba with a tokenizer (the engine loads one before the runner)."""
    from recap.model.default_model import save_tokenizer
    from recap.model.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("bamba"))
    save_tokenizer(path, vocab_size=512)
    return path


def test_plan_weights_are_the_bytes_the_process_holds(probe_checkpoint: Path) -> None:
    """In a fresh process, the RSS a loaded and prepared model adds equals the plan's weight figure (parameters
    plus the linear layers' copies) for fp32, bf16 and int8, however many copies each format keeps."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(PROBE), str(probe_checkpoint)], capture_output=True, text=True,
                         env=env, timeout=300, check=True)  # fmt: skip
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(found) == {"float32", "bfloat16", "int8"}
    for fmt, f in found.items():
        # oneDNN's packed copy / the int8 weights: counted beside the parameters (bf16 stays on F.linear, its
        # parameters alone, where oneDNN packs no bf16 weight: AVX2-only CPUs)
        packs = fmt != "bfloat16" or onednn_available(torch.bfloat16)
        assert (f["copies"] > 0) == packs, (fmt, f)
        # fbgemm's packed int8 weight is opaque and counted at its unpacked size: it holds somewhat more
        low = 0.90 if fmt == "int8" else 0.96
        assert low * f["rss"] - (4 << 20) <= f["plan"] <= 1.04 * f["rss"] + (4 << 20), (fmt, f)
    assert found["bfloat16"]["plan"] < 0.6 * found["float32"]["plan"]


EXTRA_COPY = 1 << 20  # what the measured weights hold beyond the pre-load bound in the test below


def _limit_between(folder: Path, kv: int, state: int) -> int:
    """A limit the pre-load plan fits (by 64 KiB) that the measured weights (EXTRA_COPY on top) do not."""
    config = translate_config(read_hf_config(folder))
    cache = CacheConfig(kv_cache_bytes=kv, state_cache_bytes=state)
    plan = plan_before_load(config, cache, SchedulerConfig(max_model_len=256), torch.float32, None,
                            MemoryLimit(1 << 40, "test"))  # fmt: skip
    return plan.total_bytes + (64 << 10)


def test_engine_refuses_before_allocating_the_pools(tiny_bamba: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tiny_bamba
    kv, state = 8 << 20, 8 << 20
    limit = _limit_between(folder, kv, state)

    def no_pools(*args: object, **kwargs: object) -> None:
        raise AssertionError("the pools were allocated for a plan that does not fit")

    def held_more(model: torch.nn.Module) -> WeightBytes:  # a layout holding a second copy of some weights
        held = held_weight_bytes(model)
        return WeightBytes(held.parameters, held.linear_copies + EXTRA_COPY)

    monkeypatch.setattr("recap.runner.model_runner.ModelCaches.allocate", no_pools)
    monkeypatch.setattr("recap.runner.model_runner.held_weight_bytes", held_more)
    with pytest.raises(MemoryPlanError) as e:
        LLM(str(folder), max_model_len=256, kv_cache_bytes=kv, state_cache_bytes=state, memory_limit_bytes=limit)
    text = str(e.value)
    assert "before loading" not in text and "linear layers' copies" in text
    assert f"this process may hold {limit / 2**30:.2f} GiB (the given memory limit)" in text
    assert "--kv-cache-bytes" in text and "--quantization int8" in text and "--dtype bfloat16" in text


def test_engine_refuses_before_loading_from_the_config_alone(tmp_path: Path) -> None:
    """A 7B-class config with no weight file at all: refused from its size in the serving format, before a
    weight (or the tokenizer) is read; in bf16 + int8 the same limit is still too small, with smaller figures."""
    from recap.model.testing import tiny_hf_config

    big = tiny_hf_config("bamba", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         vocab_size=128256, mamba_n_heads=128, mamba_d_head=64, num_attention_heads=32,
                         num_key_value_heads=8, attn_layer_indices=[9, 18, 27])  # fmt: skip
    big.save_pretrained(str(tmp_path))
    assert not list(tmp_path.glob("*.safetensors"))
    figures = []
    for kw in ({"dtype": "float32"}, {"dtype": "bfloat16", "quantization": "int8"}):
        with pytest.raises(MemoryPlanError) as e:
            LLM(str(tmp_path), max_model_len=1024, kv_cache_bytes=64 << 20, state_cache_bytes=64 << 20,
                memory_limit_bytes=4 << 30, **kw)  # fmt: skip
        text = str(e.value)
        assert "refused before loading it" in text and "weights at least" in text
        assert "this process may hold 4.00 GiB (the given memory limit)" in text
        figures.append(float(text.split("weights at least ")[1].split(" GiB")[0]))
    assert figures[0] > 25 and figures[1] < figures[0] / 3  # ~7B params: 4 bytes each, then ~1


def test_the_host_tier_is_counted_in_the_plan(tiny_bamba: Path) -> None:
    """On a CPU the host cache tier fills process memory: its budget is in the plan, before loading and after,
    and a tier the limit cannot hold is refused naming it (and how to shrink it), though the rest fits."""
    kv, state = 1 << 20, 4 << 20
    fits = LLM(str(tiny_bamba), max_model_len=256, kv_cache_bytes=kv, state_cache_bytes=state,
               cache_host_bytes=3 << 20, memory_limit_bytes=4 << 30)  # fmt: skip
    plan = fits.engine.runner.memory_plan()
    assert plan.host_tier_bytes == 3 << 20 and "host cache tier 3.0 MiB" in plan.describe()
    limit = _limit_between(tiny_bamba, kv, state) + (64 << 20)  # the model and pools fit with room to spare
    with pytest.raises(MemoryPlanError) as e:
        LLM(str(tiny_bamba), max_model_len=256, kv_cache_bytes=kv, state_cache_bytes=state,
            cache_host_bytes=128 << 20, memory_limit_bytes=limit)  # fmt: skip
    text = str(e.value)
    assert "refused before loading it" in text and "host cache tier 0.12 GiB" in text, text
    assert "--cache-host-bytes" in text


def test_the_measured_limit_fits_a_small_model(tiny_bamba: Path) -> None:
    llm = LLM(str(tiny_bamba), max_model_len=256, kv_cache_bytes=1 << 20, state_cache_bytes=4 << 20)
    plan = llm.engine.runner.memory_plan()
    assert plan.fits and plan.limit is not None and plan.overhead_bytes >= RUNTIME_OVERHEAD_BYTES
    assert f"total {plan.total_bytes / 2**30:.2f} GiB of {plan.limit.bytes / 2**30:.2f} GiB" in plan.describe()


def test_serve_exits_2_with_the_plan_when_it_does_not_fit(tiny_bamba: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tiny_bamba
    code = cli.main(["serve", str(folder), "--max-model-len", "256", "--kv-cache-bytes", "2GiB",
                     "--memory-limit", "1GiB"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert "error: not enough memory to serve this model (refused before loading it)" in err
    assert "KV pool 2.00 GiB" in err and "this process may hold 1.00 GiB" in err and "Traceback" not in err


def test_memory_limit_is_the_smaller_of_available_and_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 32000000 kB\nMemAvailable: 8000000 kB\n")
    status = tmp_path / "status"
    status.write_text("VmHWM: 900000 kB\nVmRSS: 500000 kB\n")
    cgroup = tmp_path / "cg"
    (cgroup / "memory").mkdir(parents=True)
    monkeypatch.setattr(host_memory, "MEMINFO", meminfo)
    monkeypatch.setattr(host_memory, "SELF_STATUS", status)
    monkeypatch.setattr(host_memory, "SELF_CGROUP", tmp_path / "none")
    monkeypatch.setattr(host_memory, "CGROUP_ROOT", cgroup)
    assert process_memory_limit().bytes == (8000000 + 500000) * 1024  # no cgroup file: the host's figure
    (cgroup / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert process_memory_limit().bytes == (8000000 + 500000) * 1024
    (cgroup / "memory.max").write_text("4294967296\n")
    limit = process_memory_limit()
    assert limit.bytes == 4 << 30 and "memory.max" in limit.source
    (cgroup / "memory.max").write_text("max\n")
    assert process_memory_limit().bytes == (8000000 + 500000) * 1024
    with pytest.raises(ValueError):
        MemoryLimit(0, "nothing")


@pytest.mark.parametrize(("dtype", "quant"), [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "int8")])
def test_the_lower_bound_before_loading_is_below_what_loading_holds(
    tiny_bamba: Path, dtype: torch.dtype, quant: str | None
) -> None:
    from recap.backends import prepare
    from recap.model.footprint import held_weight_bytes, serving_weight_bytes_lower_bound
    from recap.model.loader import build_model, load_model

    config = translate_config(read_hf_config(tiny_bamba))
    bound = serving_weight_bytes_lower_bound(build_model(config, dtype, "meta"), quant)
    loaded = load_model(tiny_bamba, dtype=dtype, quantization=quant)
    loaded_bytes = held_weight_bytes(loaded.model).total  # before the backend's preparation
    prepare(loaded)
    held = held_weight_bytes(loaded.model)
    assert bound <= held.total
    if quant is None:  # one copy at the serving dtype: exactly as loaded, then in the kernels' layout (padded)
        assert bound == loaded_bytes and held.total <= bound * 1.05 + (64 << 10)
    else:  # quantized as each layer loaded: its fp32 matrices released, the int8 forms beside the rest
        assert held.parameters < bound <= loaded_bytes


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_every_family_builds_on_meta_and_its_bound_is_its_parameters(
    tiny_checkpoint: Callable[[str], Path], arch: str
) -> None:
    """The pre-load check builds each family on the meta device: it must build, and in the checkpoint's own
    dtype its bound is exactly what loading holds (the strict loader's parameters and buffers)."""
    from recap.model.footprint import held_weight_bytes, serving_weight_bytes_lower_bound
    from recap.model.loader import build_model, load_model

    folder = tiny_checkpoint(arch)
    bound = serving_weight_bytes_lower_bound(build_model(translate_config(read_hf_config(folder)), torch.float32,
                                                         "meta"), None)  # fmt: skip
    loaded = load_model(folder, native_decode=False, linear_backend="torch")
    assert bound == held_weight_bytes(loaded.model).total
