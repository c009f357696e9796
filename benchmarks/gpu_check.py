"""The prepared device check of recap on a GPU (issue 32): one command, a table and a JSON file.

    python benchmarks/gpu_check.py --out gpu_check.json            # on the GPU machine (< 8 minutes)
    python benchmarks/gpu_check.py --device cpu --smoke              # here: the same code on tiny shapes

Sections, each timed and isolated (a failure is recorded and the next section runs):
1. kernels: the Triton kernel tests (tests/kernels/triton) compiled on the device: each kernel against its torch
   reference in fp32 (states, slots written and untouched) and in bf16 on the GPU-only cases;
2. backends: end-to-end greedy tokens of the Triton and torch kernel sets on tiny hybrids (Mamba2, GDN and
   short-conv; MoE ones whose routed experts run the fused kernel: Nemotron-H, Granite-4.0-H, Qwen3.5-MoE,
   Kimi-Linear), the decode graphs captured, and cached = uncached (a repeated prompt hits its checkpoint and
   gives the same tokens);
3. speed: ~1.3B Nemotron-H-like and ~1.5B Qwen3.5-like shapes with random bf16 weights: prefill tok/s at
   8k tokens, decode tok/s at batch 1/32/128, time to first token on a cached 8k prefix (+64 new tokens)
   against the cold 8k prefill; decode at batch 1/32 with async scheduling on beside off (a second engine);
   transformers on the same shape side by side (prefill 8k, decode batch 1);
   each figure as a fraction of the card's limits (HBM bytes/s for decode, dense bf16 FLOP/s for prefill);
4. profile (on request: --sections profile): on the same shapes, the kernels of the batch-1 decode graph's
   replay and of an eager batch-1 step, the host's functions over 30 decode steps (cProfile), and the kernels
   of a cold 8k prefill and of a cached 8k prefix + 64 new tokens: where the time goes;
5. tune (on request): the 8k prefill's paged attention (head_dim 256) and gated delta rule kernels at other
   tilings than the shipped ones (the gated delta rule: the 16-token per-row walk vs the chunk-parallel form),
   each timed alone.

Imports stay light (torch, triton, transformers, tokenizers, safetensors, xxhash): the GPU machine has no
network. The card's limits are its datasheet figures (CARD_LIMITS, by device name; the H100 SXM's for a card not
listed) unless --hbm-bytes-s / --bf16-flops say else.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from recap.backends.eager import TorchBackend  # noqa: E402
from recap.config import CacheConfig, SchedulerConfig  # noqa: E402
from recap.engine.config import EngineConfig  # noqa: E402
from recap.engine.llm_engine import LLMEngine  # noqa: E402
from recap.model.default_model import ensure_random_model  # noqa: E402
from recap.model.testing import make_tiny_checkpoint, tiny_hf_config  # noqa: E402
from recap.sampling_params import SamplingParams  # noqa: E402

H100_HBM_BYTES_S = 3.35e12
H100_BF16_FLOPS = 989e12
# Datasheet limits (HBM bytes/s, dense bf16 FLOP/s) by a piece of torch.cuda.get_device_name, first match wins:
# the decode and prefill shares are read against the card the check runs on (an H200 streams 1.43x an H100 SXM's
# bytes at the same FLOP/s). Unknown cards take the H100 SXM's, said so in the output.
CARD_LIMITS: tuple[tuple[str, float, float], ...] = (
    ("H200", 4.8e12, 989e12),
    ("H100 NVL", 3.9e12, 835e12),
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100", H100_HBM_BYTES_S, H100_BF16_FLOPS),
    ("A100-SXM4-80GB", 2.039e12, 312e12),
    ("A100 80GB PCIe", 1.935e12, 312e12),
    ("A100", 1.555e12, 312e12),
    ("L40S", 0.864e12, 362e12),
)


def card_limits(gpu: str | None, hbm_bytes_s: float | None, bf16_flops: float | None) -> dict[str, Any]:
    """The limits the speed figures are read against: the flags where given, else the card's datasheet figures
    (CARD_LIMITS), else the H100 SXM's; `source` says which."""
    row = next(((k, h, f) for k, h, f in CARD_LIMITS if gpu and k.lower() in gpu.lower()), None)
    hbm, flops = (row[1], row[2]) if row else (H100_HBM_BYTES_S, H100_BF16_FLOPS)
    why = "no GPU" if gpu is None else f"card {gpu!r} not in CARD_LIMITS"
    source = f"datasheet of {row[0]}" if row else f"H100 SXM's datasheet ({why})"
    if hbm_bytes_s is not None or bf16_flops is not None:
        source = "flags" + ("" if hbm_bytes_s is not None and bf16_flops is not None else f", else the {source}")
    return {"hbm_bytes_s": hbm if hbm_bytes_s is None else hbm_bytes_s,
            "bf16_flops": flops if bf16_flops is None else bf16_flops, "source": source}  # fmt: skip


