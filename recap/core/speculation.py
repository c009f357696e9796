"""Speculative decoding in the scheduler: how many drafts a decode step may carry, and what a verified step
leaves behind (docs/speculative.md). Torch-free.

A decode step with drafts is a decode of 1 + k tokens: [last token, d1..dk] at positions N-1..N-1+k, where N is
the request's committed token count. The runner verifies them in the same forward pass and reports the tokens it
emits: the accepted drafts d1..da and one token of its own. The request then has N + a computed tokens, so a
rejected draft's KV (positions N+a..N-1+k) lies past the computed tokens, is never hashed or registered, and is
overwritten by the next steps; its state never reaches the running slot (the runner restores the state after
N + a tokens).

Drafts never cross a block boundary past N: the hash of a block that ends inside the drafts would need tokens
that are not committed yet, so no checkpoint (and no full KV block) can depend on a draft token. A boundary at N
itself is the last committed token's, planned as in a plain decode.

A draft model (method "draft_model") or an MTP head (method "mtp") runs in the runner, which owns models: the
scheduler decides how many drafts a row may carry and budgets them (ScheduledRequest.num_runner_drafts); the runner
proposes them before its forward pass and reports them with the emitted tokens (ModelRunnerOutput.draft_token_ids),
checked here as any drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from recap.config import SpeculativeConfig
from recap.core.drafter import Drafter, NgramDrafter
from recap.core.request import Request

# The most rows of one step that carry drafts: the runner keeps num_speculative_tokens scratch state slots for each
# (runner/speculative.py), so this bounds their memory whatever max_num_seqs is.
MAX_DRAFTING_ROWS = 16

# A request's first verify steps carry at most this many drafts (or num_speculative_tokens, if fewer); a step that
# accepts all it carried doubles the request's cap, up to num_speculative_tokens. So a large k costs a drafter
# that keeps missing no more than k = 4 does (its probes stay short), and one that keeps being right (prompt
# lookup on a rewrite) reaches long verify rows within a few steps.
FIRST_DRAFTS = 4


def backoff_steps(misses: int, bound: int) -> int:
    """Decode steps without drafts after `misses` verify steps in a row that accepted nothing: 1, 7, 31, 127, ...
    (four times the last skip, plus 3), at most `bound` (max_draft_backoff; 0: none). A drafter that is never
    right is then probed about log4(3 N) times in a request's first N steps until the skips reach the bound,
    once per bound + 1 steps after that; one isolated miss costs a single skipped step."""
    return min((1 << min(2 * misses - 1, 31)) - 1, bound)


def drafting_rows(max_num_seqs: int) -> int:
    return min(max_num_seqs, MAX_DRAFTING_ROWS)


@dataclass
class SpecCounters:
    """vLLM's spec-decode counters: steps that carried drafts, draft and accepted tokens, and accepted drafts by
    position (entry j counts steps that accepted draft j + 1)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the verifier's own): vLLM's mean acceptance length."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self) -> SpecCounters:
        """A snapshot that later steps do not change (stats and metrics hold these)."""
        return replace(self, accepted_per_position=list(self.accepted_per_position))


def make_drafter(config: SpeculativeConfig) -> Drafter | None:
    """The scheduler's drafter for `config`; None where the runner proposes (a draft model)."""
    if config.method == "ngram":
        return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method in ("draft_model", "mtp"):
        return None
    raise ValueError(f"no drafter for speculative method {config.method!r}")


