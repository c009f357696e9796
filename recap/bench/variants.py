"""Policy specs for replay: a core checkpoint policy plus options, some of them bench-only variants.

Grammar: `NAME[:OPT[,OPT...]]`, NAME one of recap.config.CHECKPOINT_POLICIES. Options (recap only,
except `evict`):
- `interval=K`, `geometric`: CacheConfig fields (the recap policy's optional components).
- `no-branch`: without learned branch points.    `no-decode`: without decode-end snapshots.
- `no-end`: without the prompt-end checkpoint.
- `end-grid=G`: also checkpoint the prompt end rounded down to a multiple of G tokens.
- `tail=N`: also checkpoint N boundaries before the prompt end, 1, 2, 4, ... blocks back.
- `evict=lru`: the state pool evicts the least recently used checkpoint, ignoring depth.
- `kv-lru`: KV blocks are evicted plain LRU (the core first evicts "cold" blocks, those past the
  deepest checkpoint of the chain that freed them).
- `evict=slru[P]`: segmented LRU. A checkpoint starts in *probation*; a hit moves it to *protected*;
  learned branch points and segment boundaries (evidence of sharing) start protected. The
  victim is the probation LRU, unless probation is down to P% of the pool (default 10), then the
  protected LRU. One-shot checkpoints (a prompt end or decode end nobody reuses) can then never
  flush the proven ones.
The core's default (`evict=gds`) is GreedyDual: recency plus compute saved per byte, i.e. depth.
Bench-only variants swap the scheduler's policy / state pool for a subclass before the first
request; recap/core stays untouched.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from recap.config import CHECKPOINT_POLICIES, CacheConfig
from recap.core.output import CheckpointWrite
from recap.core.policy import CheckpointPolicy
from recap.core.request import Request
from recap.core.scheduler import Scheduler
from recap.core.state_pool import SlotKind, StatePool

FLAGS = {"geometric": ("geometric", True), "no-branch": ("branch", False), "no-decode": ("decode_end", False)}
FLAGS["no-end"] = ("prompt_end", False)
FLAGS["kv-lru"] = ("kv_lru", True)
INT_OPTIONS = {"interval": "interval", "tail": "tail", "end-grid": "end_grid"}


@dataclass(frozen=True)
class PolicySpec:
    text: str
    name: str
    interval: int | None = None
    geometric: bool = False
    branch: bool = True
    decode_end: bool = True
    prompt_end: bool = True
    end_grid: int = 0
    tail: int = 0
    evict: str = "gds"
    probation_pct: int = 10
    kv_lru: bool = False

    @property
    def changes_policy(self) -> bool:
        return not (self.branch and self.decode_end and self.prompt_end) or bool(self.tail or self.end_grid)

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
        slru = re.fullmatch(r"slru(\d*)", value) if key == "evict" else None
        if not eq and key in FLAGS:
            kw[FLAGS[key][0]] = FLAGS[key][1]
        elif eq and key in INT_OPTIONS and value.isdigit() and int(value) > 0:
            kw[INT_OPTIONS[key]] = int(value)
        elif key == "evict" and value in ("gds", "lru"):
            kw["evict"] = value
        elif slru and (not slru.group(1) or 0 < int(slru.group(1)) < 100):
            kw["evict"] = "slru"
            kw["probation_pct"] = int(slru.group(1) or 10)
        else:
            raise ValueError(
                f"bad policy option {opt!r} in {text!r}; flags {sorted(FLAGS)}, values "
                f"{'/'.join(INT_OPTIONS)}=N (positive), evict=gds|lru|slru[PCT]"
            )
    if name != "recap" and set(kw) - {"evict", "probation_pct", "kv_lru"}:
        raise ValueError(f"{text!r}: only the recap policy takes options other than evict and kv-lru")
    return PolicySpec(text=text, name=name, **kw)  # type: ignore[arg-type]


class VariantPolicy(CheckpointPolicy):
    """The core policy with components switched off or positions added; remembers proven positions."""

    def __init__(self, cache_config: CacheConfig, has_state: bool, spec: PolicySpec) -> None:
        super().__init__(cache_config, has_state)
        self.spec = spec
        self.proven_hashes: set[int] = set()  # branch points and segment ends: born protected (slru)

    def admit(self, request: Request, hit_tokens: int, kv_hit_tokens: int) -> None:
        spec, bs = self.spec, self.block_size
        before = self.num_branch_points
        super().admit(request, hit_tokens, kv_hit_tokens if spec.branch else 0)
        if not spec.branch:
            self.num_branch_points = before
        static = self._static.get(request.request_id)
        if static is None or self.name != "recap":
            return
        proven = {b // bs * bs for b in request.segment_boundaries if bs <= b <= request.num_prompt_tokens}
        if spec.branch and kv_hit_tokens > hit_tokens:
            proven.add(kv_hit_tokens)
        end = self.prompt_end(request)
        positions = set(static)
        if not spec.prompt_end and end not in proven:
            positions.discard(end)
        if spec.end_grid:
            positions.add((request.num_prompt_tokens - 1) // spec.end_grid * spec.end_grid // bs * bs)
        positions |= {end - (1 << i) * bs for i in range(spec.tail)}
        self._static[request.request_id] = frozenset(p for p in positions if p > 0)
        hashes = request.block_hashes
        self.proven_hashes |= {hashes[p // bs - 1] for p in proven if 0 < p <= len(hashes) * bs}

    def positions(self, request: Request, start: int, end: int) -> list[tuple[int, bool]]:
        out = super().positions(request, start, end)
        if not self.spec.decode_end:
            out = [(p, prov) for p, prov in out if not prov]
        return out


class LRUStatePool(StatePool):
    """Checkpoints all worth the same: GreedyDual degenerates to LRU (refresh on hit)."""

    def value(self, position: int) -> float:
        return 1.0


class SegmentedStatePool(StatePool):
    """Segmented LRU over checkpoints (see the module docstring); running slots work as in the core."""

    def __init__(self, base: StatePool, probation_pct: int, proven_hashes: set[int]) -> None:
        super().__init__(base.num_slots, base.block_size, base.bytes_per_slot, 1.0)
        self.probation_floor = base.num_slots * probation_pct // 100
        self.proven_hashes = proven_hashes
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[int, None] = OrderedDict()

    def _push(self, slot: int) -> None:  # no heap: the two segments order the checkpoints
        pass

    def register(
        self,
        written: CheckpointWrite,
        planned: CheckpointWrite | None,
        block_hash: int,
        request_block_hashes: Sequence[int],
    ) -> bool:
        ok = super().register(written, planned, block_hash, request_block_hashes)
        if ok:
            proven = block_hash in self.proven_hashes
            self.proven_hashes.discard(block_hash)
            (self.protected if proven else self.probation)[written.slot] = None
        return ok

    def touch(self, slot: int) -> None:
        super().touch(slot)
        self.probation.pop(slot, None)
        self.protected.pop(slot, None)
        self.protected[slot] = None

    def _unregister(self, slot: int) -> None:
        super()._unregister(slot)
        self.probation.pop(slot, None)
        self.protected.pop(slot, None)

    def _evict_one(self, max_priority: float | None) -> int | None:
        order = (self.probation, self.protected)
        if len(self.probation) <= self.probation_floor:
            order = (self.protected, self.probation)
        for segment in order:
            victim = next((s for s in segment if self.pins[s] == 0 and self.kind[s] == SlotKind.CHECKPOINT), None)
            if victim is not None:
                self._unregister(victim)
                self.num_evicted += 1
                return victim
        return None


def apply_variant(sched: Scheduler, spec: PolicySpec) -> None:
    """Swap in the variant policy / state pool. Call before the first request is added."""
    cache = sched.cache
    if spec.kv_lru and cache.kv is not None:
        kv = cache.kv
        plain_free = kv.free
        kv.free = lambda request_id, num_warm=None: plain_free(request_id, None)  # type: ignore[method-assign]
    if spec.changes_policy or spec.evict == "slru":
        cache.policy = VariantPolicy(sched.cache_config, sched.layout.has_state, spec)
    if cache.state is None or spec.evict == "gds":
        return
    old = cache.state.pool
    assert old.num_free == old.num_slots, "swap the state pool before any request"
    if spec.evict == "lru":
        cache.state.pool = LRUStatePool(old.num_slots, old.block_size, old.bytes_per_slot, 1.0)
    else:
        assert isinstance(cache.policy, VariantPolicy)
        cache.state.pool = SegmentedStatePool(old, spec.probation_pct, cache.policy.proven_hashes)