# ~1.3B Nemotron-H-like: 24 layers (12 Mamba2, 10 MLP, 2 attention), hidden 2048, 64 SSM heads x 64, state 128.
NEMOTRON_1B = {
    "vocab_size": 131072, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 64, "mamba_head_dim": 64, "n_groups": 8,
    "ssm_state_size": 128, "chunk_size": 128, "max_position_embeddings": 16384,
    "layers_block_type": (["mamba", "mlp"] * 3 + ["mamba", "attention"]) * 3,
}  # fmt: skip
# ~1.5B Qwen3.5-like: 24 layers (18 GDN, 6 attention), hidden 2048, GDN 16 k-heads / 32 v-heads x 128.
QWEN35_1B = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "max_position_embeddings": 16384,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
}  # fmt: skip
QWEN35_1B["layer_types"] = QWEN35_1B["layer_types"] * 6  # type: ignore[operator]
_SMOKE = {"hidden_size": 128, "intermediate_size": 256, "vocab_size": 4096, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 32}  # fmt: skip
SMOKE_NEMOTRON = {**_SMOKE, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16}
SMOKE_QWEN35 = {**_SMOKE, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
                "linear_value_head_dim": 32}  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def section(results: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    """Run one section, keeping its result or its error; print a line either way."""
    t0 = time.perf_counter()
    try:
        results[name] = {"ok": True, "result": fn()}
    except Exception as e:  # noqa: BLE001 - a check records every failure and goes on
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    results[name]["seconds"] = round(time.perf_counter() - t0, 1)
    status = "ok" if results[name]["ok"] else "FAILED: " + results[name]["error"][:300]
    print(f"[{name}] {results[name]['seconds']} s {status}", flush=True)


# 1. kernels ---------------------------------------------------------------------------------------------------


# pytest's last line: "199 failed, 107 passed, 4 skipped in 300.12s (0:05:00)" (bare under -q, in "=" otherwise)
_PYTEST_SUMMARY = re.compile(r"^=*\s*((?:\d+ [a-z]+)(?:, \d+ [a-z]+)*) in ([\d.]+)s")


def parse_pytest_output(text: str) -> dict[str, Any]:
    """The summary line (found by its shape: with -rfE and --durations it need not be the last line), its counts,
    every FAILED/ERROR line, the failures per test file and each distinct reason with how many tests gave it."""
    lines = text.strip().splitlines()
    summary = next((ln.strip("= ") for ln in reversed(lines) if _PYTEST_SUMMARY.match(ln)), "")
    counts: dict[str, int] = {}
    if summary:
        found = _PYTEST_SUMMARY.match(summary)
        assert found is not None
        for part in found.group(1).split(", "):
            n, what = part.split(" ", 1)
            counts[what] = int(n)
    failed = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    per_file = Counter(ln.split(" ", 1)[1].split("::", 1)[0].split(" - ", 1)[0] for ln in failed)
    reasons = Counter(ln.split(" - ", 1)[1][:300] for ln in failed if " - " in ln)
    progress = "".join(ln.split()[0] for ln in lines if ln.strip() and set(ln.split()[0]) <= set(".FEsx"))
    return {
        "summary": summary, "counts": counts, "failed": failed, "failed_per_file": dict(sorted(per_file.items())),
        "reasons": dict(reasons.most_common()), "passed_dots": progress.count("."),
        "failed_marks": progress.count("F") + progress.count("E"),
    }  # fmt: skip


def kernel_tests(timeout: int) -> dict[str, Any]:
    """The Triton kernel tests, compiled on this machine's device (the interpreter only where there is none)."""
    # no -q: pyproject's addopts has one, and -qq drops the "N failed, M passed in S s" line
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfE", "--tb=line", "tests/kernels/triton"]
    env = {**os.environ, "COLUMNS": "400"}  # the failure lines whole, reasons included
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        text, code = proc.stdout + "\n" + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:  # what ran before the limit still tells which kernels pass
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        text, code = out + f"\n(stopped after {timeout} s)", None
    return {"returncode": code, **parse_pytest_output(text)}


# 2. backends --------------------------------------------------------------------------------------------------


def _engine(model: str, tokenizer: str, device: str, kernels: str, dtype: str, graphs: bool = True) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=model, tokenizer=tokenizer, device=device, kernels=kernels, dtype=dtype, seed=0, generation_config="vllm",
        native_decode=graphs,
        cache=CacheConfig(block_size=16, kv_cache_bytes=256 << 20, state_cache_bytes=256 << 20),
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=96),
    ))  # fmt: skip


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [list(done[i].outputs[0].token_ids) for i in ids], [done[i].num_cached_tokens for i in ids]


