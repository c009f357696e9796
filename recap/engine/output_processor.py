"""Per-request output state: detokenization, stop strings, logprobs, n-way forks, TTFT."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from recap.core.request import FINISH_REASONS, RequestStatus
from recap.engine.detokenizer import IncrementalDetokenizer, tokenizer_decode
from recap.engine.input_processor import PreparedRequest
from recap.engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput


def child_id(parent_id: str, index: int) -> str:
    return f"{parent_id}#{index}"


@dataclass
class _Child:
    index: int
    detok: IncrementalDetokenizer
    output: CompletionOutput
    last_token_time: float | None = None


@dataclass
class ParentState:
    """One user request; with n > 1 it owns n child core requests that share its prompt."""

    prepared: PreparedRequest
    children: dict[str, _Child]
    metrics: RequestMetrics
    pending_forks: list[str] = field(default_factory=list)  # children not yet handed to the scheduler
    num_cached_tokens: int = 0
    dirty: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    error: str | None = None  # why a child ended with finish_reason "error"
    internal_error: bool = False  # the engine's fault (a failed step), not the request's
    # The prompt's ids as every output of the request hands them out: copied once, not per step (a long prompt
    # would otherwise be copied for every streamed token); the engine never changes them.
    prompt_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.output.finished for c in self.children.values())

    def snapshot(self, finished: bool) -> RequestOutput:
        """The request's output now, as copies (outputs cross threads in the async engine: never the live objects);
        `finished`: self.finished, which the caller has."""
        kids = self.children.values()
        outs = [_copy(c.output) for c in (kids if len(kids) == 1 else sorted(kids, key=lambda c: c.index))]
        p = self.prepared
        return RequestOutput(p.request_id, p.prompt, self.prompt_token_ids, outs, finished, self.num_cached_tokens,
                             self.metrics, self.error, self.internal_error,
                             prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs))


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decode = tokenizer_decode(tokenizer)  # once: every request's detokenizer calls it
        # The tokenizer's own EOS ends a request with stop_reason None (vLLM: "EOS iff finish_reason stop and
        # stop_reason None"); generation_config's other EOS ids and stop_token_ids are reported as the token id.
        eos = getattr(tokenizer, "eos_token_id", None)
        self._primary_eos = eos if isinstance(eos, int) else None
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, str] = {}
        self._token_text: dict[int, str] = {}
        self._inter_token_gaps: list[float] = []  # seconds between a child's tokens, drained every step

    def take_inter_token_gaps(self) -> list[float]:
        gaps, self._inter_token_gaps = self._inter_token_gaps, []
        return gaps

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def logprob_dict(self, token: int, row: tuple[float, int, list[tuple[int, float]]]) -> dict[int, Logprob]:
        """vLLM's shape: the token first, then the top-k (which may hold it too) in rank order."""
        value, rank, top = row
        d = {token: Logprob(value, rank, self.token_text(token))}
        for i, (t, v) in enumerate(top):
            if t not in d:
                d[t] = Logprob(v, i + 1, self.token_text(t))
        return d

    def add(self, p: PreparedRequest) -> ParentState:
        kids = {}
        for i in range(p.params.n):
            cid = child_id(p.request_id, i)
            want_lp = p.params.logprobs is not None
            kids[cid] = _Child(i, IncrementalDetokenizer(self.tokenizer, p.params, self._decode), CompletionOutput(
                index=i, logprobs=[] if want_lp else None))
            self.child_to_parent[cid] = p.request_id
        state = ParentState(p, kids, RequestMetrics(arrival_time=p.arrival_time),
                            prompt_logprobs=None if p.params.prompt_logprobs is None else [None],
                            prompt_token_ids=list(p.prompt_token_ids))  # fmt: skip
        self.parents[p.request_id] = state
        return state

    def on_tokens(self, cid: str, new_ids: list[int], lp: Any, num_cached: int) -> bool:
        """Record new tokens of a child; True when a stop string ended it (the engine finishes it)."""
        parent = self.parents[self.child_to_parent[cid]]
        child = parent.children[cid]
        out = child.output
        if child.index == 0 and num_cached >= 0:
            parent.num_cached_tokens = num_cached
        if new_ids:
            now = time.monotonic()
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            if child.last_token_time is not None:
                self._inter_token_gaps.append(now - child.last_token_time)
            child.last_token_time = now
        before = len(child.detok.token_ids)
        stopped = child.detok.add(new_ids)
        if stopped:  # a stop string ended the text inside a multi-token update (speculation): keep what it read
            new_ids = new_ids[: len(child.detok.token_ids) - before]
        out.token_ids.extend(new_ids)
        out.token_ids_delta.extend(new_ids)
        if lp is not None and out.logprobs is not None:
            d = self.logprob_dict(new_ids[-1], lp)
            out.logprobs.append(d)
            out.logprobs_delta.append(d)
        if stopped:
            out.finish_reason = "stop"
            out.stop_reason = child.detok.stop_str
        parent.dirty = True
        return stopped

    def on_prompt_logprobs(self, cid: str, found: tuple[int, list[tuple[float, int, list[tuple[int, float]]]]]) -> None:
        """Logprobs of prompt tokens start+1, start+2, ...; a chunk computed again (after a
        preemption) repeats positions already held, which are skipped."""
        parent = self.parents[self.child_to_parent[cid]]
        have = parent.prompt_logprobs
        if have is None:
            return
        start, rows = found
        assert start + 1 <= len(have), f"prompt logprobs of {cid}: gap before position {start + 1}"
        prompt = parent.prepared.prompt_token_ids
        for pos in range(len(have), start + 1 + len(rows)):
            have.append(self.logprob_dict(prompt[pos], rows[pos - start - 1]))
        parent.dirty = True

    def on_finished(self, cid: str, status: RequestStatus) -> None:
        parent = self.parents[self.child_to_parent[cid]]
        child = parent.children[cid]
        out = child.output
        if out.finish_reason is None:
            out.finish_reason = FINISH_REASONS.get(status, "stop")
            if status == RequestStatus.FINISHED_STOPPED and out.token_ids:
                last = out.token_ids[-1]
                primary_eos = last == self._primary_eos and not parent.prepared.params.ignore_eos
                out.stop_reason = None if primary_eos else last
            child.detok.flush()
        parent.dirty = True

    def on_error(self, cid: str, message: str, internal: bool = False) -> None:
        """The child cannot go on (its grammar broke; `internal`: its steps failed): it ends with finish_reason
        "error"; `message` says why."""
        parent = self.parents[self.child_to_parent[cid]]
        child = parent.children[cid]
        if child.output.finish_reason is None:
            child.output.finish_reason = "error"
            child.detok.flush()
        parent.error = message
        parent.internal_error = parent.internal_error or internal
        parent.dirty = True

    def collect(self) -> tuple[list[RequestOutput], list[ParentState]]:
        """Outputs of parents that changed since the last call, and the parents among them that finished (dropped
        here)."""
        results, done = [], []
        for rid, parent in [(r, p) for r, p in self.parents.items() if p.dirty]:
            finished = True
            for c in parent.children.values():
                out = c.output
                ended = out.finished
                finished = finished and ended
                out.text_delta = c.detok.take_delta(ended)
                out.text = c.detok.text if ended else c.detok.text[: c.detok._sent]
            if finished:
                parent.metrics.finished_time = time.monotonic()
            results.append(parent.snapshot(finished))
            for c in parent.children.values():
                c.output.token_ids_delta = []
                c.output.logprobs_delta = []
            parent.dirty = False
            if finished:
                self.remove(rid)
                done.append(parent)
        return results, done

    def remove(self, rid: str) -> None:
        parent = self.parents.pop(rid, None)
        if parent:
            for cid in parent.children:
                self.child_to_parent.pop(cid, None)


def _copy(o: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(
        index=o.index, text=o.text, token_ids=list(o.token_ids),
        logprobs=None if o.logprobs is None else list(o.logprobs), finish_reason=o.finish_reason,
        stop_reason=o.stop_reason, text_delta=o.text_delta, token_ids_delta=list(o.token_ids_delta),
        logprobs_delta=list(o.logprobs_delta),
    )  # fmt: skip
