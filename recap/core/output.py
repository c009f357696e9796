"""Dataclasses at the boundary between the scheduler and the model runner. Torch-free.

The runner reads only these: it never looks inside the scheduler or the pools.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from recap.core.tier_index import TierKey

PAD_SLOT_ID = -1
# A scheduled-ahead row's last token before the runner fills it (async scheduling); no vocabulary id.
PLACEHOLDER_TOKEN_ID = -1

# Builds a NamedTuple from a tuple of all its fields without its Python-level __new__ (about 4x faster):
# for hot loops that make one per checkpoint write (millions per trace replay under policy `all`).
new_tuple = tuple.__new__


class CheckpointWrite(NamedTuple):
    """Write the state reached after exactly `position` tokens into state slot `slot`.

    A NamedTuple, not a frozen dataclass: millions are made per trace replay under policy `all`.
    """

    position: int
    slot: int


@dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request_id: str
    token_ids: list[int]  # the tokens to compute this step, at absolute positions start..start+len-1
    num_computed_tokens: int  # absolute position of token_ids[0]
    block_ids: list[int]  # KV block table covering all computed + new tokens ([] without attention layers)
    state_slot: int  # running slot the SSM layers read and update in place (PAD_SLOT_ID without SSM layers)
    # States to write at positions inside (num_computed_tokens, num_computed_tokens + len(token_ids)],
    # sorted by position; never a pad slot. Written by the kernels in this same step.
    checkpoints: list[CheckpointWrite] = field(default_factory=list)
    # Sample a token after this step (the chunk reaches the end of the known tokens).
    sample: bool = True
    sampling_params: Any = None  # recap.SamplingParams, opaque to the core
    # How many tokens have been generated so far (for per-request seeded sampling).
    num_output_tokens: int = 0
    # The request's token lists (references, not copies; stable while the step runs): the runner reads
    # them for penalties and prompt logprobs.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # Return the logprobs of the prompt tokens this chunk predicts (Request.prompt_logprobs).
    prompt_logprobs: bool = False
    # The window group's block table (sliding-window layers; [] without them): entries of blocks out of the
    # window are the null block 0 and are never read.
    window_block_ids: list[int] = field(default_factory=list)
    # Speculative decoding: the last this many of token_ids are drafts for the runner to verify (its decode
    # token comes first); 0: a plain step. Such a step never plans a checkpoint past its first token.
    num_draft_tokens: int = 0
    # A draft model's drafts (core/speculation.py): the runner proposes up to this many after token_ids (their KV
    # blocks and budget are the scheduler's) and verifies them as drafts; 0: none.
    num_runner_drafts: int = 0
    # The request may speculate: a runner-side draft model follows its prefill chunks.
    speculate: bool = False
    # Async scheduling: its last token is a placeholder (PLACEHOLDER_TOKEN_ID) for the token the step before
    # samples; the runner fills it from that step's sampled ids (runner/placeholders.py).
    placeholder: bool = False

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


class TierSave(NamedTuple):
    """Save a lower-tier entry into tier `level` (0: the fastest below the read pools), from the KV block (KV key)
    or state slot (checkpoint key) `source` that holds it now, or (`from_level` >= 0) from that tier's copy.

    The runner snapshots it before the step's state copies and forward pass, which may reuse the block or slot,
    and before the step's drops, which may delete the tier copy it moves down."""

    key: TierKey
    source: int
    level: int = 0
    from_level: int = -1  # -1: the read pool's block or slot `source`


class TierDrop(NamedTuple):
    """Delete tier `level`'s copy of an entry (evicted, or moved one tier down by a save ordered beside it)."""

    key: TierKey
    level: int = 0


class TierSaved(NamedTuple):
    """A save the runner finished: written (readable) or not."""

    key: TierKey
    ok: bool
    level: int = 0


@dataclass(frozen=True)
class TierLoad:
    """Read a request's tier entries into fresh KV and window blocks and (checkpoint) a PENDING slot, in the
    background."""

    request_id: str
    kv: tuple[tuple[TierKey, int], ...]  # (key, destination block id), in chain order
    checkpoint: tuple[TierKey, int] | None  # (key, destination slot)
    # The tier each entry is read from: kv's, then window's, then the checkpoint's (empty: all 0).
    levels: tuple[int, ...] = ()
    window: tuple[tuple[TierKey, int], ...] = ()  # (key, destination window block id), in chain order

    def entries(self) -> list[tuple[TierKey, int, int]]:
        """(key, destination block or slot, tier) of every entry: KV blocks, then window blocks (each in chain
        order), then the checkpoint."""
        pairs = [*self.kv, *self.window, *([self.checkpoint] if self.checkpoint is not None else [])]
        levels = self.levels or (0,) * len(pairs)
        return [(key, dest, level) for (key, dest), level in zip(pairs, levels, strict=True)]


@dataclass
class TierLoadReport:
    """A finished TierLoad, as the runner reports it (the data is in place before it reports)."""

    loaded: list[TierKey] = field(default_factory=list)
    failed: list[TierKey] = field(default_factory=list)  # missing, corrupt, truncated or foreign: deleted
    # The position the checkpoint file's header states, written into the load's slot (provenance).
    checkpoint: CheckpointWrite | None = None


@dataclass
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledRequest]
    # (source checkpoint slot, destination running slot): copy-on-write of hit checkpoints,
    # performed by the runner before the forward pass. Sources are pinned until the step completes.
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # Requests finished, aborted or preempted since the previous step: the runner drops their per-request
    # state (e.g. seeded generators).
    finished_request_ids: set[str] = field(default_factory=set)
    # Lower tier (core/tiers.py): saves to snapshot before anything else, files to delete, loads to start.
    tier_saves: list[TierSave] = field(default_factory=list)
    tier_drops: list[TierDrop] = field(default_factory=list)
    tier_loads: list[TierLoad] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) + s.num_runner_drafts for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """What the runner reports back after executing a SchedulerOutput."""

    # Sampled token per request that had sample=True.
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # Verify steps (num_draft_tokens > 0): the tokens emitted per request, the accepted drafts then the
    # verifier's own token; the runner has already restored the state after the accepted ones.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Rows with runner drafts (ScheduledRequest.num_runner_drafts) that got some: the drafts the runner verified.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Checkpoints actually written, per request: the kernels' reported (position, slot) pairs.
    # The core registers a checkpoint only if it matches its plan (provenance, DESIGN invariant 2).
    written_checkpoints: dict[str, list[CheckpointWrite]] = field(default_factory=dict)
    # Lower tiers: saves finished since the last report, loads finished (by request id), and the tiers whose
    # store turned itself off (an unwritable or full directory).
    tier_saved: list[TierSaved] = field(default_factory=list)
    tier_loaded: dict[str, TierLoadReport] = field(default_factory=dict)
    tier_disabled: list[int] = field(default_factory=list)
    # Opaque to the core (logprobs and the like), passed through to the engine.
    extras: dict[str, Any] = field(default_factory=dict)
    # Async scheduling: reads still on their way from the model's device (the sampled ids, the checkpoints'
    # written positions); the fields above that they fill are empty until `resolve()`.
    pending: PendingReads | None = None

    def resolve(self) -> ModelRunnerOutput:
        """Wait for the step's pending reads and fill the fields they hold (a no-op once done or when none)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.resolve(self)
        return self


class PendingReads(Protocol):
    """A step's device reads started by the runner and finished only when the engine applies the step."""

    def resolve(self, result: ModelRunnerOutput) -> None:
        """Wait for the reads and write what they say into `result`."""
