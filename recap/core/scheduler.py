"""The scheduler: continuous batching in tokens, one code path for prefill chunks and decodes.

Each step is `{request: num_new_tokens}` under `max_num_batched_tokens` and `max_num_seqs`: running
requests first (in admission order), then waiting ones in FCFS order. A chunk ends wherever the budget
ends; checkpoint positions never shape it. When a running request cannot get KV blocks, the most
recently admitted running request is preempted (recompute): it frees its blocks and running slot, and
its registered blocks and checkpoints stay findable, so it resumes from them.

The engine loop is: `out = schedule()`, execute `out`, `update_from_output(out, result)`, every step,
even an empty one (finishes decided while scheduling are reported by the next update). Under async scheduling
the next `schedule()` may come before that update (recap.core.async_scheduling).

Disaggregation (recap.core.transfer): a prefill side holds finished requests for a remote pull
(`hold_on_finish`, `release_held`); a decode side queues requests computed elsewhere
(`add_remote_request`), allocates for them (`start_receives`) and registers what arrived before they
continue decoding (`finish_receive`, or `fail_receive`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from recap.config import CacheConfig, CacheLayout, SchedulerConfig
from recap.core.async_scheduling import AheadScheduling
from recap.core.cache_manager import CacheHit, CacheManager
from recap.core.integrity import check_scheduler
from recap.core.output import PAD_SLOT_ID, PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from recap.core.remote import RemoteScheduling
from recap.core.request import Request, RequestStatus
from recap.core.spec_scheduling import SpecScheduling
from recap.core.speculation import Speculator
from recap.core.stats import RequestUpdate, SchedulerCounters, SchedulerStats, scheduler_stats
from recap.core.step_faults import StepFaults
from recap.core.tier_scheduling import TierScheduling, make_tier
from recap.core.transfer import RemoteBook, can_hold, hold

# A request's share of a step: its first position, its number of tokens, the drafts among them, runner drafts.
Step = tuple[Request, int, int, list[int], int]


@dataclass(frozen=True)
class SchedulerView:
    """A read-only look at the scheduler's queues, for the integrity check and diagnostics."""

    requests: Mapping[str, Request]  # every request the scheduler owns, by id
    waiting: Sequence[Request]  # in FCFS order
    running: Sequence[Request]  # in admission order
    in_flight: SchedulerOutput | None  # the newest step scheduled and not yet updated
    pins: Sequence[int]  # checkpoint slots the steps in flight copy from
    deferred: Sequence[Request] = ()  # finished requests whose slot and blocks a step in flight still reads


