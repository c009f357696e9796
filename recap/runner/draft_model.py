"""The draft-model drafter (speculative method "draft_model"): a smaller model with the target's tokenizer proposes
each verify row's drafts greedily, in the runner, before the target's forward pass of the same step
(docs/speculative.md). The scheduler plans how many (ScheduledRequest.num_runner_drafts) and budgets them.

The draft is a hybrid too, so it keeps its own exact state per request: a running state slot and a KV block table in
its own pools (the core never sees them), holding the state after the request's first `pos` tokens, all of them
committed. A step:
1. follow: a prefill chunk of a speculating request (the target's chunking) is fed to the draft too, from `pos`.
   The draft keeps no checkpoints: on a target prefix-cache hit it computes the whole prefix from its own
   position (the simplest correct choice; it costs the draft's share of the prompt once).
2. propose: a row given k runner drafts feeds its committed tokens from `pos` through its decode token (position
   N - 1), then d1..d(k-1), one token per decode step (MAX_FED_ONE_BY_ONE); the argmax after N - 1 and after each
   draft gives d1..dk. The state after N + j tokens
   (j < k - 1) is written into a scratch slot (a state write at the row's end, as a checkpoint is); the running
   slot ends after N + k - 1.
3. commit: once the target accepted a drafts, the state after N + min(a, k - 1) tokens (all of them committed)
   becomes the running state, checked by the position the kernels wrote; dk itself was never fed, so accepting all k
   leaves dk and the bonus token to the next feed. Rejected drafts' KV lies past `pos` and is overwritten then.
A request the draft's pools cannot hold decodes without drafts until it leaves.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from recap.backends import Backend, backend_for
from recap.core.output import PAD_SLOT_ID, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from recap.kernels.batch import build_forward_batch
from recap.kernels.kernel_set import TORCH_KERNELS, KernelSet
from recap.kernels.metadata import ForwardBatch, SeqSpec
from recap.model.cache import ModelCaches
from recap.model.footprint import held_weight_bytes
from recap.model.hf_config import read_hf_config, translate_config
from recap.model.loader import LoadedModel, load_model, load_tokenizer, resolve_model_path

# A proposing row's committed tokens not yet fed (the bonus token; with dk when all k drafts were accepted) go one
# decode step each, so every draft step is a decode (the cheap path); a longer catch-up (after a backoff, a
# preemption or a target cache hit) goes as one chunk first, but its last token.
MAX_FED_ONE_BY_ONE = 2


class DraftModelMismatchError(ValueError):
    """The draft model cannot draft for this target: another vocabulary or tokenizer."""


def check_draft_vocab(target_vocab: int, draft_vocab: int, target_tokenizer: Any, draft_tokenizer: Any) -> None:
    """Refuse a draft whose token ids mean other tokens than the target's (DraftModelMismatchError)."""
    if target_vocab != draft_vocab:
        raise DraftModelMismatchError(f"the draft model's vocab_size is {draft_vocab}, the target's {target_vocab}")
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise DraftModelMismatchError("the draft model's tokenizer maps tokens to other ids than the target's")


@dataclass
class _Seq:
    """One request's draft state: its running slot, KV blocks, and the committed tokens folded into them."""

    slot: int
    blocks: list[int] = field(default_factory=list)
    pos: int = 0


@dataclass
class _Row:
    """One proposing row of a step: where its committed tokens end (N), its drafts, its scratch slots."""

    rid: str
    first: int  # N: the request's committed tokens, its decode token last
    k: int
    scratch: list[int]
    pending: list[int]  # committed tokens not yet fed, from position `at`
    at: int  # the position of the next token fed
    drafts: list[int] = field(default_factory=list)


def _tokens(s: ScheduledRequest, start: int, end: int) -> list[int]:
    """The request's committed tokens [start, end) (prompt, then output)."""
    p = s.prompt_token_ids
    return [p[i] if i < len(p) else s.output_token_ids[i - len(p)] for i in range(start, end)]


@dataclass(frozen=True)
class DraftPools:
    """The draft's pools: KV blocks (null block 0 included) and state slots (running slots, then scratch)."""

    num_kv_blocks: int
    num_running_slots: int
    num_scratch_slots: int


