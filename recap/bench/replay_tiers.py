"""Lower cache tiers in the trace replay: host memory and disk below the read pools, with byte budgets and
copy bandwidths, so hit rate and modelled TTFT can be studied at production sizes (issue 33, item 5).

What is modelled (each tier's bookkeeping is the core's `TierIndex`, one per tier):
- Demotion: a checkpoint the state pool evicts (the `on_spill` hook, the point where the engine's tier
  saves it), or a KV block the KV pool evicts, moves to the first tier; what a tier evicts to make room
  (LRU) moves to the next one; what the last tier evicts is gone. A checkpoint dropped because its KV
  block left follows only if that block was demoted too (without it the checkpoint can never hit).
  Writes are taken as done at once: saves run in the background and the budgets, not their bandwidth,
  decide what a tier holds. An entry already held is only refreshed (promoted entries stay in their tier).
- Promotion: when a request arrives, its hit through the read pools is compared with the hit through the
  tiers too (KV for every block up to n from the read pool or a tier, and a checkpoint at n from either,
  searched from the fastest tier down). If the tiers make it deeper, the request waits outside the
  scheduler while the entries are copied; other requests keep running (a request waiting on its copy does
  not stall the batch). Each tier's link is a FIFO channel: a copy of B bytes from tier T starts when T's
  previous copy ends and takes B / bandwidth(T). When every copy ended, the entries are registered in the
  read pools (KV blocks by hash; the checkpoint through the state pool's provenance-checked `register`,
  taking the slot of its lowest-priority checkpoint if none is free) and the request joins the waiting
  queue, where `find_hit` sees them like any cached entry. So its TTFT includes the copy time.
- Counted: per tier entries, bytes, demotions, evictions, promoted entries and bytes; requests promoted,
  and tokens of hits that needed a lower tier (a request whose cached tokens reach the promoted depth).
"""

from __future__ import annotations

import argparse
import heapq
import math
from dataclasses import dataclass, field

from recap.bench.shapes import ModelShape
from recap.core.output import CheckpointWrite
from recap.core.policy import Source
from recap.core.request import Request
from recap.core.scheduler import Scheduler
from recap.core.state_pool import PlannedWrite
from recap.core.tier_index import EntryKind, TierIndex, TierKey
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
class _Load:
    request: Request
    target: int  # blocks: the hit depth the load makes possible
    keys: list[tuple[int, TierKey]]  # (tier, key) entries read, pinned until registered
    ready_s: float


@dataclass
class TierTally:
    promoted_entries: list[int] = field(default_factory=list)  # per tier
    promoted_bytes: list[int] = field(default_factory=list)
    requests_promoted: int = 0
    copy_seconds: float = 0.0  # summed over promoted requests: arrival to copy end
    tier_hit_tokens: int = 0
    peak_bytes: list[int] = field(default_factory=list)