class Scheduler(RemoteScheduling, TierScheduling, AheadScheduling, SpecScheduling, StepFaults):
    """Owns the request queues and the cache manager.

    Side effects: `add_request`, `abort_requests` and `finish_requests` change the queues (and free
    cache resources); `schedule` admits, preempts and allocates; `update_from_output` advances
    requests, appends sampled tokens, registers blocks and checkpoints, and frees finished requests.
    """

    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, layout: CacheLayout,
        speculator: Speculator | None = None,
    ) -> None:  # fmt: skip
        self.config = scheduler_config
        # Speculative decoding (core/speculation.py): decode steps carry drafts; None: plain decodes.
        self.speculator = speculator
        self.cache_config = cache_config
        self.layout = layout
        self.cache = CacheManager(cache_config, layout)
        self.counters = SchedulerCounters()
        self._requests: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._step = 0
        self._flight: list[SchedulerOutput] = []
        self._pins: dict[int, list[int]] = {}  # step -> checkpoint slots it copies from
        self._deferred: dict[int, list[Request]] = {}
        self._finished_ids: set[str] = set()
        self._updates: list[RequestUpdate] = []  # finishes decided outside update_from_output
        self.remote = RemoteBook()  # disaggregation: remote requests and held prefill requests
        self.tiers = make_tier(cache_config, layout, self.cache)  # the disk tier (core/tiers.py); None: off
        self._tier_loads = []
        self.last_output: SchedulerOutput | None = None

    # -- queries ----------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_updates(self) -> bool:
        """Finishes or first tokens decided outside a step, reported by the next update_from_output."""
        return bool(self._updates)

    @property
    def view(self) -> SchedulerView:
        """The queues, read-only (copies of the sequences: O(requests), not for the hot path)."""
        requests, pins = MappingProxyType(self._requests), tuple(s for p in self._pins.values() for s in p)
        newest = self._flight[-1] if self._flight else None
        return SchedulerView(requests, tuple(self._waiting), tuple(self._running), newest, pins, self.deferred)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._updates)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    # -- request lifecycle ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; one that can never fit finishes at once with FINISHED_ERROR."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        too_long = request.num_prompt_tokens > self.config.max_model_len
        if too_long or not self.cache.fits_alone(request.num_tokens):
            request.status = RequestStatus.FINISHED_ERROR
            self._updates.append(RequestUpdate(request.request_id, [], request.status, 0))
            return
        request.status = RequestStatus.WAITING
        self.cache.update_hashes(request)
        self._requests[request.request_id] = request
        self._waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finish these requests as aborted, at any moment; unknown ids are ignored."""
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish these requests with `status` (e.g. the engine matched a stop string)."""
        if not status.finished:
            raise ValueError(f"{status!r} is not a finished status")
        for request_id in list(request_ids):
            request = self._requests.get(request_id)
            if request is not None:
                self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        rid = request.request_id
        if request.status == RequestStatus.RUNNING:
            self._running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            self.remote.drop(request)
        elif request.status != RequestStatus.WAITING_FOR_TIER:
            self._waiting.remove(request)
        self._tier_forget(request)
        holdable = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        if holdable and rid in self.remote.hold_ids and can_hold(request):
            self.remote.held[rid] = hold(self.cache, request)
        else:
            self._release(request)
        self.remote.hold_ids.discard(rid)
        if self.speculator is not None:
            self.speculator.forget(rid)
        request.status = status
        del self._requests[rid]
        self._finished_ids.add(rid)

    def _preempt(self, request: Request) -> None:
        self._running.remove(request)
        self.cache.free(request)
        self._tier_forget(request)  # it may promote again when readmitted
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.counters.num_preemptions += 1
        self._finished_ids.add(request.request_id)
        self._waiting.appendleft(request)

    def _finish_early(self, request: Request, status: RequestStatus) -> None:
        """Finish while scheduling; reported by the next update_from_output."""
        self._finish(request, status)
        self._updates.append(RequestUpdate(request.request_id, [], status, max(request.num_cached_tokens, 0)))

    # -- scheduling -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide the next step: who runs how many tokens, with which blocks, slots and checkpoints."""
        ahead = self._ahead_rows()
        self._step += 1
        plan: list[Step] = []
        copies: list[tuple[int, int]] = []
        if self.speculator is not None:
            self.speculator.begin_step(len(self._running))
        budget, preempted = self._schedule_running(plan, self.config.max_num_batched_tokens, ahead)
        if not preempted:  # memory is short: let the running requests drain first
            self._schedule_waiting(plan, copies, budget)
        scheduled = [self._to_scheduled(*step) for step in plan]
        out = SchedulerOutput(self._step, scheduled, copies, self._finished_ids)
        self._tier_orders(out)
        self._finished_ids = set()
        if copies:
            self._pins[out.step] = [src for src, _ in copies]
        if scheduled:
            self._flight.append(out)
        self.last_output = out
        self.counters.num_steps += 1
        return out

    def _schedule_running(self, plan: list[Step], budget: int, ahead: dict[str, ScheduledRequest]) -> tuple[int, bool]:
        """Running requests in admission order; `ahead`: the rows of the step in flight (async scheduling)."""
        preempted = False
        running, cache = self._running, self.cache
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            computed, extra = request.num_computed_tokens, 0
            sr = ahead.get(request.request_id) if ahead else None
            if self._sits_out(request, plan):
                i += 1
                continue
            if sr is not None:
                start = self._ahead_start(request, sr)
                if start is None:
                    i += 1
                    continue  # it waits for its token
                computed, extra = start
            n = len(request.prompt_token_ids) + len(request.output_token_ids) + extra - computed
            drafts, k = self._drafts(request, budget) if n == 1 and self.speculator is not None else ([], 0)
            n = min(n + len(drafts) + k, budget)
            # Window blocks leave at the tokens computed on the host: a step in flight may still read them.
            if not cache.try_grow(request.request_id, computed + n, request.num_computed_tokens):  # usually no-op
                preempted = True  # memory is short
                if ahead:
                    break  # no preemption while a step is in flight: the next step preempts
                if not self._make_room(request, n):
                    if request.is_finished:
                        continue  # finished at its memory length; the next request now sits at index i
                    break  # it preempted itself: everything after it is gone too
            plan.append((request, computed, n, drafts, k))
            budget -= n
            i += 1
        return budget, preempted

    def _make_room(self, request: Request, n: int) -> bool:
        """Preempt from the tail until `request` can grow by n tokens; False if it left the running set."""
        if not self.cache.fits_alone(request.num_computed_tokens + n):
            # The KV pool cannot hold this sequence even alone: it has reached its memory length.
            self._finish_early(request, RequestStatus.FINISHED_LENGTH)
            return False
        computed = request.num_computed_tokens
        while not self.cache.try_grow(request.request_id, computed + n, computed):
            victim = self._running[-1]
            self._preempt_or_finish(victim)
            if victim is request:
                return False
        return True

    def _preempt_or_finish(self, request: Request) -> None:
        if self.cache.fits_alone(request.num_tokens):
            self._preempt(request)
        else:
            self._finish_early(request, RequestStatus.FINISHED_LENGTH)

    def _schedule_waiting(self, plan: list[Step], copies: list[tuple[int, int]], budget: int) -> None:
        max_running = self.config.max_num_seqs - len(self.remote.receiving)
        while self._waiting and budget > 0 and len(self._running) < max_running:
            request = self._waiting[0]
            if self._sits_out(request, plan):
                break  # FCFS: the next step takes it
            hit = self.cache.find_hit(request)
            if self.tiers is not None and self._promote(request, hit):
                continue  # loading from the tier; the next one may run meanwhile
            n = min(request.num_tokens - hit.num_tokens, budget)
            if not self.cache.can_admit(hit, n):
                break  # FCFS: nobody overtakes the head
            self._waiting.popleft()
            copy = self.cache.admit(request, hit, n)
            if copy is not None:
                copies.append(copy)
            self._record_hit(request, hit)
            request.num_computed_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            self._running.append(request)
            plan.append((request, hit.num_tokens, n, [], 0))
            budget -= n

    def _record_hit(self, request: Request, hit: CacheHit) -> None:
        if request.num_cached_tokens >= 0:
            self.counters.num_resumed_hit_tokens += hit.num_tokens
            return
        request.num_cached_tokens = hit.num_tokens
        counters = self.counters
        counters.prefix_cache_requests += 1
        counters.prefix_cache_queries += request.num_tokens
        counters.prefix_cache_hits += hit.num_tokens
        counters.checkpoint_miss_tokens += hit.checkpoint_miss_tokens

    def _to_scheduled(self, request: Request, start: int, n: int, drafts: list[int], k: int) -> ScheduledRequest:
        end = start + n - len(drafts) - k  # the committed tokens' end: no checkpoint is planned inside drafts
        rid = request.request_id
        cache = self.cache
        bs = cache.block_size
        # Only chunks that cross a block boundary can carry a checkpoint.
        checkpoints = cache.plan_checkpoints(request, start, end) if end // bs > start // bs else []
        known = len(request.prompt_token_ids) + len(request.output_token_ids)
        tokens = request.token_slice(start, min(end, known))  # a new list
        if end > known:  # scheduled ahead (async scheduling): the token the step in flight samples
            tokens.append(PLACEHOLDER_TOKEN_ID)
        return ScheduledRequest(
            rid,
            tokens + drafts if drafts else tokens,
            start,
            list(cache.kv.tables[rid]) if cache.kv is not None else [],
            cache.state.running[rid] if cache.state is not None else PAD_SLOT_ID,
            checkpoints,
            end >= known,
            request.sampling_params,
            len(request.output_token_ids) + (end > known),
            request.prompt_token_ids,
            request.output_token_ids,
            request.prompt_logprobs,
            list(cache.window.tables[rid]) if cache.window is not None else [],
            len(drafts), k, request.speculate, end > known,
        )

    # -- after the step ---------------------------------------------------------------------------
    def update_from_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[RequestUpdate]:
        """Apply a completed step: advance, register checkpoints and blocks, sample, stop, free."""
        if runner_out.pending is not None:  # its ids and checkpoints are still on the device
            raise RuntimeError(f"step {sched_out.step}'s runner output is not resolved (ModelRunnerOutput.resolve)")
        if sched_out.scheduled:
            if not self._flight or sched_out is not self._flight[0]:
                raise RuntimeError(f"step {sched_out.step} is not the oldest step in flight")
            self._flight.pop(0)
        self.cache.unpin(self._pins.pop(sched_out.step, ()))  # the copies are done
        updates, self._updates = self._updates, []
        self._tier_update(runner_out)
        written_all = runner_out.written_checkpoints
        sampled = runner_out.sampled_token_ids
        requests, cache, running_status = self._requests, self.cache, RequestStatus.RUNNING
        bs, hashing = cache.block_size, cache.enable_caching
        for sr in sched_out.scheduled:
            rid = sr.request_id
            request = requests.get(rid)
            if request is None or request.status != running_status:
                continue  # aborted or finished while the step ran: already freed
            if sr.num_draft_tokens or rid in runner_out.draft_token_ids:
                updates.append(self._apply_verified(request, sr, runner_out))
                continue
            start = sr.num_computed_tokens
            if start != request.num_computed_tokens:  # steps are applied in order, each from where the last ended
                raise RuntimeError(f"{rid}: step {sched_out.step} starts at {start}, not {request.num_computed_tokens}")
            end = request.num_computed_tokens = start + len(sr.token_ids)
            # Blocks become full, and checkpoints get written, only in chunks that cross a boundary.
            if end // bs > start // bs or rid in written_all:
                cache.commit(request, written_all.get(rid, ()), bool(sr.checkpoints))
            if not sr.sample:
                continue
            token = sampled[rid]
            output = request.output_token_ids
            output.append(token)
            num_tokens = len(request.prompt_token_ids) + len(output)
            if hashing and num_tokens // bs > len(request.block_hashes):
                cache.hasher.update(request)
            status = self._check_stop(request, token, num_tokens)
            if status is not None:
                self._finish(request, status)
            updates.append(RequestUpdate(rid, [token], status, request.num_cached_tokens))
        self._drain(sched_out.step)
        return updates

    def _check_stop(self, request: Request, token: int, num_tokens: int) -> RequestStatus | None:
        num_output = len(request.output_token_ids)
        if (
            (request.eos_token_ids or request.stop_token_ids)
            and num_output >= request.min_tokens
            and (token in request.eos_token_ids or token in request.stop_token_ids)
        ):
            return RequestStatus.FINISHED_STOPPED
        if num_output >= request.max_tokens or num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- maintenance ------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and checkpoint. Refused (False) while a step is in flight."""
        if self._flight:
            return False
        self.cache.reset()
        return True

    def check_integrity(self) -> None:
        """Assert every accounting and plan invariant (DESIGN section 3); AssertionError names the breach."""
        check_scheduler(self)

    @property
    def stats(self) -> SchedulerStats:
        spec = self.speculator.counters if self.speculator is not None else None
        return scheduler_stats(self.counters, self.cache, len(self._running), len(self._waiting), spec, self.tiers)
