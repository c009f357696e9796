"""Policy specs for replay: a core checkpoint policy plus options, some of them bench-only ablations.

Grammar: `NAME[:OPT[,OPT...]]`, NAME one of recap.config.CHECKPOINT_POLICIES. Options (recap only,
except `kv-lru`):
- `interval=K`, `geometric`: CacheConfig fields (the recap policy's optional components).
- `no-branch`: without learned branch points.    `no-decode`: without decode-end snapshots.
- `no-end`: without the prompt-end checkpoint.   `no-tail`: without the learned tail.
- `end-grid=G`: also checkpoint the prompt end rounded down to a multiple of G tokens.
- `ladder=N`: also checkpoint N boundaries before the prompt end, 1, 2, 4, ... blocks back.
- `kv-lru`: KV blocks are evicted plain LRU (the core first evicts "cold" blocks, those past the
  deepest checkpoint of the chain that freed them).
Bench-only variants swap the scheduler's policy for a subclass before the first request;
recap/core stays untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

from recap.config import CHECKPOINT_POLICIES, CacheConfig
from recap.core.policy import CheckpointPolicy, Position, Source
from recap.core.request import Request
from recap.core.scheduler import Scheduler

FLAGS = {
    "geometric": ("geometric", True),
    "no-branch": ("branch", False),
    "no-decode": ("decode_end", False),
    "no-end": ("prompt_end", False),
    "no-tail": ("tail", False),
    "kv-lru": ("kv_lru", True),
}
INT_OPTIONS = {"interval": "interval", "ladder": "ladder", "end-grid": "end_grid"}


@dataclass(frozen=True)
class PolicySpec:
    text: str
    name: str
    interval: int | None = None
    geometric: bool = False
    branch: bool = True
    decode_end: bool = True
    prompt_end: bool = True
    tail: bool = True
    end_grid: int = 0
    ladder: int = 0
    kv_lru: bool = False

    @property
    def changes_policy(self) -> bool:
        flags = self.branch and self.decode_end and self.prompt_end and self.tail
        return not flags or bool(self.ladder or self.end_grid)

    def cache_config(self, block_size: int, **budgets: int | None) -> CacheConfig:
        return CacheConfig(
            block_size=block_size,
            checkpoint_policy=self.name,
            checkpoint_interval=self.interval,
            checkpoint_geometric=self.geometric,
            kv_cache_bytes=budgets.get("kv_cache_bytes"),
            state_cache_bytes=budgets.get("state_cache_bytes"),
        )


def parse_policy(text: str) -> PolicySpec:
    """'recap:interval=32,no-branch' -> PolicySpec (ValueError naming the bad part)."""
    name, _, rest = text.partition(":")
    if name not in CHECKPOINT_POLICIES:
        raise ValueError(f"unknown policy {name!r} in {text!r}; choose one of {CHECKPOINT_POLICIES}")
    kw: dict[str, object] = {}
    for opt in filter(None, rest.split(",")):
        key, eq, value = opt.partition("=")
        if not eq and key in FLAGS:
            kw[FLAGS[key][0]] = FLAGS[key][1]
        elif eq and key in INT_OPTIONS and value.isdigit() and int(value) > 0:
            kw[INT_OPTIONS[key]] = int(value)
        else:
            values = "/".join(INT_OPTIONS)
            raise ValueError(f"bad policy option {opt!r} in {text!r}; flags {sorted(FLAGS)}, {values}=N (positive)")
    if name != "recap" and set(kw) - {"kv_lru"}:
        raise ValueError(f"{text!r}: only the recap policy takes options other than kv-lru")
    return PolicySpec(text=text, name=name, **kw)  # type: ignore[arg-type]


class VariantPolicy(CheckpointPolicy):
    """The core policy with components switched off or positions added."""

    def __init__(self, cache_config: CacheConfig, has_state: bool, spec: PolicySpec) -> None:
        super().__init__(cache_config, has_state)
        self.spec = spec
        self._learn_tail = self._learn_tail and spec.tail

    def admit(self, request: Request, hit_tokens: int, kv_hit_tokens: int, seen_tokens: int = 0) -> None:
        spec, bs = self.spec, self.block_size
        before = self.num_branch_points
        if spec.branch:
            super().admit(request, hit_tokens, kv_hit_tokens, seen_tokens)
        else:
            super().admit(request, hit_tokens, 0, 0)
        if not spec.branch:
            self.num_branch_points = before
        sites = self._static.get(request.request_id)
        if sites is None or self.name != "recap":
            return
        end = self.prompt_end(request)
        if not spec.prompt_end and sites.get(end) == Source.PROMPT_END:
            del sites[end]
        extra = {end - (1 << i) * bs for i in range(spec.ladder)}
        if spec.end_grid:
            extra.add((request.num_prompt_tokens - 1) // spec.end_grid * spec.end_grid // bs * bs)
        for p in extra:
            if p > 0:
                sites.setdefault(p, Source.GEOMETRIC)
        if not spec.decode_end:
            self._decode[request.request_id] = False

    def positions(self, request: Request, start: int, end: int) -> list[Position]:
        out = super().positions(request, start, end)
        if not self.spec.decode_end:
            out = [p for p in out if not p.provisional]
        return out


def apply_variant(sched: Scheduler, spec: PolicySpec) -> None:
    """Swap in the variant policy. Call before the first request is added."""
    cache = sched.cache
    if spec.kv_lru and cache.kv is not None:
        kv = cache.kv
        plain_free = kv.free
        kv.free = lambda request_id, num_warm=None: plain_free(request_id, None)  # type: ignore[method-assign]
    if spec.changes_policy:
        cache.policy = VariantPolicy(sched.cache_config, sched.layout.has_state, spec)
