"""Engine configuration: frozen dataclasses, split by concern, passed explicitly.

Torch-free so that `recap.core` can import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

CHECKPOINT_POLICIES = ("none", "align", "all", "recap")
DEFAULT_DISK_CACHE_BYTES = 16 << 30


@dataclass(frozen=True)
class CacheConfig:
    """How the KV block pool and the state pool are sized and used."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    checkpoint_policy: str = "recap"
    # recap policy: checkpoint every `checkpoint_interval` blocks as well (None: off).
    checkpoint_interval: int | None = None
    # recap policy: geometric checkpoints 1, 2, 4, ... blocks after each segment start.
    checkpoint_geometric: bool = False
    kv_cache_bytes: int | None = None
    state_cache_bytes: int | None = None
    # The disk tier (docs/tiers.md): evicted checkpoints and KV blocks are saved under this directory and read
    # back on a deeper hit, across restarts. `cache_disk_bytes` bounds their payload bytes (default
    # DEFAULT_DISK_CACHE_BYTES when only the directory is given).
    cache_dir: str | None = None
    cache_disk_bytes: int | None = None
    # The host-memory tier (docs/tiers.md): a byte budget of host RAM between the read pools and the disk tier
    # (0/None: none). On a GPU server its copies are device <-> host; on a CPU server the same RAM, still its own
    # budget and index.
    cache_host_bytes: int | None = None

    @property
    def tier_names(self) -> tuple[str, ...]:
        """The lower tiers this config asks for, fastest first (their order is their level in the core)."""
        return tuple(n for n, b in (("host", self.cache_host_bytes or 0), ("disk", self.disk_tier_bytes)) if b)

    @property
    def disk_tier_bytes(self) -> int:
        """The disk tier's budget in bytes (0: no disk tier)."""
        if self.cache_disk_bytes is not None:
            return self.cache_disk_bytes
        return DEFAULT_DISK_CACHE_BYTES if self.cache_dir is not None else 0

    def __post_init__(self) -> None:
        if self.cache_disk_bytes is not None and self.cache_disk_bytes < 0:
            raise ValueError(f"cache_disk_bytes must be >= 0, got {self.cache_disk_bytes}")
        if self.cache_host_bytes is not None and self.cache_host_bytes < 0:
            raise ValueError(f"cache_host_bytes must be >= 0, got {self.cache_host_bytes}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.checkpoint_policy not in CHECKPOINT_POLICIES:
            raise ValueError(
                f"unknown checkpoint_policy {self.checkpoint_policy!r}; choose one of {CHECKPOINT_POLICIES}"
            )
        if self.checkpoint_interval is not None and self.checkpoint_interval <= 0:
            raise ValueError("checkpoint_interval must be a positive number of blocks")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    # vLLM's --async-scheduling: the next step is scheduled while the previous one runs (core/async_scheduling.py).
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class CacheLayout:
    """What the cache core must know about a model and its memory, in integers.

    Built by the runner from the model config and byte budgets; for trace replay
    it comes from a named model shape.
    """

    block_size: int
    num_kv_blocks: int  # including the null block 0
    num_state_slots: int  # running slots and checkpoints share this pool
    has_kv: bool  # the model has full-attention layers
    has_state: bool  # the model has SSM layers
    kv_bytes_per_token: int = 0
    state_bytes_per_slot: int = 0
    flops_per_token: float = 1.0  # prefill FLOPs per token, for checkpoint utility
    # The window group (sliding-window attention layers): the widest window in tokens (a query sees itself
    # and the window - 1 tokens before it; 0: no window group) and its own block pool, null block included.
    sliding_window: int = 0
    num_window_blocks: int = 0
    window_bytes_per_token: int = 0

    @property
    def has_window(self) -> bool:
        return self.sliding_window > 0

    def __post_init__(self) -> None:
        if not (self.has_kv or self.has_state or self.has_window):
            raise ValueError("a model needs at least one cache group")
        if self.has_kv and self.num_kv_blocks < 2:
            raise ValueError("need at least one KV block besides the null block")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0 tokens, got {self.sliding_window}")
        if self.has_window and self.num_window_blocks < 2:
            raise ValueError("need at least one window block besides the null block")
        if self.has_state and self.num_state_slots < 1:
            raise ValueError("need at least one state slot")


SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's --speculative-config): a drafter proposes up to `num_speculative_tokens`
    tokens per decode step and one forward pass verifies them (docs/speculative.md).

    method "ngram" (prompt lookup): the longest n-gram, n from `prompt_lookup_max` down to `prompt_lookup_min`,
    ending the request's tokens that occurred earlier in them proposes the tokens that followed it.
    method "draft_model": `model` (a folder or hub id of a smaller model with the target's tokenizer) proposes them
    greedily, run by the runner beside the target (runner/draft_model.py).
    method "mtp": the checkpoint's multi-token-prediction head (Qwen3.5 / Qwen3-Next `mtp.*`) proposes them greedily
    from the target's hidden states, in the runner (runner/mtp_drafter.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # recap's: after verify steps in a row that accept nothing, a request skips drafting for 1, 7, 31, 127, ...
    # decode steps (up to this many; 0: always draft), and its probes carry half the missed step's drafts after
    # one miss, 1 after more (an accepted draft resets both; core/speculation.backoff_steps). Acceptance history
    # lowers the cost of a drafter that keeps missing.
    max_draft_backoff: int = 64
    model: str | None = None  # method "draft_model": the draft model

    def __post_init__(self) -> None:
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(f"speculative 'model' is needed by method 'draft_model' and only by it (method "
                             f"{self.method!r}, model {self.model!r})")
        if not isinstance(self.max_draft_backoff, int) or self.max_draft_backoff < 0:
            raise ValueError(f"speculative max_draft_backoff must be an integer >= 0, got {self.max_draft_backoff!r}")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; one of {SPECULATIVE_METHODS}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative {name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )

    @classmethod
    def parse(cls, value: str | dict[str, object] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From vLLM's JSON object (a string or a dict); None stays None. Raises ValueError naming the problem."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown keys {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise ValueError(f"speculative config needs a 'method' (one of {SPECULATIVE_METHODS})")
        return cls(**value)  # type: ignore[arg-type]