class ReplayTiers:
    """Tiers below one replay scheduler's read pools. Side effects: on the pools (registration) and tiers."""

    def __init__(self, sched: Scheduler, specs: tuple[TierSpec, ...], shape: ModelShape, block_size: int) -> None:
        self.sched, self.cache = sched, sched.cache
        self.specs = [s for s in specs if s.budget_bytes > 0]
        self.tiers = [TierIndex(s.name, s.budget_bytes) for s in self.specs]
        self.busy_until = [0.0] * len(self.tiers)
        self.checkpoint_bytes = shape.state_bytes_per_slot
        self.kv_block_bytes = block_size * shape.kv_bytes_per_token
        self._meta: dict[int, tuple[int, bool]] = {}  # checkpoint hash -> (value tokens, proven) when it left
        self._loading: list[tuple[float, int, _Load]] = []
        self._targets: dict[str, int] = {}  # request -> promoted hit depth in tokens
        self._seq = 0
        self.tally = TierTally([0] * len(self.tiers), [0] * len(self.tiers), peak_bytes=[0] * len(self.tiers))
        if self.cache.state is not None:
            self.cache.state.pool.on_spill = self._spill_checkpoint
        if self.cache.kv is not None:
            self.cache.kv.pool.on_spill = self._spill_kv
            self.cache.lower_kv = lambda h: any(t.has_kv(h) for t in self.tiers)  # the tail learner's index

    # -- demotion ---------------------------------------------------------------------------------
    def _spill_checkpoint(self, slot: int, block_hash: int, position: int, stranded: bool) -> None:
        if stranded and not any(t.has_kv(block_hash) for t in self.tiers):
            return
        pool = self.cache.state.pool  # type: ignore[union-attr]
        self._meta[block_hash] = (pool.slot_value_tokens[slot], pool.slot_proven[slot])
        self._demote(TierKey(EntryKind.CHECKPOINT, block_hash, position), 0)

    def _spill_kv(self, block_id: int, block_hash: int) -> None:
        self._demote(TierKey(EntryKind.KV, block_hash), 0)

    def _bytes(self, key: TierKey) -> int:
        return self.checkpoint_bytes if key.kind == EntryKind.CHECKPOINT else self.kv_block_bytes

    def _demote(self, key: TierKey, level: int) -> None:
        """Put `key` in tier `level`; what that evicts goes one tier down (the last tier's is gone)."""
        if level >= len(self.tiers):
            self._forget(key)
            return
        tier = self.tiers[level]
        if tier.has(key):
            tier.touch(key)
            return
        evicted = tier.reserve(key, self._bytes(key))
        if evicted is None:  # full of entries being read: not kept here
            self._demote(key, level + 1)
            return
        tier.mark_ready(key)
        self.tally.peak_bytes[level] = max(self.tally.peak_bytes[level], tier.num_bytes)
        for victim in evicted:
            self._demote(victim, level + 1)

    def _forget(self, key: TierKey) -> None:
        if key.kind == EntryKind.CHECKPOINT and not any(t.has(key) for t in self.tiers):
            self._meta.pop(key.block_hash, None)

    # -- promotion --------------------------------------------------------------------------------
    def _kv_tier(self, block_hash: int) -> int | None:
        return next((i for i, t in enumerate(self.tiers) if t.kv_ready(block_hash)), None)

    def _checkpoint_tier(self, block_hash: int) -> tuple[int, TierKey] | None:
        for i, t in enumerate(self.tiers):
            key = t.checkpoint_key(block_hash)
            if key is not None:
                return i, key
        return None

    def plan(self, request: Request) -> tuple[int, list[tuple[int, TierKey]]] | None:
        """(target blocks, (tier, key) entries to read) when the tiers make the request's hit deeper."""
        cache = self.cache
        if not self.tiers or cache.state is None or not cache.enable_caching:
            return None
        cache.update_hashes(request)
        hit = cache.find_hit(request)
        bs, hashes = cache.block_size, request.block_hashes
        max_blocks = min((request.num_tokens - 1) // bs, len(hashes))
        ext = hit.kv_hit_tokens // bs if cache.kv is not None else max_blocks
        kv_reads: list[tuple[int, int, TierKey]] = []  # (block index, tier, key) past the KV hit
        while cache.kv is not None and ext < max_blocks:
            if cache.kv.pool.lookup(hashes[ext]) is None:
                tier = self._kv_tier(hashes[ext])
                if tier is None:
                    break
                kv_reads.append((ext, tier, TierKey(EntryKind.KV, hashes[ext])))
            ext += 1
        for k in range(ext, hit.num_tokens // bs, -1):
            reads = [(tier, key) for i, tier, key in kv_reads if i < k]
            if cache.state.pool.lookup(hashes[k - 1]) is not None:
                return (k, reads) if reads else None
            found = self._checkpoint_tier(hashes[k - 1])
            if found is not None:
                return k, [*reads, found]
        return None

    def arrive(self, request: Request, now: float) -> bool:
        """Start the request's copies if the tiers deepen its hit; False: add it to the scheduler now."""
        planned = self.plan(request)
        if planned is None:
            return False
        target, keys = planned
        per_tier = [0] * len(self.tiers)
        for level, key in keys:
            per_tier[level] += self._bytes(key)
            self.tiers[level].pin(key)
            self.tiers[level].counters.hits += 1
        ready = now
        for level, nbytes in enumerate(per_tier):
            if nbytes:
                start = max(now, self.busy_until[level])
                self.busy_until[level] = start + nbytes / self.specs[level].bandwidth
                ready = max(ready, self.busy_until[level])
                self.tally.promoted_bytes[level] += nbytes
        self._seq += 1
        heapq.heappush(self._loading, (ready, self._seq, _Load(request, target, keys, ready)))
        self.tally.requests_promoted += 1
        self.tally.copy_seconds += ready - now
        return True

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    def next_ready(self) -> float:
        return self._loading[0][0] if self._loading else math.inf

    def admit_ready(self, now: float) -> None:
        """Register the entries of every finished copy and queue their requests (in copy-end order)."""
        while self._loading and self._loading[0][0] <= now:
            load = heapq.heappop(self._loading)[2]
            for level, key in load.keys:
                self.tiers[level].unpin(key)
            if self._register(load):
                self._targets[load.request.request_id] = load.target * self.cache.block_size
            self.sched.add_request(load.request)

    def _register(self, load: _Load) -> bool:
        """The loaded entries into the read pools; False when the pools cannot take them now."""
        cache, request = self.cache, load.request
        bs, hashes = cache.block_size, request.block_hashes
        if cache.kv is not None and not self._register_kv(hashes[: load.target]):
            return False
        state = cache.state
        assert state is not None
        block_hash = hashes[load.target - 1]
        if state.pool.lookup(block_hash) is not None:
            return True
        slot = state.pool.allocate_checkpoints([(block_hash, math.inf, False)])[0]  # outranks every checkpoint
        if slot is None:
            return False
        value, proven = self._meta.get(block_hash, (load.target * bs, False))
        write = CheckpointWrite(load.target * bs, slot)
        plan = PlannedWrite(write, block_hash, False, proven, Source.TIER, value)
        ok = state.pool.register([plan], [write], hashes)[0]
        for level, key in load.keys:
            if key.kind == EntryKind.CHECKPOINT:
                self.tiers[level].counters.promotions += 1
                self.tally.promoted_entries[level] += 1
        return ok

    def _register_kv(self, hashes: list[int]) -> bool:
        """Cache the prefix's missing KV blocks from the tiers; its cached ones are held meanwhile."""
        pool = self.cache.kv.pool  # type: ignore[union-attr]
        table: list[int | None] = [pool.lookup(h) for h in hashes]
        held = [b for b in table if b is not None]
        missing = [i for i, b in enumerate(table) if b is None]
        if not missing:
            return True
        if len(missing) > pool.num_free - pool.num_free_among(held) or any(
            self._kv_tier(hashes[i]) is None for i in missing
        ):
            return False  # no room, or the tier lost a block meanwhile: the hit stops where the pools do
        pool.touch(held)
        fresh = pool.allocate(len(missing))
        pool.cache_blocks(fresh, [hashes[i] for i in missing])
        for i, block_id in zip(missing, fresh):
            table[i] = block_id
            level = self._kv_tier(hashes[i])
            assert level is not None
            self.tiers[level].counters.promotions += 1
            self.tally.promoted_entries[level] += 1
        pool.free([b for b in table if b is not None])  # tail first, as a request frees its table
        return True

    # -- results ----------------------------------------------------------------------------------
    def note_cached(self, request_id: str, cached_tokens: int) -> None:
        target = self._targets.pop(request_id, None)
        if target is not None and cached_tokens >= target:
            self.tally.tier_hit_tokens += cached_tokens

    def summary(self) -> dict:
        tiers = []
        for level, (spec, tier) in enumerate(zip(self.specs, self.tiers)):
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
                    "promoted_entries": self.tally.promoted_entries[level],
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