class Speculator:
    """The scheduler's speculation: drafts per decode step (capped), and acceptance bookkeeping."""

    def __init__(self, config: SpeculativeConfig, block_size: int, max_model_len: int,
                 drafter: Drafter | None = None, max_rows: int = MAX_DRAFTING_ROWS,
                 max_step_tokens: int | None = None) -> None:  # fmt: skip
        self.config = config
        self.max_rows = max_rows  # drafting rows per step (the runner's scratch slots)
        self._rows = 0  # drafting rows in the step being scheduled
        # The most tokens of a decode step with drafts (its rows and their drafts) that the backend runs fast: the
        # CPU backend's verify graph holds 16, and a larger step ran the module path at ~3 decode steps' cost (at
        # batch 8, k = 4: 0.45x plain decoding); None: no limit. The drafts of a step share what is left once
        # every running request has its decode token (`begin_step`), evenly: a row's first drafts are the likeliest
        # to be accepted, so 8 rows with one draft each gain more than 2 rows with four.
        self.max_step_tokens = max_step_tokens
        self._draft_room: int | None = None  # drafts the step being scheduled may still carry (None: any)
        self._rows_left = 0  # decode rows of the step not asked yet (they share _draft_room)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.drafter: Drafter | None = drafter if drafter is not None else make_drafter(config)
        self.counters = SpecCounters(accepted_per_position=[0] * config.num_speculative_tokens)
        self._misses: dict[str, int] = {}  # request -> verify steps in a row that accepted nothing
        self._skip: dict[str, int] = {}  # request -> decode steps left without drafts (backoff)
        # request -> most drafts per step: FIRST_DRAFTS at first, doubled by a step accepting all, halved by a
        # first miss, 1 after more misses in a row (the probes of a drafter that keeps missing: a 1 + 1 verify row)
        self._cap: dict[str, int] = {}
        # request -> (position, token): what the drafter proposed at a step skipped by the backoff (`_probe`)
        self._shadow: dict[str, tuple[int, int]] = {}

    def max_drafts(self, request: Request, budget: int) -> int:
        """How many drafts the request's next decode step may carry (0: a plain decode)."""
        n = request.num_tokens
        bs = self.block_size
        return max(0, min(
            self.config.num_speculative_tokens,
            budget - 1,  # the step's last token counts too
            request.max_tokens - len(request.output_token_ids) - 1,  # accepted drafts + 1 token <= max_tokens
            self.max_model_len - n - 1,
            (n // bs + 1) * bs - n - 1,  # no block boundary past N inside the drafts (module docstring)
        ))  # fmt: skip

    @property
    def in_runner(self) -> bool:
        """Whether the runner proposes the drafts (a draft model): the scheduler then plans only their number."""
        return self.drafter is None

    def _num_drafts(self, request: Request, budget: int) -> int:
        if not request.speculate or self._rows >= self.max_rows or self.backing_off(request):
            return 0
        k = min(self.max_drafts(request, budget), self.cap(request.request_id))
        if self._draft_room is not None:  # an even share of the room left among the rows left (rounded up)
            k = min(k, -(-self._draft_room // max(1, self._rows_left)))
        return max(0, k)

    def _took(self, drafts: int) -> None:
        """A decode row of the step was asked and carries `drafts` drafts."""
        self._rows += bool(drafts)
        self._rows_left -= 1
        if self._draft_room is not None:
            self._draft_room -= drafts

    def cap(self, request_id: str) -> int:
        """The most drafts the request's next drafting step may carry (FIRST_DRAFTS)."""
        return self._cap.get(request_id, self._first)

    @property
    def _first(self) -> int:
        return min(self.config.num_speculative_tokens, FIRST_DRAFTS)

    def backing_off(self, request: Request) -> bool:
        """Whether this decode step goes without drafts for the backoff (counted down here). A step skipped
        ends the backoff early when the token the drafter proposed at the skipped step before came true
        (`_probe`): the drafter has started to predict this output, so the next verify step pays."""
        rid = request.request_id
        seen = self._shadow.pop(rid, None)
        if self._skip.get(rid, 0) <= 0:
            return False
        if seen is not None and request.num_tokens > seen[0] and request.token_slice(seen[0], seen[0] + 1) == [seen[1]]:
            self._skip[rid] = 0  # probe now; a miss still lengthens the backoff (accept)
            return False
        self._skip[rid] -= 1
        return True

    def draft(self, request: Request, budget: int) -> list[int]:
        """Drafts for a request whose next step is a decode (its last token is its only uncomputed one)."""
        assert self.drafter is not None, "the runner proposes this method's drafts (runner_drafts)"
        skipped = self._skip.get(request.request_id, 0) > 0
        k = self._num_drafts(request, budget)
        if not k and skipped and request.speculate:
            self._probe(request)
        drafts = [int(t) for t in self.drafter.propose(request, k)[:k]] if k else []
        self._took(len(drafts))
        return drafts

    def _probe(self, request: Request) -> None:
        """A step the backoff skips: note the drafter's next token, to be checked against the token this step
        commits (one proposal of one token: the n-gram drafter's lookup, no verify row)."""
        assert self.drafter is not None
        proposal = self.drafter.propose(request, 1)
        if proposal:
            self._shadow[request.request_id] = (request.num_tokens, int(proposal[0]))

    def runner_drafts(self, request: Request, budget: int) -> int:
        """How many drafts the runner's draft model may propose for this decode (0: a plain decode)."""
        k = self._num_drafts(request, budget)
        self._took(k)
        return k

    def begin_step(self, decode_rows: int = 0) -> None:
        """A new step, whose running requests take `decode_rows` tokens before any draft (max_step_tokens)."""
        self._rows = 0
        self._rows_left = decode_rows
        self._draft_room = None if self.max_step_tokens is None else max(0, self.max_step_tokens - decode_rows)

    def accept(self, request: Request, drafts: Sequence[int], emitted: Sequence[int], planned: int) -> None:
        """Check what the runner emitted for a verify step against its drafts (at most `planned`); count it."""
        a = len(emitted) - 1
        if len(drafts) > planned:
            raise RuntimeError(f"{request.request_id}: the runner verified {len(drafts)} drafts, {planned} planned")
        if not 0 <= a <= len(drafts) or list(emitted[:a]) != list(drafts[:a]):
            raise RuntimeError(f"{request.request_id}: verifier emitted {list(emitted)} for drafts {list(drafts)}")
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += len(drafts)
        c.num_accepted_tokens += a
        for j in range(a):
            c.accepted_per_position[j] += 1
        rid = request.request_id
        misses = self._misses[rid] = self._misses.get(rid, 0) + 1 if a == 0 else 0
        if misses:
            self._skip[rid] = backoff_steps(misses, self.config.max_draft_backoff)
            if self.config.max_draft_backoff:  # and the probes draft less: a short verify row costs less
                self._cap[rid] = max(1, len(drafts) // 2) if misses == 1 else 1
        else:  # at least the first cap again; all accepted: twice the cap (FIRST_DRAFTS)
            cap = self.cap(rid)
            grown = min(self.config.num_speculative_tokens, 2 * cap if a == len(drafts) else cap)
            self._cap[rid] = max(self._first, grown)

    def forget(self, request_id: str) -> None:
        if self.drafter is not None:
            self.drafter.forget(request_id)
        self._misses.pop(request_id, None)
        self._skip.pop(request_id, None)
        self._cap.pop(request_id, None)
        self._shadow.pop(request_id, None)
