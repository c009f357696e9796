"""Per-workload findings: the figures each workload exists to show, checked against its target.

Each function returns a JSON-ready dict and a few printable lines. Targets are reported as measured
(met or not); nothing is tuned to meet them.
"""

from __future__ import annotations

from typing import Any

from recap.bench.results import matched_ttft_ratio, mean, shareable_tokens
from recap.bench.runners import ConfigRun
from recap.bench.workloads import Recipe, SysPrompt, TokenSpace

Findings = tuple[dict[str, Any], list[str]]


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else f"{x:{spec}}"


def multiturn(runs: dict[str, ConfigRun], recipe: Recipe, space: TokenSpace, block_size: int) -> Findings:
    """TTFT of turns >= 2, against caching off and against transformers (target: recap <= 0.1x off)."""
    later = lambda r: r.step >= 1  # noqa: E731
    out: dict[str, Any] = {}
    lines = ["turns >= 2:"]
    for name, run in runs.items():
        rs = [r for r in run.results if later(r)]
        prompt = sum(r.prompt_tokens for r in rs)
        d: dict[str, Any] = {
            "ttft_mean_s": mean([r.ttft for r in rs]),
            "hit_rate": sum(r.cached_tokens for r in rs) / prompt if prompt else 0.0,
        }
        for base in ("off", "hf"):
            if base in runs and base != name:
                d[f"ttft_vs_{base}"] = matched_ttft_ratio(run, runs[base], later)
        out[name] = d
        vs = "  ".join(
            f"vs {b}: {_fmt(d[f'ttft_vs_{b}']['mean'])}x (n={d[f'ttft_vs_{b}']['requests']})"
            for b in ("off", "hf")
            if f"ttft_vs_{b}" in d
        )
        lines.append(f"  {name:12s} TTFT mean {d['ttft_mean_s']:.3f} s  hit {100 * d['hit_rate']:.1f}%  {vs}")
    ratio = out.get("recap", {}).get("ttft_vs_off", {}).get("mean")
    out["target"] = {
        "what": "TTFT of turns >= 2 under recap <= 0.1x caching off",
        "ratio": ratio,
        "met": None if ratio is None else ratio <= 0.1,
    }
    lines.append(
        f"target recap/off <= 0.1 on turns >= 2: {_fmt(ratio)} -> "
        f"{'met' if out['target']['met'] else 'NOT met' if ratio is not None else 'not measured'}"
    )
    return out, lines


def sysprompt(runs: dict[str, ConfigRun], recipe: Recipe, space: TokenSpace, block_size: int) -> Findings:
    """Cached tokens of the 2nd and 3rd requests, and the first request that hits the system prompt."""
    assert isinstance(recipe, SysPrompt)
    sys_len = recipe.system_prompt_len(space)
    reachable = sys_len // block_size * block_size
    out: dict[str, Any] = {"system_prompt_tokens": sys_len, "block_aligned_system_prompt": reachable}
    lines = [f"system prompt {sys_len} tokens ({reachable} block-aligned); cached tokens of requests 1, 2, 3:"]
    for name, run in runs.items():
        rs = sorted(run.results, key=lambda r: r.step)
        cached = [r.cached_tokens for r in rs]
        first = next((i + 1 for i, c in enumerate(cached) if c >= reachable), None)
        out[name] = {"cached_tokens_first3": cached[:3], "first_request_hitting_system_prompt": first}
        lines.append(f"  {name:12s} {cached[:3]}  first request with the whole system prompt cached: {first}")
    out["target"] = {
        "what": "recap: the 2nd request hits the system prompt; align: first hit on the 3rd",
        "recap_2nd_hits": None if "recap" not in out else (out["recap"]["first_request_hitting_system_prompt"] == 2),
        "align_first_hit": None if "align" not in out else out["align"]["first_request_hitting_system_prompt"],
    }
    return out, lines


def insert(runs: dict[str, ConfigRun], recipe: Recipe, space: TokenSpace, block_size: int) -> Findings:
    """Hits over the tokens shared before the insertion point (target: recap >= 90%)."""
    out: dict[str, Any] = {}
    lines = ["steps >= 2: cached tokens / tokens shared before the insertion point (bound = shared / prompt):"]
    for name, run in runs.items():
        share = shareable_tokens(run.results, block_size)
        pairs = [(r, s) for r, s in zip(run.results, share) if r.step >= 1]
        shared = sum(s for _, s in pairs)
        prompt = sum(r.prompt_tokens for r, _ in pairs)
        hit = sum(min(r.cached_tokens, s) for r, s in pairs)
        d = {
            "hit_of_shared": hit / shared if shared else None,
            "bound": shared / prompt if prompt else None,
            "token_hit_rate": sum(r.cached_tokens for r, _ in pairs) / prompt if prompt else None,
        }
        out[name] = d
        lines.append(
            f"  {name:12s} {_fmt(d['hit_of_shared'] and 100 * d['hit_of_shared'], '.1f')}% of shared  "
            f"token hits {_fmt(d['token_hit_rate'] and 100 * d['token_hit_rate'], '.1f')}% "
            f"(bound {_fmt(d['bound'] and 100 * d['bound'], '.1f')}%)"
        )
    got = out.get("recap", {}).get("hit_of_shared")
    out["target"] = {
        "what": "recap hits >= 90% of the tokens shared before the insertion point",
        "value": got,
        "met": None if got is None else got >= 0.9,
    }
    return out, lines


def shared_prefix(runs: dict[str, ConfigRun], recipe: Recipe, space: TokenSpace, block_size: int) -> Findings:
    """Hits over the shareable tokens (repetition)."""
    out: dict[str, Any] = {}
    lines = ["cached tokens / shareable tokens:"]
    for name, run in runs.items():
        share = shareable_tokens(run.results, block_size)
        total = sum(share)
        v = sum(min(r.cached_tokens, s) for r, s in zip(run.results, share)) / total if total else None
        out[name] = {"hit_of_shareable": v}
        lines.append(f"  {name:12s} {_fmt(v and 100 * v, '.1f')}%")
    return out, lines


def nothing(runs: dict[str, ConfigRun], recipe: Recipe, space: TokenSpace, block_size: int) -> Findings:
    return {}, []


HIGHLIGHTS = {
    "multiturn": multiturn,
    "sysprompt": sysprompt,
    "insert": insert,
    "repetition": shared_prefix,
    "throughput": nothing,
}
