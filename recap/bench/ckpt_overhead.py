"""Micro-benchmark: what checkpoint emission costs during prefill.

Prefill of a fresh `prompt_len`-token prompt (no hits: every repeat sends new random ids) on two
engines built in the same run: policy `all` (a checkpoint at every block boundary, so the SSM scan
splits its chunks at every boundary and writes a state per block) and policy `none` (no
checkpoints). Each sample is the TTFT of a 1-token request whose prompt fits one step (prefill +
one sample). The two engines alternate within each repeat, in alternating order, so drift in the
machine's load hits both; medians over repeats, and the median of the per-repeat ratios.
"""

from __future__ import annotations

import random
import statistics
from typing import Any

from tqdm import tqdm

from recap.bench.results import fmt_bytes, markdown_table
from recap.bench.runners import WARMUP_SALT, EngineOptions
from recap.sampling_params import SamplingParams

POLICIES = ("none", "all")


def _prefill_seconds(llm: Any, ids: list[int]) -> float:
    """TTFT of a 1-token request: the prefill step plus one sample."""
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))[0]
    if out.num_cached_tokens:
        raise RuntimeError(f"a fresh prompt hit {out.num_cached_tokens} cached tokens")
    return float(out.metrics.ttft)


def run_ckpt_overhead(opts: EngineOptions, prompt_len: int, repeats: int, vocab: int, seed: int = 0) -> dict[str, Any]:
    from recap.engine.llm import LLM

    budget = max(opts.max_num_batched_tokens, prompt_len)
    llms = {
        p: LLM(
            opts.model,
            seed=opts.seed,
            enable_prefix_caching=True,
            checkpoint_policy=p,
            block_size=opts.block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=opts.max_num_seqs,
            max_model_len=max(opts.max_model_len, prompt_len + 1),
            kv_cache_bytes=opts.kv_cache_bytes,
            state_cache_bytes=opts.state_cache_bytes,
            num_threads=opts.threads,
        )
        for p in POLICIES
    }
    rng = random.Random(seed)
    for llm in llms.values():  # warm-up: one full-size prefill each, isolated by a cache salt
        warm = [rng.randrange(16, vocab) for _ in range(prompt_len)]
        llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=1), cache_salt=WARMUP_SALT)
    created0 = {p: llm.engine.metrics_snapshot().checkpoints_created for p, llm in llms.items()}
    times: dict[str, list[float]] = {p: [] for p in POLICIES}
    for i in tqdm(range(repeats), desc="ckpt-overhead", unit="rep"):
        order = POLICIES if i % 2 == 0 else POLICIES[::-1]
        for p in order:
            ids = [rng.randrange(16, vocab) for _ in range(prompt_len)]
            times[p].append(_prefill_seconds(llms[p], ids))
    made = {p: llm.engine.metrics_snapshot().checkpoints_created - created0[p] for p, llm in llms.items()}
    slot = llms["all"].engine.runner.layout.state_bytes_per_slot
    med = {p: statistics.median(t) for p, t in times.items()}
    paired = statistics.median(a / b for a, b in zip(times["all"], times["none"]))
    return {
        "prompt_tokens": prompt_len,
        "repeats": repeats,
        "block_size": opts.block_size,
        "max_num_batched_tokens": budget,
        "threads": opts.threads,
        "seconds": times,
        "median_s": med,
        "prefill_tok_s": {p: prompt_len / m for p, m in med.items()},
        "ratio_of_medians": med["all"] / med["none"],
        "median_of_paired_ratios": paired,
        "overhead_pct": 100.0 * (med["all"] / med["none"] - 1.0),
        "checkpoints_per_prefill": {p: made[p] / repeats for p in POLICIES},
        "checkpoint_bytes_per_prefill": made["all"] / repeats * slot,
        "state_bytes_per_slot": slot,
        "target_overhead_pct": 5.0,
    }


def overhead_table(res: dict[str, Any]) -> str:
    rows = []
    for p in POLICIES:
        ts = res["seconds"][p]
        rows.append(
            [
                p,
                f"{res['median_s'][p]:.3f}",
                f"{min(ts):.3f}",
                f"{max(ts):.3f}",
                f"{res['prefill_tok_s'][p]:.0f}",
                f"{res['checkpoints_per_prefill'][p]:.0f}",
                fmt_bytes(int(res["checkpoints_per_prefill"][p] * res["state_bytes_per_slot"])),
            ]
        )
    table = markdown_table(
        ["policy", "median s", "min s", "max s", "prefill tok/s", "ckpts / prefill", "ckpt bytes / prefill"], rows
    )
    return (
        f"{table}\n\nall / none: ratio of medians {res['ratio_of_medians']:.3f} "
        f"(overhead {res['overhead_pct']:+.1f}%, target <= +{res['target_overhead_pct']:.0f}%), "
        f"median of paired ratios {res['median_of_paired_ratios']:.3f}"
    )
