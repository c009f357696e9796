"""Replay results: one dataclass per policy run, a side-by-side table and the JSON summary."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from recap.bench.shapes import format_bytes


@dataclass
class ReplayResult:
    """What one replay of a trace under one checkpoint policy measured."""

    policy: str  # the policy spec as given (e.g. "recap:interval=32")
    requests: int  # served (rejected ones excluded from every figure)
    rejected: int  # finished with an error at admission (longer than the KV pool, say)
    prompt_tokens: int
    cached_tokens: int  # sum of num_cached_tokens over requests
    checkpoints_created: int  # registered, including decode-end snapshots later superseded
    checkpoints_evicted: int
    checkpoints_stranded: int  # dropped when the KV block they end on was evicted
    checkpoint_peak: int  # most checkpoints held at once
    checkpoint_peak_bytes: int
    kv_peak_bytes: int  # most KV bytes in use or cached at once
    prefill_flops: float  # FLOPs of every prompt without caching
    prefill_flops_saved: float  # FLOPs of the cached prompt tokens
    preemptions: int
    steps: int
    sim_seconds: float  # simulated clock at the end of the replay
    mean_ttft_s: float  # simulated time to first token, mean over requests
    wall_seconds: float
    cpu_seconds: float  # process CPU time of the replay (steady under a shared, busy machine)
    tiers: dict[str, Any] | None = None  # lower tiers (recap/bench/replay_tiers.py): per tier and promotions

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def flops_saved_fraction(self) -> float:
        return self.prefill_flops_saved / self.prefill_flops if self.prefill_flops else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        d["flops_saved_fraction"] = self.flops_saved_fraction
        return d


COLUMNS: tuple[tuple[str, str], ...] = (
    ("policy", "<"),
    ("hit rate", ">"),
    ("ckpt created", ">"),
    ("ckpt evicted", ">"),
    ("ckpt peak", ">"),
    ("ckpt bytes peak", ">"),
    ("KV bytes peak", ">"),
    ("prefill FLOPs saved", ">"),
    ("preempt", ">"),
    ("requests", ">"),
    ("sim s", ">"),
    ("TTFT s", ">"),
    ("wall s", ">"),
    ("CPU s", ">"),
)


def _row(r: ReplayResult) -> list[str]:
    return [
        r.policy,
        f"{100 * r.hit_rate:.1f}%",
        f"{r.checkpoints_created:,}",
        f"{r.checkpoints_evicted:,}",
        f"{r.checkpoint_peak:,}",
        format_bytes(r.checkpoint_peak_bytes),
        format_bytes(r.kv_peak_bytes),
        f"{r.prefill_flops_saved:.2e} ({100 * r.flops_saved_fraction:.1f}%)",
        f"{r.preemptions:,}",
        f"{r.requests:,}",
        f"{r.sim_seconds:,.0f}",
        f"{r.mean_ttft_s:.2f}",
        f"{r.wall_seconds:.1f}",
        f"{r.cpu_seconds:.1f}",
    ]


def format_table(results: list[ReplayResult]) -> str:
    """A plain-text table (also valid Markdown), one row per policy."""
    rows = [[name for name, _ in COLUMNS]] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]

    def line(cells: list[str]) -> str:
        parts = [f"{c:{a}{w}}" for c, (_, a), w in zip(cells, COLUMNS, widths)]
        return "| " + " | ".join(parts) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if a == ">" else "-" * (w + 2) for (_, a), w in zip(COLUMNS, widths))
    return "\n".join([line(rows[0]), rule + "|"] + [line(row) for row in rows[1:]])


def summary_json(results: list[ReplayResult], meta: dict[str, Any]) -> str:
    """One line of JSON: {"hit_rate": {policy: rate}, "results": [...], **meta}."""
    payload = {
        "hit_rate": {r.policy: round(r.hit_rate, 6) for r in results},
        **meta,
        "results": [r.to_dict() for r in results],
    }
    return json.dumps(payload, separators=(",", ":"), sort_keys=False)
