"""Summaries of `recap bench` runs: per-configuration figures, ratios, markdown tables, JSON.

Definitions (every figure of a configuration comes from its own requests in the same run):
  hit rate        cached prompt tokens / prompt tokens (`num_cached_tokens`, or usage.cached_tokens)
  shareable       per request, the longest block-aligned prefix it shares with an earlier request's
                  prompt + output (capped below the prompt length); `bound` = shareable / prompt
                  tokens is the best any prefix cache can do, `of shareable` = hits / shareable
  throughput      (prompt + generated tokens) / wall time of the requests
  ratios vs off   computed over the requests both configurations ran (transformers may run a subset)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from recap.bench.runners import ConfigRun, RequestResult


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def ttft_stats(results: Iterable[RequestResult]) -> dict[str, float]:
    t = [r.ttft for r in results]
    return {"mean": mean(t), "p50": percentile(t, 50), "p95": percentile(t, 95)}


def shareable_tokens(results: Sequence[RequestResult], block_size: int) -> list[int]:
    """Block-aligned prefix each request shares with any earlier request's prompt + output."""
    seen: set[int] = set()
    out = []
    for r in results:
        limit = (r.prompt_tokens - 1) // block_size
        h, n = 0, 0
        while n < limit:
            h = hash((h, tuple(r.prompt_ids[n * block_size : (n + 1) * block_size])))
            if h not in seen:
                break
            n += 1
        out.append(n * block_size)
        seq = r.prompt_ids + r.output_ids
        h = 0
        for i in range(len(seq) // block_size):
            h = hash((h, tuple(seq[i * block_size : (i + 1) * block_size])))
            seen.add(h)
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else None


def matched_ttft_ratio(run: ConfigRun, base: ConfigRun, keep: Any = None) -> dict[str, float | None]:
    """TTFT of `run` over `base` on the requests both ran (and `keep(result)` accepts)."""
    by_rid = {r.rid: r for r in base.results}
    pairs = [(r, by_rid[r.rid]) for r in run.results if r.rid in by_rid and (keep is None or keep(r))]
    a = [p[0].ttft for p in pairs]
    b = [p[1].ttft for p in pairs]
    return {
        "mean": _ratio(mean(a), mean(b)),
        "p50": _ratio(percentile(a, 50), percentile(b, 50)),
        "p95": _ratio(percentile(a, 95), percentile(b, 95)),
        "requests": len(pairs),  # type: ignore[dict-item]
    }


def per_step(results: Sequence[RequestResult]) -> list[dict[str, Any]]:
    steps = sorted({r.step for r in results})
    rows = []
    for s in steps:
        rs = [r for r in results if r.step == s]
        prompt = sum(r.prompt_tokens for r in rs)
        rows.append(
            {
                "step": s,
                "requests": len(rs),
                "prompt_tokens": prompt,
                "cached_tokens": sum(r.cached_tokens for r in rs),
                "hit_rate": sum(r.cached_tokens for r in rs) / prompt if prompt else 0.0,
                **{f"ttft_{k}": v for k, v in ttft_stats(rs).items()},
            }
        )
    return rows


def summarize(run: ConfigRun, block_size: int) -> dict[str, Any]:
    rs = run.results
    prompt = sum(r.prompt_tokens for r in rs)
    generated = sum(len(r.output_ids) for r in rs)
    cached = sum(r.cached_tokens for r in rs)
    share = shareable_tokens(rs, block_size)
    share_total = sum(share)
    c = run.cache
    return {
        "config": run.spec.name,
        "kind": run.spec.kind,
        "description": run.spec.description,
        "policy": run.spec.policy if run.spec.kind == "engine" else None,
        "prefix_caching": run.spec.caching if run.spec.kind != "url" else None,
        "segment_boundaries": run.spec.segments,
        "requests": len(rs),
        "prompt_tokens": prompt,
        "generated_tokens": generated,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "shareable_tokens": share_total,
        "bound_hit_rate": share_total / prompt if prompt else 0.0,
        "hit_of_shareable": (
            sum(min(r.cached_tokens, s) for r, s in zip(rs, share)) / share_total if share_total else None
        ),
        "ttft_s": ttft_stats(rs),
        "wall_s": run.wall_s,
        "throughput_tok_s": (prompt + generated) / run.wall_s if run.wall_s else None,
        "generation_tok_s": generated / run.wall_s if run.wall_s else None,
        "checkpoint_bytes": c.checkpoint_bytes,
        "peak_checkpoint_bytes": c.peak_checkpoint_bytes,
        "checkpoints": c.checkpoints,
        "checkpoints_created": c.checkpoints_created,
        "checkpoint_evictions": c.checkpoint_evictions,
        "pools": c.pools,
        "per_step": per_step(rs),
        "request_results": [
            {
                "rid": r.rid,
                "session": r.session,
                "step": r.step,
                "wave": r.wave,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "shareable_tokens": s,
                "output_tokens": len(r.output_ids),
                "ttft_s": r.ttft,
                "latency_s": r.latency,
            }
            for r, s in zip(rs, share)
        ],
    }


def add_ratios(summaries: dict[str, dict[str, Any]], runs: dict[str, ConfigRun], base: str = "off") -> None:
    """`ttft_vs_<base>` and `throughput_vs_<base>` on each summary, when `base` ran."""
    if base not in runs:
        return
    for name, s in summaries.items():
        s[f"ttft_vs_{base}"] = matched_ttft_ratio(runs[name], runs[base])
        tb = summaries[base]["throughput_tok_s"]
        s[f"throughput_vs_{base}"] = _ratio(s["throughput_tok_s"] or math.nan, tb) if tb else None


# ---- formatting ----------------------------------------------------------------------------------


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def _f(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:{spec}}{suffix}"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main_table(summaries: dict[str, dict[str, Any]]) -> str:
    header = [
        "config",
        "reqs",
        "TTFT mean s",
        "p50 s",
        "p95 s",
        "TTFT mean / off",
        "tok/s",
        "tok/s / off",
        "hit rate",
        "bound",
        "ckpt bytes (peak)",
        "ckpts made (evicted)",
    ]
    rows = []
    for name, s in summaries.items():
        t, r = s["ttft_s"], s.get("ttft_vs_off") or {}
        rows.append(
            [
                name,
                str(s["requests"]),
                _f(t["mean"], ".3f"),
                _f(t["p50"], ".3f"),
                _f(t["p95"], ".3f"),
                _f(r.get("mean"), ".3f") + (f" (n={r['requests']})" if r and r["requests"] != s["requests"] else ""),
                _f(s["throughput_tok_s"], ".1f"),
                _f(s.get("throughput_vs_off"), ".2f"),
                _f(100 * s["hit_rate"], ".1f", "%"),
                _f(100 * s["bound_hit_rate"], ".1f", "%"),
                f"{fmt_bytes(s['checkpoint_bytes'])} ({fmt_bytes(s['peak_checkpoint_bytes'])})",
                _f(s["checkpoints_created"], "d")
                + (f" ({s['checkpoint_evictions']})" if s["checkpoint_evictions"] else ""),
            ]
        )
    return markdown_table(header, rows)


def step_table(summaries: dict[str, dict[str, Any]], step_name: str = "turn") -> str:
    """Mean TTFT (s) and hit rate per step, configurations side by side (steps 1-based)."""
    names = list(summaries)
    steps = sorted({row["step"] for s in summaries.values() for row in s["per_step"]})
    header = [step_name] + [f"{n} TTFT s (hit)" for n in names]
    rows = []
    for st in steps:
        row = [str(st + 1)]
        for n in names:
            cell = next((x for x in summaries[n]["per_step"] if x["step"] == st), None)
            row.append("-" if cell is None else f"{cell['ttft_mean']:.3f} ({100 * cell['hit_rate']:.0f}%)")
        rows.append(row)
    return markdown_table(header, rows)