def draft_pools(block_size: int, max_num_seqs: int, max_model_len: int, target_kv_blocks: int, k: int,
                drafting_rows: int) -> DraftPools:  # fmt: skip
    """As many KV tokens as the target's pool holds (at least one full-length sequence, at most max_num_seqs of
    them), a running slot per running request, and k - 1 scratch slots per drafting row."""
    per_seq = -(-(max_model_len + k) // block_size)
    blocks = min(max_num_seqs * per_seq, max(target_kv_blocks - 1, per_seq)) + 1
    return DraftPools(blocks, max_num_seqs, drafting_rows * max(k - 1, 0))


class DraftModelRunner:
    """Owns the draft model, its backend and pools, and each request's draft state (the module docstring)."""

    def __init__(self, loaded: LoadedModel, pools: DraftPools, block_size: int, dtype: torch.dtype,
                 device: str = "cpu", kernels: KernelSet = TORCH_KERNELS) -> None:  # fmt: skip
        self.model, self.config = loaded.model, loaded.config
        self.backend: Backend = backend_for(loaded, device, kernels)
        self.backend.prepare(self.model)
        self.device = torch.device(device)
        self.block_size = block_size
        self.has_kv = self.config.kv_bytes_per_token(dtype) > 0
        self.has_window = self.config.window_bytes_per_token(dtype) > 0
        self.has_state = self.config.state_bytes_per_slot(dtype) > 0
        self.pools = pools
        self.caches = ModelCaches.allocate(
            self.config, num_kv_blocks=pools.num_kv_blocks, block_size=block_size,
            num_state_slots=pools.num_running_slots + pools.num_scratch_slots, dtype=dtype, device=self.device,
            zeros=self.backend.cache_zeros(),
        )  # fmt: skip
        self._free_slots = list(range(pools.num_running_slots - 1, -1, -1))
        self._free_blocks = list(range(pools.num_kv_blocks - 1, 0, -1))  # block 0 is the null block
        self._seqs: dict[str, _Seq] = {}
        self._refused: set[str] = set()  # requests the pools could not hold: no drafts until they leave
        self._rows: dict[str, _Row] = {}  # this step's proposing rows, until commit

    # -- requests -------------------------------------------------------------------------------------
    def forget(self, rid: str) -> None:
        """The request finished, was aborted or preempted: its slot and blocks go back (a preempted request's
        draft recomputes from its first token, as the target does)."""
        seq = self._seqs.pop(rid, None)
        if seq is not None:
            self._free_slots.append(seq.slot)
            self._free_blocks.extend(seq.blocks)
        self._refused.discard(rid)
        self._rows.pop(rid, None)

    def _seq(self, rid: str, tokens: int) -> _Seq | None:
        """The request's draft state with KV blocks for `tokens` tokens; None (and no drafts for it any more)
        where the pools cannot hold it."""
        if rid in self._refused:
            return None
        seq = self._seqs.get(rid)
        if seq is None:
            if not self._free_slots:
                self._refused.add(rid)
                return None
            seq = self._seqs[rid] = _Seq(self._free_slots.pop())
        need = -(-tokens // self.block_size) - len(seq.blocks) if self.has_kv or self.has_window else 0
        if need > len(self._free_blocks):
            self.forget(rid)
            self._refused.add(rid)
            return None
        seq.blocks.extend(self._free_blocks.pop() for _ in range(max(need, 0)))
        return seq

    @property
    def total_bytes(self) -> int:
        """The draft's weights (as held, copies included) and pools, for the runner's memory plan."""
        return held_weight_bytes(self.model).total + self.caches.total_bytes()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def position(self, rid: str) -> int | None:
        """The committed tokens folded into the request's draft state (None: it holds none)."""
        seq = self._seqs.get(rid)
        return None if seq is None else seq.pos

    # -- a step ---------------------------------------------------------------------------------------
    def _spec(self, seq: _Seq, tokens: list[int], start: int, writes: list[tuple[int, int]], sample: bool) -> SeqSpec:
        return SeqSpec(tokens, context_len=start, block_ids=seq.blocks, state_slot=seq.slot if self.has_state
                       else PAD_SLOT_ID, checkpoints=writes if self.has_state else (), sample=sample)  # fmt: skip

    def _forward(self, specs: list[SeqSpec]) -> list[int]:
        """One draft step over `specs`; the argmax after each sampled row's last token."""
        batch = build_forward_batch(specs, block_size=self.block_size, chunk_size=self.config.ssm_chunk_size,
                                    with_attention=self.has_kv, with_ssm=self.has_state, device=self.device,
                                    with_window=self.has_window, kernels=self.backend.kernels)  # fmt: skip
        if self.has_state and batch.planned_checkpoints:
            self.caches.slot_positions[[p[2] for p in batch.planned_checkpoints]] = -1
        return self.backend.forward_greedy(self.model, batch, self.caches)[1].tolist()  # drafts are read here

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput) -> tuple[SchedulerOutput, dict[str, list[int]]]:
        """Follow the step's prefill chunks and propose the drafts of its rows with runner drafts. Returns the
        step with the drafts among those rows' tokens (as a verify row carries them) and the drafts by request."""
        scratch = iter(range(self.pools.num_running_slots, self.pools.num_running_slots + self.pools.num_scratch_slots))
        rows: list[_Row] = []
        chunks: list[SeqSpec] = []  # prefill chunks, and long catch-ups but their last token: one forward
        for s in out.scheduled:
            k, end = s.num_runner_drafts, s.num_computed_tokens + len(s.token_ids)
            if not k and not (s.speculate and (len(s.token_ids) > 1 or not s.sample)):
                continue  # a plain decode: the draft catches up when the request drafts again
            seq = self._seq(s.request_id, end + max(k - 1, 0))
            if seq is None or (not k and seq.pos >= end):
                continue
            tokens = _tokens(s, seq.pos, end)
            if not k:
                chunks.append(self._spec(seq, tokens, seq.pos, [], False))
                seq.pos = end
                continue
            row = _Row(s.request_id, end, k, [next(scratch) for _ in range(k - 1)], pending=tokens, at=seq.pos)
            if len(tokens) > MAX_FED_ONE_BY_ONE:
                chunks.append(self._spec(seq, tokens[:-1], seq.pos, [], False))
                row.pending, row.at = tokens[-1:], end - 1
            rows.append(row)
        if chunks:
            self._forward(chunks)
        self._feed(rows)
        self._rows = {r.rid: r for r in rows}
        drafts = {r.rid: r.drafts for r in rows}
        scheduled = [replace(s, token_ids=[*s.token_ids, *drafts[s.request_id]],
                             num_draft_tokens=len(drafts[s.request_id])) if s.request_id in drafts else s
                     for s in out.scheduled]  # fmt: skip
        return replace(out, scheduled=scheduled), drafts

    def _feed(self, rows: list[_Row]) -> None:
        """Decode steps of one token per row until every row has its k drafts: a row feeds its pending committed
        tokens, then its drafts; the argmax after its last committed token and after each draft is its next draft.
        The state after N + j tokens (0 <= j < k - 1) goes into scratch slot j (module docstring)."""
        active = rows
        while active:
            specs = []
            for r in active:
                token = r.pending.pop(0) if r.pending else r.drafts[-1]
                j = r.at + 1 - r.first  # this token makes the state after N + j tokens
                writes = [(r.at + 1, r.scratch[j])] if 0 <= j < r.k - 1 else []
                specs.append(self._spec(self._seqs[r.rid], [token], r.at, writes, not r.pending))
                r.at += 1
            nexts = iter(self._forward(specs))
            for r, spec in zip(active, specs):
                if spec.sample:
                    r.drafts.append(int(next(nexts)))
            active = [r for r in active if len(r.drafts) < r.k]

    def after_step(self, out: SchedulerOutput, batch: ForwardBatch, hidden: torch.Tensor,
                   result: ModelRunnerOutput) -> None:  # fmt: skip
        """The runner's hook after the target's verification: commit each proposing row's accepted drafts."""
        for rid in list(self._rows):
            self.commit(rid, len(result.spec_token_ids[rid]) - 1)

    def commit(self, rid: str, accepted: int) -> None:
        """The target accepted `accepted` of the request's drafts this step: the state after N + min(accepted,
        k - 1) tokens becomes its running state (its position checked as a checkpoint's)."""
        row = self._rows.pop(rid)
        seq = self._seqs[rid]
        j = min(accepted, row.k - 1)
        if self.has_state and j < row.k - 1:
            src = row.scratch[j]
            written = int(self.caches.slot_positions[src])
            if written != row.first + j:
                raise RuntimeError(f"{rid}: draft slot {src} holds the state at {written}, not {row.first + j}")
            self.caches.copy_state(src, seq.slot)
        seq.pos = row.first + j


def load_draft_runner(model: str, target_vocab: int, target_tokenizer: Any, pools: DraftPools, block_size: int,
                      dtype: torch.dtype, device: str = "cpu", kernels: KernelSet = TORCH_KERNELS,
                      native_decode: bool = True) -> DraftModelRunner:  # fmt: skip
    """Load the draft model (its config's vocab and its tokenizer checked against the target's first) and its
    runner."""
    path = resolve_model_path(model)
    draft_vocab = translate_config(read_hf_config(path)).vocab_size
    check_draft_vocab(target_vocab, draft_vocab, target_tokenizer, load_tokenizer(path))
    loaded = load_model(path, dtype=dtype, native_decode=native_decode, device=device)
    return DraftModelRunner(loaded, pools, block_size, dtype, device, kernels)