def backend_equality(device: str, tmp: Path) -> list[dict[str, Any]]:
    """Greedy tokens of the Triton and torch kernel sets agree (Triton with decode steps replayed from CUDA graphs,
    and eagerly: --enforce-eager); a repeated prompt hits and agrees."""
    tok = str(ensure_random_model(tmp / "default"))
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 500, (70,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 23, 41)]
    rows = []
    for arch in ("nemotron_h", "qwen3_5", "lfm2", "mamba", "kimi_linear", "granite_hybrid", "qwen3_5_moe"):
        path = str(make_tiny_checkpoint(arch, tmp / arch))
        got: dict[str, Any] = {}
        for name, kernels, graphs in (("torch", "torch", False), ("triton", "triton", True),
                                      ("triton-eager", "triton", False)):  # fmt: skip
            eng = _engine(path, tok, device, kernels, "float32", graphs)
            cold, _ = _run(eng, prompts, 12)
            warm, cached = _run(eng, prompts, 12)  # the same prompts again: hits on their prompt-end checkpoints
            graphs_held = getattr(eng.runner.backend, "_graphs", {}).values()  # the CUDA backend's only
            got[name] = (cold, warm, cached, type(eng.runner.backend).__name__, sum(g is not None for g in graphs_held))
            del eng
            _free()
        row = {
            "arch": arch,
            "triton_equals_torch": got["triton"][0] == got["torch"][0],
            "graphs_equal_eager": got["triton"][0] == got["triton-eager"][0],
            "cached_equals_uncached": got["triton"][1] == got["triton"][0],
            "cached_tokens": got["triton"][2],
            "backends": [got[k][3] for k in ("torch", "triton", "triton-eager")],
            "graphs_captured": got["triton"][4],
        }
        rows.append(row)
        print(f"  {arch:<12} {row}", flush=True)
    return rows


# 3. speed -----------------------------------------------------------------------------------------------------


def _save_random(arch: str, overrides: dict[str, Any], path: Path) -> tuple[Path, int]:
    """A random-weight checkpoint of `arch` with `overrides`, saved in bf16; (path, parameter count)."""
    import transformers as tf

    from recap.model.testing import TINY_ARCHS

    config = tiny_hf_config(arch, **overrides)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = getattr(tf, TINY_ARCHS.get(arch, arch))(config).to(torch.bfloat16).eval()
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    return path, n


