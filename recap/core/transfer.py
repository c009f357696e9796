"""The scheduler-side half of the KV connector (prefill/decode disaggregation). Integer bookkeeping.

Words (DESIGN section 1 plus):
  prefill side: the instance that computes a prompt and samples its first token, then *holds* the
                request's KV blocks, running slot and the checkpoints along its chain until the decode
                side pulled them (or a timeout expired);
  decode side:  the instance that receives them and continues decoding from position prompt_len;
  offer:        what the prefill side can send: the prompt length, the first token, the positions of
                the checkpoints it holds along the prompt's chain, and a digest of the prompt;
  receive plan: what the decode side asks for, and where it goes. The decode side looks its own cache
                up by block hash: it shares the full KV blocks it already holds and asks only for the
                rest of the prompt's blocks; it asks for the checkpoints past its own best checkpoint
                on the chain, and always for the running state after all prompt tokens.

Received full KV blocks and checkpoints are registered by `CacheManager.commit`, the same
provenance-checked path a local step uses (DESIGN invariants 2 and 7), so a later request that shares
the prefix hits on the decode side as it would on a single instance. A model with sliding-window layers
sends the window blocks its next token and its checkpoints read too (recap.core.window_transfer).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from recap.core.cache_manager import CacheHit, CacheManager
from recap.core.hashing import block_hash, root_hash
from recap.core.kv_manager import cdiv
from recap.core.output import PAD_SLOT_ID, CheckpointWrite
from recap.core.policy import Position, Source
from recap.core.request import Request
from recap.core.window_manager import WindowManager
from recap.core.window_transfer import (
    WindowHold,
    WindowReceive,
    admit_window,
    check_window_offer,
    checkpoint_needs,
    hit_positions,
    hold_window,
    receive_start,
    release_window,
    window_head,
)


def prompt_digest(request: Request) -> str:
    """A hex digest of (cache salt, extra keys, every prompt token): equal on both sides or no transfer."""
    digest = block_hash(root_hash(request.cache_salt, request.extra_keys), request.prompt_token_ids)
    return f"{digest:032x}"


# -- prefill side -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointOffer:
    """A registered checkpoint on the prefill side, pinned while its request is held."""

    position: int
    slot: int
    block_hash: int


@dataclass(frozen=True)
class HeldRequest:
    """A finished prefill request whose blocks and slots wait for the decode side's pull."""

    request: Request
    block_ids: tuple[int, ...]  # the KV table: block i holds prompt positions [i*bs, (i+1)*bs)
    state_slot: int  # running slot: the state after all prompt tokens (PAD without SSM layers)
    checkpoints: tuple[CheckpointOffer, ...]  # along the prompt's chain, pinned, in position order
    first_token_id: int
    window: WindowHold | None = None  # the window blocks held (None without sliding-window layers)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    def offer(self) -> RemoteOffer:
        return RemoteOffer(
            self.num_prompt_tokens,
            self.first_token_id,
            tuple(c.position for c in self.checkpoints),
            prompt_digest(self.request),
            None if self.window is None else self.window.start,
        )


def can_hold(request: Request) -> bool:
    """Only a request whose whole prompt was computed and whose first token was sampled is worth holding."""
    return request.num_computed_tokens == request.num_prompt_tokens and len(request.output_token_ids) == 1


