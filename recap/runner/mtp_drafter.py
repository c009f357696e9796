"""The MTP drafter (speculative method "mtp"): the checkpoint's multi-token-prediction head (model/layers/mtp.py)
proposes each verify row's drafts greedily, in the runner, before the target's forward pass of the step; the
scheduler plans how many (ScheduledRequest.num_runner_drafts), as for a draft model (runner/draft_model.py).

The head's row i reads the target's final hidden state h_i and the token x_{i+1}, at position i. Its blocks are
attention and feed-forwards only, so a request's draft state is a KV block table in the drafter's own small pool
(shared by the head's attention blocks), filled for the
rows 0..pos-1 from the target's hidden states (never from drafts), and the hidden states the target computed for
committed positions not yet folded in (`pending`, from position `start`). A step:
1. after the target's forward (`after_step`): the hidden states of the step's committed positions (a prefill
   chunk's, a decode token's, a verify row's decode token and accepted drafts) join the request's pending ones.
2. propose (before the next target forward), for a request with N - 1 computed tokens and decode token x_{N-1}:
   fold the rows pos..N-2 in one chunk (the last reads x_{N-1}); the argmax after row N-2 is d1. Drafts d2..dk
   chain a row each at N-1, N, ...: (o_{j-1} for the hidden state, d_{j-1} for the token). A prefill chunk folds
   its pending rows in the same forward, unsampled; a plain decode folds once FOLD_AT rows are pending.
Nothing rolls back: the chained rows' K/V lie at positions >= pos and the next fold writes those positions with
the target's hidden states before any row reads them. Where the target computed no hidden state (a prefix-cache
hit), those rows stay unfilled: their K/V are zeroed, the drafts are worse and the output unchanged (verified).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from recap.core.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from recap.kernels.batch import build_forward_batch
from recap.kernels.kernel_set import TORCH_KERNELS, KernelSet
from recap.kernels.metadata import ForwardBatch, SeqSpec
from recap.model.cache import ModelCaches
from recap.model.footprint import held_weight_bytes
from recap.model.layers.mtp import MTPHead
from recap.model.loader import LoadedModel
from recap.model.models.base import CausalLM
from recap.model.mtp_load import load_mtp_head, mtp_layer_config
from recap.runner.draft_model import DraftPools

# A plain decode (no drafts: a backoff) folds its pending rows once this many wait, bounding what a request holds.
FOLD_AT = 32


@dataclass
class _Seq:
    """One request's head state: KV blocks, the rows filled (0..pos-1), the target's hidden states not folded."""

    blocks: list[int] = field(default_factory=list)
    pos: int = 0
    start: int = 0  # the position of pending[0]
    pending: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.start + (0 if self.pending is None else len(self.pending))


def _tokens(s: ScheduledRequest, start: int, end: int) -> list[int]:
    p = s.prompt_token_ids
    return [p[i] if i < len(p) else s.output_token_ids[i - len(p)] for i in range(start, end)]


class MTPDrafter:
    """Owns the MTP head, its KV pool and each request's head state (the module docstring)."""

    def __init__(self, head: MTPHead, target: CausalLM, pools: DraftPools, block_size: int, dtype: torch.dtype,
                 device: str = "cpu", kernels: KernelSet = TORCH_KERNELS) -> None:  # fmt: skip
        self.head, self.target = head, target
        self.config = mtp_layer_config(target.config)
        self.block_size, self.kernels, self.device = block_size, kernels, torch.device(device)
        self.caches = ModelCaches.allocate(self.config, num_kv_blocks=pools.num_kv_blocks, block_size=block_size,
                                           num_state_slots=0, dtype=dtype, device=self.device)  # fmt: skip
        self._free_blocks = list(range(pools.num_kv_blocks - 1, 0, -1))  # block 0 is the null block
        self._seqs: dict[str, _Seq] = {}
        self._refused: set[str] = set()

    @property
    def total_bytes(self) -> int:
        """The head's weights and KV pool, for the runner's memory plan (embedding and head are the target's)."""
        return held_weight_bytes(self.head).total + self.caches.total_bytes()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def forget(self, rid: str) -> None:
        """Finished, aborted or preempted: its blocks go back (a preempted request's rows refill as it recomputes)."""
        seq = self._seqs.pop(rid, None)
        if seq is not None:
            self._free_blocks.extend(seq.blocks)
        self._refused.discard(rid)

    def _reserve(self, rid: str, seq: _Seq, tokens: int) -> bool:
        need = -(-tokens // self.block_size) - len(seq.blocks)
        if need > len(self._free_blocks):
            self.forget(rid)
            self._refused.add(rid)  # no drafts until it leaves
            return False
        seq.blocks.extend(self._free_blocks.pop() for _ in range(max(need, 0)))
        return True

    def _zero_rows(self, seq: _Seq, start: int, end: int) -> None:
        """Rows the target computed no hidden state for: zero K/V, so the drafts never read another request's."""
        pos = torch.arange(start, end)
        blocks = torch.tensor(seq.blocks, dtype=torch.long)[pos // self.block_size]
        for cache in self.caches.kv.values():  # every attention block of the head
            for t in cache.tensors.values():
                t[blocks.to(t.device), (pos % self.block_size).to(t.device)] = 0

    # -- a step ---------------------------------------------------------------------------------------
    def _run(self, specs: list[SeqSpec], hidden: list[torch.Tensor]) -> tuple[ForwardBatch, torch.Tensor]:
        batch = build_forward_batch(specs, block_size=self.block_size, chunk_size=self.config.ssm_chunk_size,
                                    with_attention=True, with_ssm=False, device=self.device,
                                    kernels=self.kernels)  # fmt: skip
        embeds = self.target.embed(batch.input_ids)
        return batch, self.head(embeds, torch.cat(hidden), batch, self.caches)

    def _argmax(self, batch: ForwardBatch, out: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        last = out[batch.logits_indices]
        return self.target.greedy_tokens(last).tolist(), last

    def _fold_spec(self, rid: str, s: ScheduledRequest, k: int) -> tuple[SeqSpec, torch.Tensor] | None:
        """The request's pending rows as one chunk (sampled where it drafts), or None: nothing to fold."""
        seq = self._seqs.get(rid)
        c = s.num_computed_tokens
        if seq is None or seq.pending is None or seq.end != c:
            return None
        if not k and len(s.token_ids) == 1 and len(seq.pending) < FOLD_AT:
            return None
        if not self._reserve(rid, seq, c + max(k - 1, 0)):
            return None
        if seq.start > seq.pos:
            self._zero_rows(seq, seq.pos, seq.start)
        spec = SeqSpec(_tokens(s, seq.start + 1, c + 1), context_len=seq.start, block_ids=seq.blocks, sample=k > 0)
        hidden = seq.pending
        seq.pos, seq.start, seq.pending = c, c, None
        return spec, hidden

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput) -> tuple[SchedulerOutput, dict[str, list[int]]]:
        """Fold every pending row that can be, and draft the rows with runner drafts (module docstring). Returns
        the step with the drafts among those rows' tokens and the drafts by request."""
        specs, hidden, rows = [], [], []
        for s in out.scheduled:
            if not s.speculate or s.request_id in self._refused:
                continue
            fold = self._fold_spec(s.request_id, s, s.num_runner_drafts)
            if fold is not None:
                specs.append(fold[0])
                hidden.append(fold[1])
                if fold[0].sample:
                    rows.append(s)
        drafts: dict[str, list[int]] = {}
        if specs:
            batch, o = self._run(specs, hidden)
            if rows:
                firsts, last = self._argmax(batch, o)
                drafts = {s.request_id: [d] for s, d in zip(rows, firsts)}
                self._chain(rows, drafts, last)
        scheduled = [replace(s, token_ids=[*s.token_ids, *drafts[s.request_id]],
                             num_draft_tokens=len(drafts[s.request_id])) if s.request_id in drafts else s
                     for s in out.scheduled]  # fmt: skip
        return replace(out, scheduled=scheduled), drafts

    def _chain(self, rows: list[ScheduledRequest], drafts: dict[str, list[int]], last: torch.Tensor) -> None:
        """Drafts 2..k: row N-2+j reads d_j and the head's own output of the row before (for the hidden state)."""
        prev = dict(zip((s.request_id for s in rows), last.split(1)))
        active = [s for s in rows if s.num_runner_drafts > 1]
        while active:
            specs = [SeqSpec([drafts[s.request_id][-1]], context_len=s.num_computed_tokens - 1 +
                             len(drafts[s.request_id]), block_ids=self._seqs[s.request_id].blocks) for s in active]
            batch, o = self._run(specs, [prev[s.request_id] for s in active])
            nexts, last = self._argmax(batch, o)
            for s, d, h in zip(active, nexts, last.split(1)):
                drafts[s.request_id].append(d)
                prev[s.request_id] = h
            active = [s for s in active if len(drafts[s.request_id]) < s.num_runner_drafts]

    def after_step(self, out: SchedulerOutput, batch: ForwardBatch, hidden: torch.Tensor,
                   result: ModelRunnerOutput) -> None:  # fmt: skip
        """The target's hidden states of the step's committed positions join each speculating request's pending
        ones: a verify row's decode token and accepted drafts, every other row's tokens."""
        qsl = batch.query_start_loc.tolist()
        for row, s in enumerate(out.scheduled):
            rid = s.request_id
            if not s.speculate or rid in self._refused:
                continue
            n = len(s.token_ids)
            if s.num_draft_tokens:
                n = len(result.spec_token_ids.get(rid, [None]))  # the decode token and the accepted drafts
            rows = hidden[qsl[row] : qsl[row] + n]
            seq = self._seqs.setdefault(rid, _Seq())
            c = s.num_computed_tokens
            if seq.pending is not None and seq.end == c:
                seq.pending = torch.cat([seq.pending, rows])
            else:  # the first rows, or after a gap (a prefix-cache hit): start again at c
                seq.start, seq.pending = c, rows.clone()


def load_mtp_drafter(loaded: LoadedModel, pools: DraftPools, block_size: int, dtype: torch.dtype,
                     device: str = "cpu", kernels: KernelSet = TORCH_KERNELS) -> MTPDrafter:  # fmt: skip
    """The checkpoint's MTP head (MTPWeightsMissingError where it ships none) and its drafter."""
    head = load_mtp_head(loaded.path, loaded.model, loaded.config, dtype, device)
    return MTPDrafter(head, loaded.model, pools, block_size, dtype, device, kernels)
