"""Lower cache tiers in the trace replay: host memory and disk below the read pools, with byte budgets and
copy bandwidths, so hit rate and modelled TTFT can be studied at production sizes (issue 33, item 5).

The decisions are the engine's: the replay's scheduler runs the core's `TierManager` (core/tiers.py) over one
`TierIndex` per tier, so demotion (read pool -> first tier, a tier's LRU entries one tier down, the last
tier's out), promotion (a waiting request whose hit the tiers deepen leaves the queue while its entries are
copied, holding its blocks and slot; other requests keep running) and registration are the code the engine
runs. This module is only the runner side and its cost model (`ReplayTierRunner`, in the FakeExecutor's
place for tier orders):
- Saves are written at once (reported in the step that orders them): saves run in the background and the
  budgets, not their bandwidth, decide what a tier holds.
- Each tier's link is a FIFO channel: a load's B bytes from tier T start when T's previous copy ends and take
  B / bandwidth(T); the load is reported (its entries registered, its request back at the head of the
  waiting queue) at the first step at or after its last copy's end. So the request's TTFT includes the copy.
- Counted: per tier entries, bytes, demotions, evictions, promoted entries and bytes; requests promoted, and
  tokens of hits that needed a lower tier (a request whose cached tokens reach the promoted depth).
"""

from __future__ import annotations

import argparse
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from recap.bench.shapes import ModelShape
from recap.core.output import (
    CheckpointWrite,
    ModelRunnerOutput,
    SchedulerOutput,
    TierLoad,
    TierLoadReport,
    TierSaved,
)
from recap.core.scheduler import Scheduler
from recap.core.tier_index import TierIndex
from recap.core.tiers import TierManager
from recap.units import parse_bytes

DEFAULT_HOST_BANDWIDTH = 20e9  # bytes/s: pinned host memory over PCIe 5.0 x16, ~30-40% below its peak
DEFAULT_DISK_BANDWIDTH = 5e9  # bytes/s: one PCIe 4.0 NVMe drive's sequential read


@dataclass(frozen=True)
class TierSpec:
    name: str
    budget_bytes: int
    bandwidth: float  # bytes per second, tier -> read pool

    def __post_init__(self) -> None:
        if self.budget_bytes < 0 or self.bandwidth <= 0:
            raise ValueError(f"tier {self.name}: budget must be >= 0 and bandwidth > 0")


@dataclass
class TierTally:
    promoted_bytes: list[int] = field(default_factory=list)  # per tier
    requests_promoted: int = 0
    copy_seconds: float = 0.0  # summed over promoted requests: load order to copy end
    tier_hit_tokens: int = 0
    peak_bytes: list[int] = field(default_factory=list)


def attach_tiers(sched: Scheduler, specs: tuple[TierSpec, ...], shape: ModelShape, block_size: int) -> TierManager:
    """The core's tier manager under the replay scheduler's read pools, one `TierIndex` per spec with a budget."""
    indexes = [TierIndex(s.name, s.budget_bytes) for s in specs if s.budget_bytes > 0]
    sched.tiers = TierManager(sched.cache, indexes, block_size * shape.kv_bytes_per_token, shape.state_bytes_per_slot)
    return sched.tiers