def hold(cache: CacheManager, request: Request) -> HeldRequest:
    """Keep the request's table and running slot; pin every checkpoint along its prompt's chain."""
    offers: list[CheckpointOffer] = []
    state, bs = cache.state, cache.block_size
    if state is not None and state.enable_caching:
        pool, hashes = state.pool, request.block_hashes
        for k in range(1, min(request.num_prompt_tokens // bs, len(hashes)) + 1):
            slot = pool.lookup(hashes[k - 1])
            if slot is not None:
                pool.pin(slot)
                offers.append(CheckpointOffer(k * bs, slot, hashes[k - 1]))
    rid = request.request_id
    positions = hit_positions(cache, request.num_prompt_tokens, [c.position for c in offers])
    window = hold_window(cache, request, positions)
    return HeldRequest(
        request, tuple(cache.block_ids(rid)), cache.state_slot(rid), tuple(offers), request.output_token_ids[0],
        window,
    )


def release(cache: CacheManager, held: HeldRequest) -> None:
    """Unpin the offered checkpoints and free the request as usual (its cached blocks stay findable)."""
    cache.unpin([c.slot for c in held.checkpoints])
    cache.free(held.request)
    release_window(cache, held.window)


# -- decode side ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RemoteOffer:
    """The prefill side's transfer handle, as far as the core needs it."""

    num_prompt_tokens: int
    first_token_id: int
    checkpoint_positions: tuple[int, ...]
    prompt_digest: str
    window_start: int | None = None  # the first prompt block whose window block is held (None: no window layers)


@dataclass(frozen=True)
class CheckpointReceive:
    """A checkpoint to receive: the planned write (position, PENDING slot) and the chain hash it must carry."""

    write: CheckpointWrite
    block_hash: int


@dataclass(frozen=True)
class ReceivePlan:
    """Where the received data goes. Blocks `block_indices[j]` of the prompt land in `block_ids[j]`."""

    request_id: str
    num_prompt_tokens: int
    first_token_id: int
    block_indices: tuple[int, ...]
    block_ids: tuple[int, ...]
    state_slot: int  # the running slot that receives the state after all prompt tokens
    checkpoints: tuple[CheckpointReceive, ...]
    num_local_blocks: int  # full prompt blocks the decode side already held (shared, not sent)
    local_checkpoint: int  # position of the decode side's best checkpoint on the chain (0: none)
    hit_tokens: int  # the decode side's own hit (DESIGN section 1): what it reports as cached
    window: WindowReceive = WindowReceive()  # the window blocks to receive (none without a window group)


def check_offer(request: Request, offer: RemoteOffer, window: WindowManager | None = None) -> None:
    """Raise ValueError when the two sides disagree about the prompt, or the offered window blocks (this side's
    window group: `window`) cannot resume it."""
    if offer.num_prompt_tokens != request.num_prompt_tokens:
        raise ValueError(
            f"the prefill side computed {offer.num_prompt_tokens} prompt tokens, "
            f"this side tokenized {request.num_prompt_tokens}"
        )
    if offer.prompt_digest != prompt_digest(request):
        raise ValueError("the prefill side computed a different prompt (tokens or cache salt differ)")
    check_window_offer(window, request.num_prompt_tokens, offer.window_start)


def plan_receive(cache: CacheManager, request: Request, offer: RemoteOffer, hit: CacheHit) -> ReceivePlan | None:
    """Allocate the prompt's missing KV and window blocks, a running slot and checkpoint slots; None if they
    do not fit.

    Full blocks found locally by hash are shared, not received. Checkpoints are asked for only past the
    best local one (with a window group: only where the window blocks before them come too); a position
    with no slot worth taking is skipped (never preempted for).
    """
    rid, bs, num_prompt = request.request_id, cache.block_size, request.num_prompt_tokens
    hashes = request.block_hashes
    kv, state, window = cache.kv, cache.state, cache.window
    best, positions = _wanted_positions(cache, request, offer)
    head: list[int] = []
    if window is not None:
        assert offer.window_start is not None, "check_offer lets no window group through without window blocks"
        start = receive_start(window, num_prompt, offer.window_start, hit_positions(cache, num_prompt, positions))
        positions = [p for p in positions if checkpoint_needs(window, p) >= start]
        head = window_head(cache, request, start)
        if not window.can_admit(head, num_prompt):
            return None
    local: list[int] = []
    if kv is not None:
        if cache.enable_caching:
            local = kv.find_prefix(hashes, num_prompt // bs)
        if not kv.can_admit(local, num_prompt):
            return None
    if state is not None and state.pool.num_available < 1:
        return None
    slot = PAD_SLOT_ID
    if state is not None:
        state.admit(rid, PAD_SLOT_ID)
        slot = state.running[rid]
    if kv is not None:
        kv.admit(rid, local, num_prompt)
    received = admit_window(cache, request, head) if window is not None else WindowReceive()
    wanted = []
    if state is not None and positions:
        plan = state.plan(rid, hashes, [Position(p, False, False, Source.REMOTE) for p in positions])
        wanted = [CheckpointReceive(w, hashes[w.position // bs - 1]) for w in plan]
    table = cache.block_ids(rid)
    indices = tuple(range(len(local), cdiv(num_prompt, bs))) if kv is not None else ()
    return ReceivePlan(
        rid,
        num_prompt,
        offer.first_token_id,
        indices,
        tuple(table[i] for i in indices),
        slot,
        tuple(wanted),
        len(local),
        best,
        hit.num_tokens,
        received,
    )


def _wanted_positions(cache: CacheManager, request: Request, offer: RemoteOffer) -> tuple[int, list[int]]:
    """(position of the best local checkpoint on the chain, the offered positions past it)."""
    state, bs, num_prompt = cache.state, cache.block_size, request.num_prompt_tokens
    if state is None or not state.enable_caching:
        return 0, []
    best = state.find_checkpoint(request.block_hashes, num_prompt // bs)[0] * bs
    return best, [p for p in sorted(set(offer.checkpoint_positions)) if best < p <= num_prompt and p % bs == 0]


@dataclass
class RemoteBook:
    """The scheduler's disaggregation state: queued and receiving remote requests, held prefill requests."""

    queue: deque[Request] = field(default_factory=deque)  # decode: waiting for blocks and a slot
    offers: dict[str, RemoteOffer] = field(default_factory=dict)  # decode: queued or receiving
    receiving: dict[str, ReceivePlan] = field(default_factory=dict)  # decode: allocated, data in flight
    hold_ids: set[str] = field(default_factory=set)  # prefill: hold these when they finish
    held: dict[str, HeldRequest] = field(default_factory=dict)  # prefill: finished, waiting for a pull

    def drop(self, request: Request) -> None:
        """Forget a queued or receiving request (its cache resources are freed by the caller)."""
        rid = request.request_id
        if self.receiving.pop(rid, None) is None:
            self.queue.remove(request)
        self.offers.pop(rid, None)

    def held_pins(self) -> list[int]:
        return [c.slot for h in self.held.values() for c in h.checkpoints]


def select_checkpoints(held: HeldRequest, positions: Sequence[int]) -> list[CheckpointOffer]:
    """The held checkpoints at the asked positions, in the order asked (unknown positions are skipped)."""
    by_position = {c.position: c for c in held.checkpoints}
    return [by_position[p] for p in positions if p in by_position]
