"""PNG plots of `recap bench` summaries (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

COLORS = {
    "off": "#7f7f7f",
    "align": "#1f77b4",
    "all": "#ff7f0e",
    "recap": "#2ca02c",
    "recap-noseg": "#98df8a",
    "hf": "#d62728",
}


def _color(name: str, i: int) -> str:
    return COLORS.get(name, f"C{i % 10}")


def plot_hit_rate(summaries: dict[str, dict[str, Any]], path: Path, title: str) -> Path:
    names = list(summaries)
    fig, ax = plt.subplots(figsize=(1.2 * len(names) + 2.5, 3.6))
    hits = [100 * summaries[n]["hit_rate"] for n in names]
    ax.bar(names, hits, color=[_color(n, i) for i, n in enumerate(names)])
    bound = max(100 * s["bound_hit_rate"] for s in summaries.values())
    ax.axhline(bound, color="black", linestyle="--", linewidth=1, label=f"shareable bound {bound:.1f}%")
    for i, h in enumerate(hits):
        ax.text(i, h + 1, f"{h:.1f}%", ha="center", fontsize=8)
    ax.set_ylabel("cached prompt tokens / prompt tokens (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"{title}: prefix-cache hit rate")
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, path)


def plot_ttft(summaries: dict[str, dict[str, Any]], path: Path, title: str) -> Path:
    names = list(summaries)
    fig, ax = plt.subplots(figsize=(1.2 * len(names) + 2.5, 3.6))
    means = [summaries[n]["ttft_s"]["mean"] for n in names]
    ax.bar(names, means, color=[_color(n, i) for i, n in enumerate(names)], label="mean")
    ax.scatter(names, [summaries[n]["ttft_s"]["p50"] for n in names], color="black", marker="_", s=300, label="p50")
    ax.scatter(names, [summaries[n]["ttft_s"]["p95"] for n in names], color="black", marker="^", s=20, label="p95")
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (s, log)")
    ax.set_title(f"{title}: TTFT per configuration")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_ttft_per_step(summaries: dict[str, dict[str, Any]], path: Path, title: str, step_name: str) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for i, (name, s) in enumerate(summaries.items()):
        steps = [row["step"] + 1 for row in s["per_step"]]
        ax.plot(steps, [row["ttft_mean"] for row in s["per_step"]], marker="o", label=name, color=_color(name, i))
    ax.set_yscale("log")
    ax.set_xlabel(step_name)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("mean TTFT (s, log)")
    ax.set_title(f"{title}: TTFT per {step_name}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(summaries: dict[str, dict[str, Any]], out: Path, workload: str, step_name: str | None) -> list[Path]:
    """Hit rate and TTFT per configuration; TTFT per step when the workload has steps."""
    paths = [
        plot_hit_rate(summaries, out / f"{workload}_hit_rate.png", workload),
        plot_ttft(summaries, out / f"{workload}_ttft.png", workload),
    ]
    if step_name is not None:
        paths.append(plot_ttft_per_step(summaries, out / f"{workload}_ttft_per_{step_name}.png", workload, step_name))
    return paths
