"""A model runner without tensors: executes a SchedulerOutput in integers.

It reports every planned checkpoint as written and samples tokens from a deterministic function of
(seed, request id, output index), or from a per-request list of forced tokens (so a multi-turn test can
make the next prompt repeat this turn's output). Used by the core tests and by trace replay.

With `validate=True` it also simulates what the real kernels would hold, and asserts it:
the state of a slot is (p, P(p)), where P(p) is a polynomial hash of the request's first p tokens, and
the KV of position i is P(i + 1). Before a chunk it checks the running slot holds the state after
exactly `num_computed_tokens` tokens and every block-table entry below that holds the right prefix (for the
window group's table: every position inside the window of the chunk's first token, in its own memory);
it writes the chunk's KV, the running state, and the state at each checkpoint position. A checkpoint
published early, a wrong copy, or a block shared across different prefixes fails loudly.

A verify step (ScheduledRequest.num_draft_tokens, speculative decoding) accepts the drafts that equal the tokens it
would sample and emits one of its own; in validate mode its KV holds the drafted sequence's prefixes (a rejected
draft's KV is wrong for the real sequence: read before it is overwritten, it fails the next check) and the running
slot the state after the accepted tokens, as the runner's rollback leaves it.

A scheduled-ahead row (async scheduling: ScheduledRequest.placeholder) gets its last token from this executor's own
previous sample for the request, as the runner fills it from the step before's sampled ids.

Faults (core/step_faults.py): a step with a `poison` request, or the one after `fail_next` is set, raises
`StepFault` after its tier orders ran and after scribbling garbage over its rows' KV, running slots and planned
checkpoint slots (a half-run forward); the tier reports it collected come with the next step, as the runner's do.
With `fail_early` the fault comes first: nothing of the step ran.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import xxhash

from recap.core.fake_tier import FakeTier
from recap.core.output import PAD_SLOT_ID, CheckpointWrite, ModelRunnerOutput, ScheduledRequest, SchedulerOutput

_MOD = (1 << 61) - 1
_GARBAGE = -1  # no polynomial hash is negative: a read of it fails the next check


class StepFault(RuntimeError):
    """An injected failure of a whole step."""


_BASE = 1_000_003


class FakeExecutor:
    """Executes steps in integers. Side effects: only its own simulated memory (validate mode)."""

    def __init__(
        self,
        block_size: int = 16,
        seed: int = 0,
        vocab_size: int = 32000,
        validate: bool = False,
        token_lookup: Callable[[str], Sequence[int] | None] | None = None,
        sliding_window: int = 0,
    ) -> None:
        if validate and token_lookup is None:
            raise ValueError("validate=True needs token_lookup (request id -> all its token ids)")
        self.block_size = block_size
        self.seed = seed
        self.vocab_size = vocab_size
        self.validate = validate
        self.token_lookup = token_lookup
        self.forced: dict[str, list[int]] = {}
        self.num_steps = 0
        self.num_tokens = 0
        self._slot_state: dict[int, tuple[int, int]] = {}
        self._kv: dict[int, int] = {}  # block_id * block_size + offset -> P(position + 1)
        self.sliding_window = sliding_window
        self._window_kv: dict[int, int] = {}  # the same for the window group's own blocks
        self._poly: dict[str, list[int]] = {}  # request id -> P(0), P(1), ...
        self.tier = FakeTier(block_size)  # a lower tier in integers (core/fake_tier.py)
        self._filled: dict[str, tuple[int, int]] = {}  # request -> (position, token) of its filled placeholder
        self.poison: set[str] = set()  # a step with any of these requests raises
        self.fail_next = False  # the next step raises
        self.fail_early = False  # ... before its tier orders run
        self.num_faults = 0
        self._carried: ModelRunnerOutput | None = None  # tier reports of a step that raised

    def force_output(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Sample exactly these tokens for the request's first outputs (then fall back to the hash)."""
        self.forced[request_id] = list(token_ids)

    def sample(self, request_id: str, index: int) -> int:
        forced = self.forced.get(request_id)
        if forced is not None and index < len(forced):
            return forced[index]
        return xxhash.xxh64_intdigest(f"{request_id}:{index}".encode(), seed=self.seed) % self.vocab_size

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        self.num_steps += 1
        for rid in sched_out.finished_request_ids:
            self._poly.pop(rid, None)
        faulty = self.fail_next or any(sr.request_id in self.poison for sr in sched_out.scheduled)
        if faulty and self.fail_early:
            self._fault(sched_out, None)
        self.tier.step(sched_out, out, self._kv, self._slot_state, self.validate, self._window_kv)  # before copies
        if self._carried is not None:
            carried, self._carried = self._carried, None
            out.tier_saved = carried.tier_saved + out.tier_saved
            out.tier_loaded = {**carried.tier_loaded, **out.tier_loaded}
            out.tier_disabled = carried.tier_disabled + out.tier_disabled
        if faulty:
            self._fault(sched_out, out)
        if self.validate:
            for src, dst in sched_out.state_copies:
                assert src in self._slot_state, f"copy from never-written slot {src}"
                self._slot_state[dst] = self._slot_state[src]
        for sr in sched_out.scheduled:
            if sr.placeholder:
                sr = self._fill(sr)
            self.num_tokens += len(sr.token_ids)
            accepted = self._verify(sr, out) if sr.num_draft_tokens else 0
            if self.validate:
                polys = self._simulate(
                    sr.request_id, sr.token_ids, sr.num_computed_tokens, sr.block_ids, sr.state_slot, sr.checkpoints,
                    sr.num_draft_tokens, accepted,
                )  # fmt: skip
                if self.sliding_window:
                    self._simulate_window(sr.request_id, sr.num_computed_tokens, len(sr.token_ids), sr.window_block_ids,
                                          polys)  # fmt: skip
            if sr.checkpoints:
                out.written_checkpoints[sr.request_id] = list(sr.checkpoints)
            if sr.sample and not sr.num_draft_tokens:
                out.sampled_token_ids[sr.request_id] = self.sample(sr.request_id, sr.num_output_tokens)
        return out

    def _fault(self, sched_out: SchedulerOutput, out: ModelRunnerOutput | None) -> None:
        """Scribble over the step's rows as a forward that died half way might, keep the reports, raise."""
        self.fail_next = False
        self.num_faults += 1
        if out is None:
            raise StepFault(f"step {sched_out.step} failed before it ran (injected)")
        bs = self.block_size
        for sr in sched_out.scheduled:
            for pos in range(sr.num_computed_tokens, sr.num_computed_tokens + len(sr.token_ids)):
                if pos // bs < len(sr.block_ids):
                    self._kv[sr.block_ids[pos // bs] * bs + pos % bs] = _GARBAGE
            if sr.state_slot != PAD_SLOT_ID:
                self._slot_state[sr.state_slot] = (sr.num_computed_tokens + len(sr.token_ids), _GARBAGE)
            for cp in sr.checkpoints:
                self._slot_state[cp.slot] = (cp.position, _GARBAGE)
        self._carried = out
        raise StepFault(f"step {sched_out.step} failed (injected)")

    def _verify(self, sr: ScheduledRequest, out: ModelRunnerOutput) -> int:
        """Greedy verification against this executor's own samples; returns the number of drafts accepted."""
        drafts = sr.token_ids[len(sr.token_ids) - sr.num_draft_tokens :]
        rid, done = sr.request_id, sr.num_output_tokens
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == self.sample(rid, done + accepted):
            accepted += 1
        out.spec_token_ids[rid] = [*drafts[:accepted], self.sample(rid, done + accepted)]
        return accepted

    def _fill(self, sr: ScheduledRequest) -> ScheduledRequest:
        """The row with its placeholder replaced by the token sampled for it in the step before."""
        token = self.sample(sr.request_id, sr.num_output_tokens - 1)
        self._filled[sr.request_id] = (sr.num_computed_tokens + len(sr.token_ids) - 1, token)
        return replace(sr, token_ids=[*sr.token_ids[:-1], token])

    def _lookup(self, request_id: str) -> Sequence[int] | None:
        """The request's tokens on the host, with a placeholder this executor filled and the host lacks yet."""
        assert self.token_lookup is not None
        tokens = self.token_lookup(request_id)
        filled = self._filled.get(request_id)
        return tokens if tokens is None or filled is None or len(tokens) != filled[0] else [*tokens, filled[1]]

    # -- validation -------------------------------------------------------------------------------
    def _prefix_polys(self, request_id: str, upto: int) -> list[int]:
        polys = self._poly.setdefault(request_id, [0])
        if len(polys) <= upto:
            tokens = self._lookup(request_id)
            assert tokens is not None and len(tokens) >= upto, f"{request_id}: executor needs {upto} tokens"
            acc, power = polys[-1], pow(_BASE, len(polys) - 1, _MOD)
            for i in range(len(polys) - 1, upto):
                acc = (acc + (tokens[i] + 1) * power) % _MOD
                power = power * _BASE % _MOD
                polys.append(acc)
        return polys

    def _simulate(
        self,
        rid: str,
        token_ids: Sequence[int],
        start: int,
        block_ids: Sequence[int],
        state_slot: int,
        checkpoints: Sequence[CheckpointWrite],
        num_drafts: int = 0,
        accepted: int = 0,
    ) -> list[int]:
        """Simulate a chunk; returns the prefix hashes it computed with (drafts included)."""
        end = start + len(token_ids)
        known = end - num_drafts
        polys = self._prefix_polys(rid, known)
        tokens = self._lookup(rid) if self.token_lookup else None
        assert tokens is not None and list(tokens[start:known]) == list(token_ids[: known - start]), (
            f"{rid}: chunk tokens differ")
        if num_drafts:  # the drafted sequence's prefixes, never cached (the committed ones stay right)
            polys = _extend(polys[: known + 1], token_ids[known - start :])
        bs = self.block_size
        if block_ids:
            for pos in range(start):  # attention reads every earlier position
                got = self._kv.get(block_ids[pos // bs] * bs + pos % bs)
                assert got == polys[pos + 1], f"{rid}: KV at position {pos} holds another prefix"
            for pos in range(start, end):
                self._kv[block_ids[pos // bs] * bs + pos % bs] = polys[pos + 1]
        if state_slot != PAD_SLOT_ID:
            if start > 0:
                got_state = self._slot_state.get(state_slot)
                assert got_state == (start, polys[start]), f"{rid}: running slot holds {got_state}, not state@{start}"
            for cp in checkpoints:
                assert cp.position <= known, f"{rid}: checkpoint at {cp.position} inside the drafts"
                self._slot_state[cp.slot] = (cp.position, polys[cp.position])
            done = known + accepted if num_drafts else end  # the runner rolls back to the accepted tokens
            self._slot_state[state_slot] = (done, polys[done])
        return polys

    def _simulate_window(self, rid: str, start: int, n: int, block_ids: Sequence[int], polys: list[int]) -> None:
        """The chunk's first query sees positions start - window + 1 ..; later ones see less of the past."""
        bs = self.block_size
        assert block_ids, f"{rid}: no window block table"
        for pos in range(max(0, start - self.sliding_window + 1), start):
            got = self._window_kv.get(block_ids[pos // bs] * bs + pos % bs)
            assert block_ids[pos // bs] != 0, f"{rid}: window position {pos} in the null block"
            assert got == polys[pos + 1], f"{rid}: window KV at position {pos} holds another prefix"
        for pos in range(start, start + n):
            assert block_ids[pos // bs] != 0, f"{rid}: writes window position {pos} into the null block"
            self._window_kv[block_ids[pos // bs] * bs + pos % bs] = polys[pos + 1]


def _extend(polys: list[int], tokens: Sequence[int]) -> list[int]:
    """polys (P(0)..P(n)) extended by the prefix hashes over `tokens`."""
    out = list(polys)
    acc, power = out[-1], pow(_BASE, len(out) - 1, _MOD)
    for t in tokens:
        acc = (acc + (t + 1) * power) % _MOD
        power = power * _BASE % _MOD
        out.append(acc)
    return out