class ReplayTierRunner:
    """The runner side of the tiers in the replay (FakeExecutor.tier's interface): saves at once, loads after
    their modelled copy time. Side effects: on its own channels and tally."""

    def __init__(self, sched: Scheduler, specs: tuple[TierSpec, ...], clock: Callable[[], float]) -> None:
        assert sched.tiers is not None
        self.sched, self.tiers, self.clock = sched, sched.tiers, clock
        self.specs = [s for s in specs if s.budget_bytes > 0]
        n = len(self.specs)
        self.busy_until = [0.0] * n
        self._loading: list[tuple[float, int, TierLoad]] = []
        self._cancelled: set[str] = set()
        self._targets: dict[str, int] = {}  # request -> promoted hit depth in tokens
        self._seq = 0
        self.tally = TierTally([0] * n, peak_bytes=[0] * n)

    def step(self, out: SchedulerOutput, result: ModelRunnerOutput, kv: object, slots: object,
             validate: bool, window: object = None) -> None:  # fmt: skip
        del kv, slots, validate, window  # no simulated content: the replay counts hits, not tokens
        result.tier_saved = [TierSaved(s.key, True, s.level) for s in out.tier_saves]
        for level, index in enumerate(self.tiers.indexes):
            self.tally.peak_bytes[level] = max(self.tally.peak_bytes[level], index.num_bytes)
        self._cancelled |= out.finished_request_ids & {load.request_id for _, _, load in self._loading}
        now = self.clock()
        while self._loading and self._loading[0][0] <= now:
            load = heapq.heappop(self._loading)[2]
            if load.request_id in self._cancelled:
                self._cancelled.discard(load.request_id)
                continue
            cp = load.checkpoint
            checkpoint = CheckpointWrite(cp[0].position, cp[1]) if cp is not None else None
            result.tier_loaded[load.request_id] = TierLoadReport([k for k, _, _ in load.entries()], [], checkpoint)
        for load in out.tier_loads:
            self._start(load, now)

    def _start(self, load: TierLoad, now: float) -> None:
        per_tier = [0] * len(self.specs)
        for key, _, level in load.entries():
            per_tier[level] += self.tiers.entry_bytes(key)
        ready = now
        for level, nbytes in enumerate(per_tier):
            if nbytes:
                start = max(now, self.busy_until[level])
                self.busy_until[level] = start + nbytes / self.specs[level].bandwidth
                ready = max(ready, self.busy_until[level])
                self.tally.promoted_bytes[level] += nbytes
        self._seq += 1
        heapq.heappush(self._loading, (ready, self._seq, load))
        self.tally.requests_promoted += 1
        self.tally.copy_seconds += ready - now
        self._targets[load.request_id] = self._target_tokens(load)

    def _target_tokens(self, load: TierLoad) -> int:
        if load.checkpoint is not None:
            return load.checkpoint[0].position
        request = self.sched.get_request(load.request_id)
        assert request is not None
        bs = self.sched.cache.block_size
        return (request.block_hashes.index(load.kv[-1][0].block_hash) + 1) * bs

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    def next_ready(self) -> float:
        return self._loading[0][0] if self._loading else math.inf

    # -- results ----------------------------------------------------------------------------------
    def note_cached(self, request_id: str, cached_tokens: int) -> None:
        target = self._targets.pop(request_id, None)
        if target is not None and cached_tokens >= target:
            self.tally.tier_hit_tokens += cached_tokens

    def summary(self) -> dict:
        tiers = []
        for level, (spec, tier) in enumerate(zip(self.specs, self.tiers.indexes)):
            tier.check()
            c = tier.counters
            tiers.append(
                {
                    "name": spec.name,
                    "budget_bytes": spec.budget_bytes,
                    "bandwidth_bytes_per_s": spec.bandwidth,
                    "entries": tier.num_entries,
                    "bytes": tier.num_bytes,
                    "peak_bytes": self.tally.peak_bytes[level],
                    "demotions": c.demotions,
                    "evictions": c.evictions,
                    "promoted_entries": c.promotions,
                    "promoted_bytes": self.tally.promoted_bytes[level],
                }
            )
        t = self.tally
        mean_copy = t.copy_seconds / t.requests_promoted if t.requests_promoted else 0.0
        return {
            "tiers": tiers,
            "requests_promoted": t.requests_promoted,
            "mean_copy_s": mean_copy,
            "tier_hit_tokens": t.tier_hit_tokens,
        }


def add_tier_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host-cache-bytes", default="0", help="host-memory tier below the read pools, e.g. 512GB")
    p.add_argument("--disk-cache-bytes", default="0", help="disk tier below the host tier, e.g. 4TB")
    p.add_argument(
        "--host-bandwidth",
        type=float,
        default=DEFAULT_HOST_BANDWIDTH / 1e9,
        help="GB/s from the host tier to the read pools (default 20: PCIe 5.0 x16, pinned memory)",
    )
    p.add_argument(
        "--disk-bandwidth",
        type=float,
        default=DEFAULT_DISK_BANDWIDTH / 1e9,
        help="GB/s from the disk tier to the read pools (default 5: one NVMe drive)",
    )


def tier_specs(args: argparse.Namespace) -> tuple[TierSpec, ...]:
    """The tiers the flags ask for, fastest first; a zero budget is no tier."""
    specs = (
        TierSpec("host", parse_bytes(args.host_cache_bytes), args.host_bandwidth * 1e9),
        TierSpec("disk", parse_bytes(args.disk_cache_bytes), args.disk_bandwidth * 1e9),
    )
    return tuple(s for s in specs if s.budget_bytes > 0)


def format_tiers(summary: dict) -> str:
    parts = [
        f"{t['name']} {t['entries']:,} entries ({t['bytes'] / 1e9:,.1f} GB), {t['promoted_entries']:,} promoted"
        for t in summary["tiers"]
    ]
    return (
        "; ".join(parts) + f"; {summary['requests_promoted']:,} requests promoted, mean copy "
        f"{summary['mean_copy_s'] * 1000:.1f} ms, {summary['tier_hit_tokens']:,} tokens hit through a tier"
    )
