"""Where the host time of an engine decode step goes, on a model whose forward is cheap (issue 32).

    nice -n 5 python benchmarks/host_step.py --backend cpu --batch 1 32 --steps 300 [--json-out FILE]
    TRITON_INTERPRET=1 nice -n 5 python benchmarks/host_step.py --backend cuda-ref --batch 1 8 --steps 10 --warmup 2

The real engine (LLMEngine.step) decodes greedily on a tiny random Nemotron-H-like checkpoint (hidden 64, vocab 512,
recap.model.testing) with the tiny byte-level tokenizer, torch threads 1. Each timed step is a decode step of every
request (the prompts were prefilled first). Its wall time is split, by wrapping the engine's own methods, into:

- schedule: Scheduler.schedule; update: Scheduler.update_from_output (the cache core's bookkeeping)
- batch: ModelRunner.build_batch (SeqSpecs, the backend's padding, the ForwardBatch and its packing)
- forward: Backend.forward or forward_greedy (the model; on cuda-ref the captured step's host work and its eager
  rerun)
- head: CausalLM.compute_logits (on cuda-ref the reference capture reruns a greedy graph's head eagerly: counted
  here, where a CUDA graph would replay it); sample: Sampler.__call__ with its rows' preparation
- output: OutputProcessor.on_tokens + collect (detokenizing, stop strings, the RequestOutputs)
- other: the rest of LLMEngine.step and ModelRunner.execute (metrics, checkpoint reports, loops)

Each part's time excludes the parts nested inside it. Backends: `cpu` (what `recap` runs here: the CPU backend's
decode graphs) and `cuda-ref` (the CUDA backend with the reference capture over the Triton kernels under Triton's
interpreter, TRITON_INTERPRET=1: the GPU path's host work, padding and packing included; its forward is the
interpreter's, seconds a step).
Prints a table of medians (us per step) and one JSON line; the 1-minute load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recap.config import CacheConfig, SchedulerConfig  # noqa: E402
from recap.engine.config import EngineConfig  # noqa: E402
from recap.engine.llm_engine import LLMEngine  # noqa: E402
from recap.model.default_model import save_tokenizer  # noqa: E402
from recap.model.testing import make_tiny_checkpoint  # noqa: E402
from recap.sampling_params import SamplingParams  # noqa: E402

PARTS = ("schedule", "batch", "forward", "head", "sample", "update", "output", "other")


class PartTimer:
    """Exclusive wall time per named part of one step: methods wrapped on their instances, nested parts' time
    taken out of their callers'."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self._stack: list[float] = []  # per open part: the time its nested parts took

    def wrap(self, obj: object, method: str, part: str) -> None:
        inner: Callable[..., Any] = getattr(obj, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                nested = self._stack.pop()
                self.totals[part] += dt - nested
                if self._stack:
                    self._stack[-1] += dt

        object.__setattr__(obj, method, timed)  # nn.Module's __setattr__ takes a plain function as well

    def reset(self) -> None:
        self.totals = dict.fromkeys(PARTS, 0.0)


def build_model(root: Path) -> Path:
    path = make_tiny_checkpoint("nemotron_h", root / "nemotron_h")
    save_tokenizer(path, vocab_size=512)
    return path


def make_engine(path: Path, backend: str, batch: int) -> LLMEngine:
    kernels = "triton" if backend == "cuda-ref" else "torch"
    engine = LLMEngine(EngineConfig(
        model=str(path), device="cpu", kernels=kernels, dtype="float32", seed=0, generation_config="vllm",
        num_threads=1, cache=CacheConfig(block_size=16, kv_cache_bytes=64 << 20, state_cache_bytes=64 << 20),
        scheduler=SchedulerConfig(max_num_seqs=max(batch, 1), max_model_len=2048, max_num_batched_tokens=2048),
    ))  # fmt: skip
    if backend == "cuda-ref":
        from recap.backends.cuda import CudaBackend
        from recap.backends.cuda_graph import rerun_capture

        runner = engine.runner
        graphs = CudaBackend(kernels=runner.backend.kernels, capture=rerun_capture)
        graphs.prepare(runner.model)
        runner.backend = graphs
    return engine


def instrument(engine: LLMEngine) -> PartTimer:
    timer = PartTimer()
    runner = engine.runner
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.scheduler, "update_from_output", "update")
    timer.wrap(runner, "build_batch", "batch")
    timer.wrap(runner.backend, "forward", "forward")
    if hasattr(runner.backend, "forward_greedy"):  # a greedy step's forward with its head and argmax
        timer.wrap(runner.backend, "forward_greedy", "forward")
    timer.wrap(runner.model, "compute_logits", "head")
    timer.wrap(runner, "_sample_row", "sample")
    timer.wrap(runner, "sampler", "sample")
    timer.wrap(engine.outputs, "on_tokens", "output")
    timer.wrap(engine.outputs, "collect", "output")
    return timer


def measure(engine: LLMEngine, batch: int, steps: int, warmup: int, prompt: int) -> dict[str, Any]:
    """Medians (us) per part over `steps` decode steps of `batch` requests, after `warmup` decode steps."""
    g = torch.Generator().manual_seed(batch)
    # the first requests decode while the last ones prefill (at most a step each): none may finish while timed
    params = SamplingParams(temperature=0.0, max_tokens=steps + warmup + batch + 4, ignore_eos=True)
    ids = [engine.add_request(torch.randint(3, 500, (prompt,), generator=g).tolist(), params) for _ in range(batch)]
    started: set[str] = set()
    while len(started) < batch:  # the prefills: each request's first token comes with its prompt's last chunk
        started.update(r.request_id for r in engine.step() if r.outputs[0].token_ids)
    timer = instrument(engine)
    per_part: dict[str, list[float]] = {p: [] for p in PARTS}
    walls: list[float] = []
    for i in range(warmup + steps):
        timer.reset()
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        out = engine.scheduler.last_output
        assert out is not None and len(out.scheduled) == batch and out.num_batched_tokens == batch, "a decode step"
        if i < warmup:
            continue
        timer.totals["other"] = wall - sum(v for k, v in timer.totals.items() if k != "other")
        walls.append(wall)
        for p in PARTS:
            per_part[p].append(timer.totals[p])
    engine.abort_request(ids)
    med = {p: statistics.median(v) * 1e6 for p, v in per_part.items()}
    return {
        "batch": batch,
        "steps": steps,
        "step_us": statistics.median(walls) * 1e6,
        "parts_us": med,
        "host_us": statistics.median([w - f for w, f in zip(walls, per_part["forward"])]) * 1e6,
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'batch':>5} {'step':>8} {'host':>8} " + " ".join(f"{p:>8}" for p in PARTS)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['batch']:>5} {r['step_us']:>8.0f} {r['host_us']:>8.0f} "
                     + " ".join(f"{r['parts_us'][p]:>8.0f}" for p in PARTS))  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("cpu", "cuda-ref"), default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=24, help="prompt tokens per request")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp))
        rows = []
        for b in args.batch:
            engine = make_engine(path, args.backend, b)
            rows.append(measure(engine, b, args.steps, args.warmup, args.prompt))
            del engine
    load = os.getloadavg()[0]
    print(f"backend {args.backend}, torch threads 1, medians in us per decode step (load average {load:.2f})")
    print(table(rows))
    result = {"bench": "host_step", "backend": args.backend, "prompt": args.prompt, "load_avg_1m": load, "rows": rows}
    print(json.dumps(result))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
