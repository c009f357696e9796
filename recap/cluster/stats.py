"""What a replica tells the router: where it can resume (DESIGN's hit), and how busy it is.

A replica can resume a prompt after k blocks when the first k KV blocks are cached and a state
checkpoint keyed by h[k-1] exists (every cache group: the longest common hit). The replica publishes
both halves compactly: the hashes of its cached KV blocks, and (hash, depth) for its checkpoints,
each truncated to 64 bits and packed as bytes, bounded in count (the most recently cached kept). The
router walks the incoming prompt's own hash chain against them. A truncated hash can only misroute,
never corrupt: the replica's own 128-bit lookup decides what it actually reuses.
Built from the cache core's integer bookkeeping only (no torch): call it on the engine thread.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from recap.core.cache_manager import CacheManager

KEY_MASK = (1 << 64) - 1
STATS_VERSION = 1


def key64(block_hash: int) -> int:
    """The published form of a 128-bit block hash."""
    return block_hash & KEY_MASK


def _pack(values: list[int], code: str) -> bytes:
    return array(code, values).tobytes()


def _unpack(data: bytes, code: str) -> list[int]:
    out = array(code)
    out.frombytes(data)
    return out.tolist()


@dataclass(frozen=True)
class StatsLimits:
    """Bounds on what one replica publishes per refresh (8 bytes a KV hash, 12 a checkpoint)."""

    max_kv_keys: int = 16384
    max_checkpoints: int = 4096

    def __post_init__(self) -> None:
        if self.max_kv_keys < 1 or self.max_checkpoints < 1:
            raise ValueError("max_kv_keys and max_checkpoints must be positive")


@dataclass(frozen=True)
class ReplicaStats:
    """One replica's routing stats at wall-clock `time` (seconds since the epoch)."""

    time: float
    block_size: int
    caching: bool  # prefix caching on: without it nothing is resumable
    has_kv: bool
    has_state: bool
    kv_keys: frozenset[int] = frozenset()
    kv_complete: bool = True  # every cached KV hash is in kv_keys (not cut by the bound)
    checkpoints: Mapping[int, int] = field(default_factory=dict)  # key64(h[k-1]) -> k (blocks)
    num_running: int = 0
    num_waiting: int = 0

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting

    def to_dict(self) -> dict[str, Any]:
        """The wire form (what a Ray Serve replica returns from record_routing_stats)."""
        keys = list(self.checkpoints)
        return {
            "v": STATS_VERSION, "time": self.time, "block_size": self.block_size, "caching": self.caching,
            "has_kv": self.has_kv, "has_state": self.has_state, "kv_complete": self.kv_complete,
            "kv": _pack(sorted(self.kv_keys), "Q"), "ckpt_keys": _pack(keys, "Q"),
            "ckpt_depths": _pack([self.checkpoints[k] for k in keys], "L"),
            "num_running": self.num_running, "num_waiting": self.num_waiting,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplicaStats:
        """Raises ValueError on a malformed or foreign-version record."""
        if data.get("v") != STATS_VERSION:
            raise ValueError(f"routing stats version {data.get('v')!r}, expected {STATS_VERSION}")
        try:
            keys, depths = _unpack(data["ckpt_keys"], "Q"), _unpack(data["ckpt_depths"], "L")
            if len(keys) != len(depths):
                raise ValueError("routing stats: checkpoint keys and depths differ in length")
            return cls(
                time=float(data["time"]), block_size=int(data["block_size"]), caching=bool(data["caching"]),
                has_kv=bool(data["has_kv"]), has_state=bool(data["has_state"]),
                kv_keys=frozenset(_unpack(data["kv"], "Q")), kv_complete=bool(data["kv_complete"]),
                checkpoints=dict(zip(keys, depths)), num_running=int(data["num_running"]),
                num_waiting=int(data["num_waiting"]),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"routing stats: malformed record ({e!r})") from None

    def kv_prefix_blocks(self, chain: list[int], max_blocks: int) -> int:
        """How many leading blocks of the chain have cached KV (0 without a KV group or caching)."""
        if not self.caching or not self.has_kv:
            return 0
        end, k = min(max_blocks, len(chain)), 0
        while k < end and chain[k] in self.kv_keys:
            k += 1
        return k

    def resumable_blocks(self, chain: list[int], max_blocks: int) -> int:
        """The deepest k <= max_blocks at which this replica can resume a prompt whose hash chain
        (key64 each) is `chain`: KV for blocks 0..k-1 and (with a state group) a checkpoint at k."""
        if not self.caching:
            return 0
        end = min(max_blocks, len(chain))
        kv_len = end
        if self.has_kv and (self.kv_complete or not self.has_state):
            kv_len = 0
            while kv_len < end and chain[kv_len] in self.kv_keys:
                kv_len += 1
        if not self.has_state:
            return kv_len
        ckpts = self.checkpoints
        for k in range(kv_len, 0, -1):
            if ckpts.get(chain[k - 1]) == k:
                return k
        return 0


def collect_stats(cache: CacheManager, num_running: int, num_waiting: int, now: float,
                  limits: StatsLimits) -> ReplicaStats:
    """The replica's stats from its cache core; read it on the thread that steps the engine."""
    kv_keys: frozenset[int] = frozenset()
    kv_complete = True
    if cache.kv is not None:
        pool = cache.kv.pool
        kv_keys = frozenset(key64(h) for h in pool.cached_hashes(limits.max_kv_keys))
        kv_complete = pool.num_cached <= limits.max_kv_keys
    checkpoints: dict[int, int] = {}
    if cache.state is not None:
        bs = cache.block_size
        for block_hash, position in cache.state.pool.checkpoint_keys(limits.max_checkpoints):
            assert position % bs == 0, f"checkpoint at {position} is not on a block boundary"
            checkpoints[key64(block_hash)] = position // bs
    return ReplicaStats(
        time=now, block_size=cache.block_size, caching=cache.enable_caching, has_kv=cache.kv is not None,
        has_state=cache.state is not None, kv_keys=kv_keys, kv_complete=kv_complete, checkpoints=checkpoints,
        num_running=num_running, num_waiting=num_waiting,
    )
