"""Checkpoint policies: at which block boundaries a request's SSM state is checkpointed (DESIGN 4).

Positions are absolute token counts p (a multiple of block_size): "the state after p tokens".
  prompt end:  ((prompt_len - 1) // bs) * bs, the last boundary strictly before the prompt's last token;
  decode end:  the last boundary a chunk reaches at or past the prompt length, written as a provisional
               snapshot that the request's next one supersedes (so a finished request keeps its last);
  segments:    Request.segment_boundaries rounded down to a boundary;
  branch:      the KV-hit end when the KV hit ran past the best checkpoint at admission;
  interval:    every `checkpoint_interval` blocks;
  geometric:   1, 2, 4, ... blocks after the start and after each segment boundary, inside the prompt.
Policy `none` writes nothing, `align` the prompt end, `all` every boundary, `recap` everything above
(interval and geometric only when configured). Positions never constrain chunk sizes: a chunk gets
the positions that fall inside it.
"""

from __future__ import annotations

from recap.config import CacheConfig
from recap.core.request import Request


class CheckpointPolicy:
    """Per-request checkpoint positions.

    Side effects: `admit` records the positions a request should checkpoint (including a learned
    branch point); `forget` drops them.
    """

    def __init__(self, cache_config: CacheConfig, has_state: bool) -> None:
        self.name = cache_config.checkpoint_policy
        self.block_size = cache_config.block_size
        self.enabled = has_state and cache_config.enable_prefix_caching and self.name != "none"
        interval = cache_config.checkpoint_interval if self.name == "recap" else None
        self._interval = interval * self.block_size if interval else 0
        self._geometric = self.name == "recap" and cache_config.checkpoint_geometric
        self._static: dict[str, frozenset[int]] = {}
        self.num_branch_points = 0

    def prompt_end(self, request: Request) -> int:
        return (request.num_prompt_tokens - 1) // self.block_size * self.block_size

    def admit(self, request: Request, hit_tokens: int, kv_hit_tokens: int) -> None:
        """Record the request's fixed positions; learn a branch point if its KV hit ran past the hit."""
        if not self.enabled or self.name == "all":
            return
        bs = self.block_size
        end = self.prompt_end(request)
        positions = {end} if end > 0 else set()
        if self.name == "recap":
            segments = {b // bs * bs for b in request.segment_boundaries if bs <= b <= request.num_prompt_tokens}
            positions |= segments
            if kv_hit_tokens > hit_tokens:
                positions.add(kv_hit_tokens)
                self.num_branch_points += 1
            if self._geometric:
                positions |= self._geometric_positions(sorted(segments | {0}), end)
        self._static[request.request_id] = frozenset(positions)

    def _geometric_positions(self, starts: list[int], limit: int) -> set[int]:
        out: set[int] = set()
        for start in starts:
            step = self.block_size
            while start + step <= limit:
                out.add(start + step)
                step *= 2
        return out

    def positions(self, request: Request, start: int, end: int) -> list[tuple[int, bool]]:
        """(position, provisional) for the boundaries in (start, end] to checkpoint, sorted."""
        bs = self.block_size
        first = (start // bs + 1) * bs
        if first > end or not self.enabled:
            return []
        if self.name == "all":
            return [(p, False) for p in range(first, end + 1, bs)]
        static = self._static.get(request.request_id, frozenset())
        interval = self._interval
        out = [(p, False) for p in range(first, end + 1, bs) if p in static or (interval and p % interval == 0)]
        if self.name == "recap":
            last = end // bs * bs
            if last >= request.num_prompt_tokens and not (out and out[-1][0] == last):
                out.append((last, True))
        return out

    def forget(self, request_id: str) -> None:
        self._static.pop(request_id, None)