def _timed_request(engine: LLMEngine, prompt: list[int], max_tokens: int, device: torch.device) -> tuple[float, int]:
    """Seconds to the first token of one request (its whole prefill), and its cached tokens."""
    _sync(device)
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    first, cached = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and first is None and out.outputs[0].token_ids:
                _sync(device)
                first, cached = time.perf_counter() - t0, out.num_cached_tokens
    assert first is not None
    return first, cached


def _decode_rate(engine: LLMEngine, batch: int, steps: int, device: torch.device, vocab: int) -> float:
    """Generated tokens per second once `batch` requests are all decoding."""
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(3, vocab, (16,), generator=g).tolist(), params)
    engine.step()  # every prompt's prefill (one step: 16 tokens each)
    engine.step()
    _sync(device)
    t0, made = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        made += len(engine.step())  # one output per request that got a token this step
    _sync(device)
    return made / (time.perf_counter() - t0)


def _speed_engine(path: Path, tok: str, device: torch.device, prefill_len: int, async_on: bool = False,
                  pool_bytes: int = 8 << 30) -> LLMEngine:  # fmt: skip
    return LLMEngine(EngineConfig(
        model=str(path), tokenizer=tok, device=str(device), dtype="bfloat16", seed=0, generation_config="vllm",
        cache=CacheConfig(block_size=16, kv_cache_bytes=pool_bytes, state_cache_bytes=pool_bytes),
        scheduler=SchedulerConfig(max_num_seqs=128, max_model_len=prefill_len + 128,
                                  max_num_batched_tokens=prefill_len + 64, async_scheduling=async_on),
    ))  # fmt: skip


ASYNC_BATCHES = (1, 32)


def async_decode(path: Path, tok: str, device: torch.device, prefill_len: int, vocab: int, steps: int,
                 sync_rates: dict[int, float], pool_bytes: int = 8 << 30) -> dict[str, Any]:  # fmt: skip
    """Decode at batch 1 and 32 with async scheduling on (a fresh engine of the synchronous one's settings, its
    sampled ids read on the host a step late: docs/gpu.md), beside the synchronous engine's rates measured just
    before it (`sync_rates`, batch -> tok/s): tok/s each way and on / off."""
    eng = _speed_engine(path, tok, device, prefill_len, async_on=True, pool_bytes=pool_bytes)
    rows: dict[str, Any] = {}
    for batch in ASYNC_BATCHES:
        on, off = _decode_rate(eng, batch, steps, device, vocab), sync_rates[batch]
        rows[f"b{batch}"] = {"off_tok_s": off, "on_tok_s": on, "on_over_off": on / off}
    del eng
    _free()
    return rows


def speed_shape(name: str, arch: str, overrides: dict[str, Any], device: torch.device, tmp: Path, smoke: bool,
                limits: tuple[float, float]) -> dict[str, Any]:  # fmt: skip
    hbm, flops = limits
    path, n_params = _save_random(arch, overrides, tmp / name)
    tok = str(ensure_random_model(tmp / "default"))
    vocab = int(overrides["vocab_size"])
    prefill_len = 512 if smoke else 8192
    res: dict[str, Any] = {"shape": name, "params": n_params, "weight_bytes": 2 * n_params}
    eng = _speed_engine(path, tok, device, prefill_len)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, vocab, (prefill_len,), generator=g).tolist()
    # Warm-up of both paths (cold prefill, and a hit + new tokens), so no timing below includes Triton's compiles.
    other = torch.randint(3, vocab, (prefill_len,), generator=g).tolist()
    _timed_request(eng, other, 1, device)
    _timed_request(eng, other + torch.randint(3, vocab, (64,), generator=g).tolist(), 1, device)
    cold, _ = _timed_request(eng, prompt, 1, device)
    res["prefill_tok_s"] = prefill_len / cold
    res["prefill_flops_fraction"] = 2 * n_params * prefill_len / cold / flops
    suffix = torch.randint(3, vocab, (64,), generator=g).tolist()
    warm, cached = _timed_request(eng, prompt + suffix, 1, device)
    res.update(ttft_cold_s=cold, ttft_cached_prefix_s=warm, cached_tokens=cached)
    graphs = type(eng.runner.backend).__name__
    for label, backend in ((graphs, None), ("eager", TorchBackend(kernels=eng.runner.backend.kernels))):
        if backend is not None:  # the same engine with every step on the module path (--enforce-eager)
            backend.prepare(eng.runner.model)
            eng.runner.backend = backend
        for batch in (1, 32, 128):
            rate = _decode_rate(eng, batch, 8 if smoke else 32, device, vocab)
            suffix = "" if backend is None else "_eager"
            res[f"decode_b{batch}_tok_s{suffix}"] = rate
            if batch == 1:
                res[f"decode_b1_hbm_fraction{suffix}"] = 2 * n_params * rate / hbm
        res[f"decode_backend{'' if backend is None else '_eager'}"] = label
        if backend is None:
            res.update(_replay_time(eng, device, 2 * n_params, hbm))
    del eng
    _free()
    sync_rates = {b: res[f"decode_b{b}_tok_s"] for b in ASYNC_BATCHES}
    res["decode_async"] = async_decode(path, tok, device, prefill_len, vocab, 8 if smoke else 32, sync_rates)
    res["transformers"] = _transformers_speed(arch, overrides, path, device, prompt, smoke)
    print(f"  {name}: {json.dumps(res)}", flush=True)
    return res


