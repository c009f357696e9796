"""The checkpoint-aware router, as pure logic: which replica should take a prompt.

Cost model, in prefill tokens (what the request waits for, roughly):
    cost(r) = (prompt_tokens - resumable_tokens(r)) + queued_request_tokens x load(r)
resumable_tokens(r): the deepest prefix replica r can resume from (KV and checkpoint both present, from
its published stats, or predicted from requests this router sent it since); load(r): requests on r, the
larger of what r last published (less what this router saw finish there since) and what this router has
in flight there and routed since those stats were taken (earlier ones count through the stats; a prompt
that runs past the whole of one in flight is its follow-up turn: that one is over, whenever Serve's completion
callback arrives). A replica with a deeper hit but a longer queue loses once each
extra queued request costs more than the tokens the hit saves. Ties go to the replica holding the longer KV
prefix (not a hit for a hybrid, but where the branch point gets learned and checkpointed, so the next request
sharing it hits), then to the lower load, then to the replica chosen (ranked first or routed to) least recently (new
sessions spread out), then to the replica id. Stale stats (older than `max_stats_age_s`) count for load
only; a replica with no stats is routed by load alone. Session affinity follows without a session id: a
follow-up turn extends the previous prompt, whose checkpoint sits on the replica that served it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from recap.cluster.stats import ReplicaStats, key64
from recap.core.hashing import chain_hashes, root_hash

POLICIES = ("checkpoint", "round_robin", "load")


@dataclass(frozen=True)
class RouterConfig:
    block_size: int = 16  # the replicas' cache block size (the router hashes prompts the same way)
    queued_request_tokens: int = 256  # prefill tokens one queued request is worth in the cost model
    max_stats_age_s: float = 30.0  # older stats say nothing about the cache
    # A request routed this long before a replica's stats were taken had reached its engine by then: the stats
    # count it if it still runs (so a completion Serve never reports cannot keep a replica loaded).
    arrival_s: float = 2.0
    prediction_ttl_s: float = 60.0  # a routed prompt counts as cached on its replica at most this long
    # Weight of KV held past the deepest checkpoint: no hit now, but the replica learns the branch point
    # there as this request passes (DESIGN section 4), so the next request sharing it hits.
    kv_only_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.queued_request_tokens < 0:
            raise ValueError(f"queued_request_tokens must be >= 0, got {self.queued_request_tokens}")
        if not 0.0 <= self.kv_only_weight <= 1.0:
            raise ValueError(f"kv_only_weight must be in [0, 1], got {self.kv_only_weight}")
        if self.max_stats_age_s <= 0 or self.prediction_ttl_s < 0 or self.arrival_s < 0:
            raise ValueError("max_stats_age_s must be positive, prediction_ttl_s and arrival_s >= 0")


@dataclass(frozen=True)
class RouteRequest:
    """What the router needs of a request: its prompt tokens and cache salt (the hash chain's root)."""

    token_ids: Sequence[int]
    cache_salt: str | None = None
    policy: str = "checkpoint"
    pin: str | None = None  # a replica id to route to while it lives (a debug call, a stored response's call)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {self.policy!r}")


@dataclass(frozen=True)
class Choice:
    """One candidate's score, for the decision and for explaining it."""

    replica: str
    cost: float
    resumable_tokens: int
    load: int
    kv_tokens: int = 0  # the KV prefix alone (the tie-break)


@dataclass
class _Prediction:
    """A prompt routed to a replica: its KV will be there; a checkpoint at (about) its end."""

    depth: dict[int, int]  # key64 -> blocks
    routed_at: float
    completed_at: float | None = None


@dataclass
class _Replica:
    stats: ReplicaStats | None = None
    # This router's requests there, not yet completed: key -> when routed.
    in_flight: dict[str, float] = field(default_factory=dict)
    # Decision counter when last ranked first or last routed to, whichever came later: ranking covers
    # concurrent requests ranked before any of them is routed, routing covers Serve passing a request on to
    # a later rank (the first one's queue probe missed its deadline), so that replica is not starved.
    last_chosen: int = -1
    completions: list[float] = field(default_factory=list)  # this router's completions since `stats.time`
    predictions: dict[str, _Prediction] = field(default_factory=dict)


class CheckpointRouter:
    """Keeps each replica's latest stats and this router's own in-flight requests; ranks candidates.

    Not thread-safe (one event loop drives it). Side effects: `rank` counts decisions; `on_routed` and
    `on_completed` track in-flight requests and predicted cache contents.
    """

    def __init__(self, config: RouterConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self._replicas: dict[str, _Replica] = {}
        self._dead: set[str] = set()  # replica ids are never reused: a dead one stays dead
        self._decisions = 0
        self._round_robin = 0

    # -- inputs -----------------------------------------------------------------------------------
    def update_stats(self, replica: str, stats: ReplicaStats | Mapping[str, Any] | None) -> None:
        """Record a replica's published stats (a dict in wire form is parsed; bad ones are dropped)."""
        if replica in self._dead:
            return
        entry = self._replicas.setdefault(replica, _Replica())
        if stats is None or (isinstance(stats, Mapping) and not stats):
            return
        if not isinstance(stats, ReplicaStats):
            try:
                stats = ReplicaStats.from_dict(stats)
            except ValueError:
                return
        if entry.stats is not None and stats.time <= entry.stats.time:
            return
        if stats.block_size != self.config.block_size:
            return  # hashed with another block size: its keys cannot match ours
        entry.stats = stats
        entry.completions = [t for t in entry.completions if t > stats.time]
        # Predictions the replica has now had the chance to publish for itself are dropped.
        done = [k for k, p in entry.predictions.items() if p.completed_at is not None and p.completed_at < stats.time]
        for key in done:
            del entry.predictions[key]

    def forget(self, replica: str) -> None:
        """A replica died or left: nothing is routed to it again (even while a stale candidate list still
        names it), its stats and predictions go."""
        self._replicas.pop(replica, None)
        self._dead.add(replica)

    def on_routed(self, replica: str, request_key: str, request: RouteRequest) -> None:
        if replica in self._dead:
            return
        entry = self._replicas.setdefault(replica, _Replica())
        entry.in_flight[request_key] = self.clock()
        if request.pin is not None:
            return  # a call aimed at one replica: load only, no recency, no predicted cache (it carries no prompt)
        self._decisions += 1
        entry.last_chosen = self._decisions
        chain = self._chain(request)
        if chain:
            entry.predictions[request_key] = _Prediction({key: i + 1 for i, key in enumerate(chain)}, self.clock())

    def on_completed(self, replica: str, request_key: str) -> None:
        entry = self._replicas.get(replica)
        if entry is None or request_key not in entry.in_flight:
            return  # unknown, or settled already by its follow-up (`_settle_predecessors`)
        del entry.in_flight[request_key]
        # Kept even before the replica's first stats: stats taken while this request ran may arrive after its
        # completion, and must not count it (a session's next turn then saw its home loaded and moved away).
        now = self.clock()
        entry.completions = [t for t in entry.completions if now - t <= self.config.max_stats_age_s] + [now]
        prediction = entry.predictions.get(request_key)
        if prediction is not None:
            prediction.completed_at = now

    def _settle_predecessors(self, chain: list[int]) -> None:
        """A prompt that runs past the whole of a routed prompt still in flight is its follow-up turn, which the
        client sent after reading that answer: the earlier request has finished, though Serve's completion
        callback may not have reached this router yet (it then counted on its replica, and the session moved)."""
        for replica, entry in self._replicas.items():
            for key, p in list(entry.predictions.items()):
                if p.completed_at is None and key in entry.in_flight and len(chain) > len(p.depth) and all(
                        p.depth.get(chain[k]) == k + 1 for k in range(len(p.depth))):  # fmt: skip
                    self.on_completed(replica, key)

    # -- decisions --------------------------------------------------------------------------------
    def _chain(self, request: RouteRequest) -> list[int]:
        root = root_hash(request.cache_salt)
        return [key64(h) for h in chain_hashes(root, request.token_ids, self.config.block_size)]

    def _prefix_blocks(self, entry: _Replica, chain: list[int], max_blocks: int, now: float) -> tuple[int, int]:
        """(resumable blocks, KV-prefix blocks) of the chain on this replica: from its stats unless stale,
        and from the prompts this router sent it since (a prompt extending a routed one whole resumes at
        the routed one's end, where the replica checkpoints; a partial match is KV only)."""
        resumable = kv = 0
        stats = entry.stats
        if stats is not None and now - stats.time <= self.config.max_stats_age_s:
            resumable = stats.resumable_blocks(chain, max_blocks)
            kv = stats.kv_prefix_blocks(chain, max_blocks)
        ttl, end = self.config.prediction_ttl_s, min(max_blocks, len(chain))
        for p in entry.predictions.values():
            if now - p.routed_at > ttl:
                continue
            depth, k = p.depth, 0
            while k < end and depth.get(chain[k]) == k + 1:
                k += 1
            kv = max(kv, k)
            if k == len(depth):
                resumable = max(resumable, k)
        return resumable, max(kv, resumable)

    def _drop_expired(self, entry: _Replica, now: float) -> None:
        ttl = self.config.prediction_ttl_s
        old = [k for k, p in entry.predictions.items() if now - p.routed_at > ttl]
        for key in old:
            del entry.predictions[key]

    def load(self, replica: str) -> int:
        """Requests on the replica: what it last published, less what finished here since, or this
        router's own in-flight count if larger (the stats lag; other routers' requests only show there).
        In-flight requests routed `arrival_s` before the stats were taken count only through the stats."""
        entry = self._replicas.get(replica)
        if entry is None:
            return 0
        if entry.stats is None:
            return len(entry.in_flight)
        published = entry.stats.num_requests - len(entry.completions)
        seen_by = entry.stats.time - self.config.arrival_s
        return max(sum(1 for t in entry.in_flight.values() if t > seen_by), published)

    def score(self, candidates: Sequence[str], request: RouteRequest) -> list[Choice]:
        """Every candidate's cost under the request's policy, best first (the routing decision)."""
        now = self.clock()
        bs = self.config.block_size
        num_tokens = len(request.token_ids)
        chain = self._chain(request) if request.policy == "checkpoint" else []
        if chain:
            self._settle_predecessors(chain)
        max_blocks = max(0, (num_tokens - 1) // bs)  # never the last token: something must be computed
        choices = []
        for replica in [c for c in dict.fromkeys(candidates) if c not in self._dead]:
            entry = self._replicas.setdefault(replica, _Replica())
            self._drop_expired(entry, now)
            hit, kv = self._prefix_blocks(entry, chain, max_blocks, now) if chain else (0, 0)
            load = self.load(replica)
            kv_only = (kv - hit) * bs * self.config.kv_only_weight
            cost = (num_tokens - hit * bs - kv_only) + self.config.queued_request_tokens * load
            choices.append(Choice(replica, cost, hit * bs, load, kv * bs))

        def order(c: Choice) -> tuple[float, int, int, int, str]:
            return (c.cost, -c.kv_tokens, c.load, self._replicas[c.replica].last_chosen, c.replica)

        return sorted(choices, key=order)

    def rank(self, candidates: Sequence[str], request: RouteRequest) -> list[str]:
        """Candidates in the order to try them; the first is the choice. Dead replicas are never ranked;
        a pin to a live candidate ranks it alone, a pin to a dead or absent one falls back to load."""
        candidates = [c for c in dict.fromkeys(candidates) if c not in self._dead]
        if request.pin is not None:
            if request.pin in candidates:
                return [request.pin]
            request = RouteRequest(request.token_ids, request.cache_salt, "load")
        if not candidates:
            return []
        self._decisions += 1
        if request.policy == "round_robin":
            ordered = sorted(candidates)
            start = self._round_robin % len(ordered)
            self._round_robin += 1
            ranked = ordered[start:] + ordered[:start]
        else:
            ranked = [c.replica for c in self.score(candidates, request)]
        self._replicas.setdefault(ranked[0], _Replica()).last_chosen = self._decisions
        return ranked
