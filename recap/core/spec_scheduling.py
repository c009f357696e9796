"""The scheduler's speculative steps (a mixin of `Scheduler`; drafting and acceptance are recap.core.speculation):
how many drafts a decode row carries, and how a verify step's emitted tokens are applied."""

from __future__ import annotations

from typing import TYPE_CHECKING

from recap.core.cache_manager import CacheManager
from recap.core.output import ModelRunnerOutput, ScheduledRequest
from recap.core.request import Request, RequestStatus
from recap.core.stats import RequestUpdate

if TYPE_CHECKING:
    from recap.core.speculation import Speculator


class SpecScheduling:
    """Speculation methods over the Scheduler's cache manager."""

    # Provided by Scheduler.
    cache: CacheManager
    speculator: Speculator | None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        raise NotImplementedError

    def _check_stop(self, request: Request, token: int, num_tokens: int) -> RequestStatus | None:
        raise NotImplementedError

    def _drafts(self, request: Request, budget: int) -> tuple[list[int], int]:
        """A decode's drafts, or how many the runner may propose; none where their KV is not free: no preemption."""
        spec = self.speculator
        assert spec is not None
        drafts, k = ([], spec.runner_drafts(request, budget)) if spec.in_runner else (spec.draft(request, budget), 0)
        computed = request.num_computed_tokens
        if (drafts or k) and not self.cache.try_grow(request.request_id, computed + 1 + len(drafts) + k, computed):
            return [], 0
        return drafts, k

    def _apply_verified(self, request: Request, sr: ScheduledRequest, runner_out: ModelRunnerOutput) -> RequestUpdate:
        """A verify step's emitted tokens (accepted drafts, then the verifier's) up to a stop: the request then has
        its decode token and every kept token but the last computed. Rejected drafts go nowhere (speculation.py)."""
        assert self.speculator is not None
        rid, start, cache = request.request_id, sr.num_computed_tokens, self.cache
        emitted = runner_out.spec_token_ids[rid]
        drafts = runner_out.draft_token_ids.get(rid) or sr.token_ids[len(sr.token_ids) - sr.num_draft_tokens :]
        self.speculator.accept(request, drafts, emitted, max(sr.num_draft_tokens, sr.num_runner_drafts))
        kept: list[int] = []
        status = None
        for token in emitted:  # tokens past a stop are dropped, as a plain decode never samples them
            request.output_token_ids.append(token)
            kept.append(token)
            status = self._check_stop(request, token, request.num_tokens)
            if status is not None:
                break
        end = request.num_computed_tokens = start + len(kept)
        assert end == request.num_tokens - 1, f"{rid}: {end} computed of {request.num_tokens} tokens"
        cache.update_hashes(request)
        written = runner_out.written_checkpoints.get(rid, ())
        if end // cache.block_size > start // cache.block_size or written:
            cache.commit(request, written, bool(sr.checkpoints))
        if status is not None:
            self._finish(request, status)
        return RequestUpdate(rid, kept, status, request.num_cached_tokens)