def _b1_graphs(engine: LLMEngine) -> list[Any]:
    """The CUDA backend's captured batch-1 decode steps (none on another backend)."""
    graphs = getattr(engine.runner.backend, "_graphs", None)
    return [g for g in graphs.values() if g is not None and g.rows == 1] if isinstance(graphs, dict) else []


@torch.inference_mode()
def _replay_time(engine: LLMEngine, device: torch.device, weight_bytes: int, hbm: float) -> dict[str, Any]:
    """The batch-1 decode graph's replay alone (ms, and its share of the weight-streaming bound): what the step
    costs on the card, against which the engine's whole step (scheduler, batch, sampler) is measured."""
    one = _b1_graphs(engine)
    if not one:
        return {"replay_b1_ms": None}
    from recap.backends.cuda import padding_template

    one[0].run(padding_template(one[0].batch), engine.runner.caches)  # padding rows: no request's slot is touched
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(50):
        one[0].replay()
    _sync(device)
    ms = (time.perf_counter() - t0) / 50 * 1e3
    return {"replay_b1_ms": ms, "replay_b1_hbm_fraction": weight_bytes / (ms / 1e3) / hbm}


def _transformers_speed(arch: str, overrides: dict[str, Any], path: Path, device: torch.device, prompt: list[int],
                        smoke: bool) -> dict[str, Any]:  # fmt: skip
    import transformers as tf

    from recap.model.testing import TINY_ARCHS

    model = getattr(tf, TINY_ARCHS.get(arch, arch)).from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    ids = torch.tensor([prompt], device=device)
    out: dict[str, Any] = {}
    with torch.inference_mode():
        model(ids[:, :256])  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        model(ids)
        _sync(device)
        out["prefill_tok_s"] = len(prompt) / (time.perf_counter() - t0)
        new = 8 if smoke else 32
        short = ids[:, :16]
        model.generate(short, max_new_tokens=2, do_sample=False)
        _sync(device)
        t0 = time.perf_counter()
        model.generate(short, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        _sync(device)
        out["decode_b1_tok_s"] = new / (time.perf_counter() - t0)
    del model
    return out


# 4. profile ---------------------------------------------------------------------------------------------------


def _kernel_table(fn: Callable[[], Any], device: torch.device, per: int, top: int = 25) -> dict[str, Any]:
    """The device kernels `fn` launches (torch.profiler), per one of its `per` repetitions: wall ms, kernel ms,
    kernel count, and the `top` kernels by time (us per repetition, launches per repetition)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
               and e.self_device_time_total > 0]  # fmt: skip
    kernels.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in kernels)
    return {"wall_ms": wall / per * 1e3, "kernel_ms": total / per / 1e3,
            "kernels": sum(e.count for e in kernels) / per,
            "top": [[e.key[:140], round(e.self_device_time_total / per, 1), round(e.count / per, 2)]
                    for e in kernels[:top]]}  # fmt: skip


def _host_profile(fn: Callable[[], Any], top: int = 30) -> dict[str, Any]:
    """Where the host's time goes in `fn` (cProfile, by own time): the rows as pstats prints them."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(fn)
    wall = time.perf_counter() - t0
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    lines = [ln.rstrip()[:200] for ln in out.getvalue().splitlines() if ln.strip()]
    return {"wall_s": wall, "rows": lines[: top + 12]}


@torch.inference_mode()
def profile_shape(name: str, arch: str, overrides: dict[str, Any], device: torch.device, tmp: Path,
                  smoke: bool) -> dict[str, Any]:  # fmt: skip
    """Where a batch-1 decode step and an 8k prefill spend their time on the card and on the host: the kernels of
    the b1 graph's replay and of one eager b1 step, the host's functions over 32 graph-replayed steps, and the
    kernels of a cold 8k prefill and of a cached 8k prefix + 64 new tokens."""
    path = tmp / name
    if not (path / "config.json").is_file():
        _save_random(arch, overrides, path)
    tok = str(ensure_random_model(tmp / "default"))
    vocab = int(overrides["vocab_size"])
    n = 512 if smoke else 8192
    eng = LLMEngine(EngineConfig(
        model=str(path), tokenizer=tok, device=str(device), dtype="bfloat16", seed=0, generation_config="vllm",
        cache=CacheConfig(block_size=16, kv_cache_bytes=8 << 30, state_cache_bytes=8 << 30),
        scheduler=SchedulerConfig(max_num_seqs=128, max_model_len=n + 128, max_num_batched_tokens=n + 64),
    ))  # fmt: skip
    res = _profile(eng, device, vocab, n)
    res["shape"] = name
    del eng
    _free()
    print(f"  {name}: {json.dumps(res)[:4000]}", flush=True)
    return res


def _profile(eng: LLMEngine, device: torch.device, vocab: int, n: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, vocab, (n,), generator=g).tolist()
    other = torch.randint(3, vocab, (n,), generator=g).tolist()
    suffix = torch.randint(3, vocab, (64,), generator=g).tolist()
    _timed_request(eng, other, 1, device)  # compiles
    _timed_request(eng, other + suffix, 1, device)
    _decode_rate(eng, 1, 8, device, vocab)  # captures the b1 graph
    res: dict[str, Any] = {}
    graphs = _b1_graphs(eng)
    if graphs:
        from recap.backends.cuda import padding_template

        one = graphs[0]
        one.run(padding_template(one.batch), eng.runner.caches)
        res["replay_b1"] = _kernel_table(lambda: [one.replay() for _ in range(20)], device, 20)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    eng.add_request(torch.randint(3, vocab, (16,), generator=g).tolist(), params)
    eng.step()
    eng.step()

    def steps(k: int) -> None:
        for _ in range(k):
            eng.step()
        _sync(device)

    res["step_b1_kernels"] = _kernel_table(lambda: steps(4), device, 4)
    res["step_b1_host"] = _host_profile(lambda: steps(30))
    while eng.has_unfinished_requests():
        eng.step()
    res["prefill_cold"] = _kernel_table(lambda: _timed_request(eng, prompt, 1, device), device, 1)
    res["prefill_cached_host"] = _host_profile(lambda: _timed_request(eng, prompt + suffix, 1, device))
    res["prefill_cached"] = _kernel_table(lambda: _timed_request(eng, prompt + suffix[:32] + suffix, 1, device),
                                          device, 1)  # fmt: skip
    eager = TorchBackend(kernels=eng.runner.backend.kernels)
    eager.prepare(eng.runner.model)
    eng.runner.backend = eager
    eng.add_request(torch.randint(3, vocab, (16,), generator=g).tolist(), params)
    eng.step()
    eng.step()
    res["step_b1_eager_kernels"] = _kernel_table(lambda: steps(4), device, 4)
    return res


# 5. tune -------------------------------------------------------------------------------------------------------


def _time_ms(fn: Callable[[], Any], device: torch.device, reps: int = 3) -> float:
    """Median ms of `fn` after one warm-up run (the compile)."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def tune_kernels(device: torch.device, smoke: bool) -> dict[str, Any]:
    """The two prefill kernels that bound the Qwen3.5-like 8k prefill, at other tilings than the shipped ones:
    paged attention (head_dim 256, GQA 8) at (BLOCK_M, BLOCK_N, warps) and the gated delta rule (GDN's and
    Kimi-Linear's KDA's, _delta_forms) in its per-row walk and its chunk-parallel forms. Each configuration is
    timed alone (median of 3 after a compile); a failure (e.g. a tile that does not fit the card's shared memory)
    is recorded and the next one runs."""
    from recap.kernels.batch import build_forward_batch
    from recap.kernels.metadata import SeqSpec
    from recap.kernels.triton.paged_attention import attend

    n, bs = (64, 16) if smoke else (8192, 16)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device).manual_seed(0)
    spec = SeqSpec(list(range(n)), block_ids=list(range(1, n // bs + 1)), state_slot=0,
                   checkpoints=[(p, 1) for p in range(32, n, 4096)])  # fmt: skip
    batch = build_forward_batch([spec], block_size=bs, chunk_size=64, with_attention=True, with_ssm=True,
                                device=device)  # fmt: skip
    assert batch.attn is not None and batch.ssm is not None
    res: dict[str, Any] = {"tokens": n, "attention": []}
    hq, hkv, dh = 16, 2, 256
    q = torch.randn(n, hq, dh, generator=g, device=device).to(dtype)
    kc = torch.randn(n // bs + 1, bs, hkv, dh, generator=g, device=device).to(dtype)
    vc = torch.randn(n // bs + 1, bs, hkv, dh, generator=g, device=device).to(dtype)
    out = torch.empty_like(q)
    flops = 4 * n * n / 2 * dh * hq
    for tiles in (None, (64, 32, 8), (64, 64, 8), (128, 32, 8), (32, 64, 4)):
        row: dict[str, Any] = {"tiles": tiles or "shipped"}
        try:
            ms = _time_ms(lambda t=tiles: attend(q, kc, vc, out, batch.attn, dh**-0.5, tiles=t), device)
            row.update(ms=ms, tflops=flops / ms / 1e9)
        except Exception as e:  # noqa: BLE001 - a tiling the card cannot run is a result too
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        res["attention"].append(row)
        print(f"  attention {row}", flush=True)
    hk, hv, dk, dv = 16, 32, 128, 128
    qk = [torch.randn(n, hk, dk, generator=g, device=device).to(dtype) for _ in range(2)]
    v = torch.randn(n, hv, dv, generator=g, device=device).to(dtype)
    beta = torch.rand(n, hv, generator=g, device=device)
    gate = -torch.rand(n, hv, generator=g, device=device) * 0.1
    res["gdn"] = _delta_forms("gdn", (*qk, v, gate, beta), batch.ssm, device)
    qk = [torch.randn(n, hv, dk, generator=g, device=device).to(dtype) for _ in range(2)]  # Kimi-Linear: no GQA
    gate = -torch.rand(n, hv, dk, generator=g, device=device) * 0.1
    res["kda"] = _delta_forms("kda", (*qk, v, gate, beta), batch.ssm, device)
    return res


def _delta_forms(name: str, args: tuple[torch.Tensor, ...], meta: Any, device: torch.device) -> list[dict[str, Any]]:
    """The gated delta rule (GDN's gate [T, Hv], KDA's [T, Hv, Dk]) in its per-row walk of 16-token pieces, the
    chunk-parallel form at chunks of 32 / 64 and the op's own choice, with the outputs' max error relative to the
    walk."""
    from recap.kernels.triton.gdn import gated_delta_rule, run_varlen
    from recap.kernels.triton.gdn_chunk import chunk_gated_delta_rule

    state = torch.zeros(2, args[2].shape[1], args[1].shape[2], args[2].shape[2], device=device)
    forms: list[tuple[str, Callable[[], torch.Tensor]]] = [
        ("piece 16 (per-row walk)", lambda: run_varlen(*args, state, meta, None, 16, True)),
        *[(f"chunk {c}", lambda c=c: chunk_gated_delta_rule(*args, state, meta, None, c, True)) for c in (32, 64)],
        ("op default", lambda: gated_delta_rule(*args, state, meta, normalize_qk=True)),
    ]  # fmt: skip
    rows: list[dict[str, Any]] = []
    base: torch.Tensor | None = None
    for form, fn in forms:
        row: dict[str, Any] = {"form": form}
        try:
            row["ms"] = _time_ms(fn, device)
            y = fn().float()
            base = y if base is None else base
            row["out_rel_err_vs_piece16"] = ((y - base).abs().max() / base.abs().max()).item()
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(f"  {name} {row}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (a run of the script's code on a CPU)")
    p.add_argument("--sections", default="kernels,backends,speed")
    p.add_argument("--budget-s", type=float, default=460, help="the kernel tests get what is left of it")
    p.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    p.add_argument("--hbm-bytes-s", type=float, default=None, help="default: the card's datasheet (CARD_LIMITS)")
    p.add_argument("--bf16-flops", type=float, default=None, help="default: the card's datasheet (CARD_LIMITS)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    torch.set_num_threads(min(8, torch.get_num_threads()))
    device = torch.device(args.device)
    wanted = set(args.sections.split(","))
    results: dict[str, Any] = {"env": {
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }}  # fmt: skip
    card = card_limits(results["env"]["gpu"], args.hbm_bytes_s, args.bf16_flops)
    results["env"]["limits"] = card
    hbm_tb, tflops = card["hbm_bytes_s"] / 1e12, card["bf16_flops"] / 1e12
    print(f"limits: {hbm_tb:.2f} TB/s HBM, {tflops:.0f} TFLOP/s bf16 ({card['source']})", flush=True)
    try:
        import triton

        results["env"]["triton"] = triton.__version__
    except ImportError:
        results["env"]["triton"] = None
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if "backends" in wanted:
            section(results, "backends", lambda: backend_equality(str(device), tmp))
        if "speed" in wanted:
            limits = (card["hbm_bytes_s"], card["bf16_flops"])
            for name, arch, shape, small in (("nemotron-h-1.3b", "nemotron_h", NEMOTRON_1B, SMOKE_NEMOTRON),
                                             ("qwen3.5-1.5b", "qwen3_5", QWEN35_1B, SMOKE_QWEN35)):  # fmt: skip
                over = {**shape, **small} if args.smoke else shape
                section(results, f"speed:{name}", lambda a=arch, o=over, n=name: speed_shape(
                    n, a, o, device, tmp, args.smoke, limits))  # fmt: skip
        if "profile" in wanted:
            for name, arch, shape, small in (("nemotron-h-1.3b", "nemotron_h", NEMOTRON_1B, SMOKE_NEMOTRON),
                                             ("qwen3.5-1.5b", "qwen3_5", QWEN35_1B, SMOKE_QWEN35)):  # fmt: skip
                over = {**shape, **small} if args.smoke else shape
                section(results, f"profile:{name}", lambda a=arch, o=over, n=name: profile_shape(
                    n, a, o, device, tmp, args.smoke))  # fmt: skip
        if "tune" in wanted:
            section(results, "tune", lambda: tune_kernels(device, args.smoke))
        if "kernels" in wanted:  # last: the time that is left (the whole check runs under --budget-s)
            left = int(args.budget_s - (time.perf_counter() - start))
            section(results, "kernels", lambda: kernel_tests(max(left, 30)))
    args.out.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {args.out}")
    return 0 if all(v.get("ok", True) for k, v in results.items() if k != "env") else 1


if __name__ == "__main__":
    raise SystemExit(main())
