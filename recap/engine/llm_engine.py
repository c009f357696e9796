"""LLMEngine: one synchronous step loop joining the scheduler (cache core) and the model runner."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from recap.core.output import ModelRunnerOutput, SchedulerOutput
from recap.core.request import RequestStatus
from recap.core.scheduler import Scheduler
from recap.core.speculation import Speculator, drafting_rows
from recap.core.stats import SchedulerStats
from recap.engine.config import EngineConfig
from recap.engine.errors import InvalidRequestError
from recap.engine.input_processor import InputProcessor, PreparedRequest
from recap.engine.metrics import EngineMetrics, MetricsSnapshot, request_finish_reason
from recap.engine.model_defaults import derived_max_model_len, generation_defaults
from recap.engine.output_processor import OutputProcessor, ParentState, child_id
from recap.engine.outputs import RequestOutput
from recap.kernels.kernel_set import kernel_set
from recap.model.head_format import head_backend
from recap.model.hf_config import architecture_of, read_hf_config, translate_config
from recap.model.loader import LoadedModel, load_model, load_tokenizer, resolve_model_path
from recap.model.prequantized import prequantized_format, serving_format
from recap.runner.device import resolve_device
from recap.runner.draft_model import draft_pools, load_draft_runner
from recap.runner.grammar import GrammarBackend
from recap.runner.host_memory import MemoryLimit, process_memory_limit
from recap.runner.memory import plan_before_load, remedies
from recap.runner.model_runner import ModelRunner, RunnerConfig
from recap.runner.mtp_drafter import load_mtp_drafter
from recap.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# Steps the runner may fail in a row before the engine stops: one failure puts a step's requests under suspicion
# and each retry runs one suspect, so a few poisoned requests fail a few steps; a lost device fails them all.
MAX_FAILED_STEPS = 8


def _eos_ids(tokenizer: object, model_path: Path) -> frozenset[int]:
    ids: set[int] = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    gen = model_path / "generation_config.json"
    if gen.is_file():
        val = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(val if isinstance(val, list) else [val] if isinstance(val, int) else [])
    return frozenset(ids)


def _load_within_memory(
    config: EngineConfig, device: torch.device
) -> tuple[LoadedModel, EngineConfig, MemoryLimit | None]:
    """Resolve the model and its config, derive max_model_len where asked, refuse (MemoryPlanError) on the CPU a
    model whose weights in the serving format, with the pools and the runtime, cannot fit the memory limit
    before a weight is read, then load it. Returns the model, the config with the derived length, the limit."""
    model = config.model
    if model is None:
        from recap.model.trained_default import default_model_path

        model = str(default_model_path())
    path = resolve_model_path(model)
    hf = read_hf_config(path)
    architecture_of(hf)  # an unsupported architecture is refused as such, not as a memory plan
    model_config = translate_config(hf)
    if config.derive_max_model_len:
        length = derived_max_model_len(model_config.max_position_embeddings)
        config = replace(config, scheduler=replace(config.scheduler, max_model_len=length))
    dtype = getattr(torch, config.dtype)
    limit = None
    if device.type == "cpu":
        given = config.memory_limit_bytes
        limit = MemoryLimit(given, "the given memory limit") if given is not None else process_memory_limit()
        fmt = prequantized_format(hf)  # a pre-quantized checkpoint is planned in the format it will run in
        quant = config.quantization if fmt is None else serving_format(fmt, config.quantization, False, True)
        head = head_backend(quant, config.head_quantization)
        plan = plan_before_load(model_config, config.cache, config.scheduler, dtype, quant, limit, head)
        plan.check(remedies(dtype, quant, plan))
    loaded = load_model(path, dtype=dtype, quantization=config.quantization, native_decode=config.native_decode,
                        device=device, head_quantization=config.head_quantization,
                        quantization_imatrix=config.quantization_imatrix)  # fmt: skip
    return loaded, config, limit


class LLMEngine:
    """Not thread-safe: one thread drives add/abort/step (AsyncEngine runs it on its own thread)."""

    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        device = resolve_device(config.device)
        if device.type != "cpu" and config.quantization is not None:
            raise ValueError(f"quantization {config.quantization!r} runs on the CPU only (fbgemm); got device {device}")
        kernels = kernel_set(config.kernels, device)
        dtype = getattr(torch, config.dtype)
        loaded, config, limit = _load_within_memory(config, device)
        self.config = config
        self.model_path = loaded.path
        self.model_config = loaded.config
        self.tokenizer = load_tokenizer(config.tokenizer or loaded.path, config.chat_template)
        self.served_model_name = config.served_model_name or (config.model or "recap-default-hybrid")
        self.eos_token_ids = _eos_ids(self.tokenizer, loaded.path)
        # Request fields a client leaves unset take these (generation_config.json, as vLLM reads it).
        self.default_sampling = generation_defaults(loaded.path, config.generation_config)
        SamplingParams(**self.default_sampling)  # a bad file fails here, naming the field
        self.runner = ModelRunner(
            loaded, config.cache, config.scheduler,
            RunnerConfig(dtype=dtype, device=str(device), seed=config.seed, kernels=kernels,
                         gpu_memory_utilization=config.gpu_memory_utilization, memory_limit=limit,
                         num_speculative_tokens=config.speculative.num_speculative_tokens if config.speculative else 0,
                         async_scheduling=config.scheduler.async_scheduling),
            self.eos_token_ids,
        )  # fmt: skip
        self.runner.grammar = GrammarBackend(self.tokenizer, self.eos_token_ids)
        spec = config.speculative
        if spec is not None and spec.method in ("draft_model", "mtp"):
            pools = draft_pools(config.cache.block_size, config.scheduler.max_num_seqs, config.scheduler.max_model_len,
                                self.runner.pools.num_kv_blocks, spec.num_speculative_tokens,
                                drafting_rows(config.scheduler.max_num_seqs))  # fmt: skip
            self.runner.attach_drafter(load_draft_runner(
                spec.model, loaded.config.vocab_size, self.tokenizer, pools, config.cache.block_size, dtype,
                str(device), kernels, config.native_decode) if spec.model is not None else load_mtp_drafter(
                loaded, pools, config.cache.block_size, dtype, str(device), kernels))  # fmt: skip
        speculator = None
        if config.speculative is not None:
            # the verify graph's size, where this model's verify steps take one (Backend.max_verify_tokens)
            max_step = self.runner.backend.max_verify_tokens(self.runner.model, self.runner.caches)
            speculator = Speculator(config.speculative, config.cache.block_size, config.scheduler.max_model_len,
                                    max_rows=drafting_rows(config.scheduler.max_num_seqs), max_step_tokens=max_step)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.runner.layout, speculator)
        if self.runner.tier is not None and self.runner.tier.disk is not None and self.scheduler.tiers is not None:
            self.scheduler.tiers.restore(self.runner.tier.scan(), self.runner.tier.disk_level)  # a restart finds them
        self.processor = InputProcessor(
            self.tokenizer, loaded.config.vocab_size, config.scheduler.max_model_len, self.eos_token_ids, config.max_n
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics(max_model_len=config.scheduler.max_model_len)
        self._counter = 0
        # Async scheduling: the step executed and not yet updated (the scheduler updates it after the next one).
        self._pending: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self._failed_in_a_row = 0  # steps the runner raised on since the last one it ran

    # ---- requests -------------------------------------------------------------------------------
    def next_request_id(self) -> str:
        self._counter += 1
        return f"req-{self._counter}"

    def prepare(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        segment_boundaries: Sequence[int] = (),
        cache_salt: str | None = None,
        fit_max_tokens: bool = False,
    ) -> PreparedRequest:
        """Validate and tokenize (raises InvalidRequestError); safe to call from any thread. `fit_max_tokens`:
        params.max_tokens is a default, capped at the room the prompt leaves (InputProcessor.prepare)."""
        return self.processor.prepare(
            request_id or self.next_request_id(), prompt, params,
            segment_boundaries=segment_boundaries, cache_salt=cache_salt, arrival_time=time.monotonic(),
            fit_max_tokens=fit_max_tokens,
        )

    def add_prepared(self, p: PreparedRequest) -> None:
        if p.request_id in self.outputs.parents:
            raise InvalidRequestError(f"request id {p.request_id!r} is already running")
        state = self.outputs.add(p)
        ids = [child_id(p.request_id, i) for i in range(p.params.n)]
        # n > 1: the first sample computes the prompt; the others join once its cache is
        # registered, so they share the prompt's KV blocks and checkpoint instead of recomputing.
        first = ids if not self.config.cache.enable_prefix_caching else ids[:1]
        state.pending_forks = [c for c in ids if c not in first]
        for i, cid in enumerate(first):
            self.scheduler.add_request(self.processor.make_core_request(p, cid, i))

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams, **kw: object) -> str:
        p = self.prepare(prompt, params, **kw)  # type: ignore[arg-type]
        self.add_prepared(p)
        return p.request_id

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            parent = self.outputs.parents.get(rid)
            if parent is None:
                continue
            parent.pending_forks.clear()
            live = [cid for cid, c in parent.children.items() if not c.output.finished]
            self.scheduler.abort_requests(live)
            for cid in live:
                self.outputs.on_finished(cid, RequestStatus.FINISHED_ABORTED)

    def close(self) -> None:
        """Write what the read pools hold to the disk tier and wait for every write (a restart finds them all).
        The engine must not step afterwards."""
        tiers, store = self.scheduler.tiers, self.runner.tier
        if tiers is not None and store is not None and not store.closed and self.scheduler.view.in_flight is None:
            saves, drops = tiers.flush()
            store.step(SchedulerOutput(step=-1, scheduled=[], tier_saves=saves, tier_drops=drops))
        self.runner.close()

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.parents) or self.scheduler.has_unfinished_requests() or self._pending is not None

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step and apply it, or, under async scheduling, apply the step before it: that step's
        update comes after this one was scheduled and run (docs/gpu.md, async scheduling)."""
        t0 = time.perf_counter()
        sched_out = self.scheduler.schedule()
        self._mark_scheduled(sched_out)
        try:
            runner_out = self.runner.execute(sched_out)
        except Exception as e:  # noqa: BLE001 - the step's requests are retried apart (core/step_faults.py)
            self._step_failed(sched_out, e, t0)
            return self._collect()
        self._failed_in_a_row = 0
        done = [(sched_out, runner_out)]
        if self.config.scheduler.async_scheduling:
            done, self._pending = [self._pending] if self._pending is not None else [], None
            if sched_out.scheduled:
                self._pending = (sched_out, runner_out)
            else:  # nothing ran ahead: the next step is scheduled after this update
                done.append((sched_out, runner_out))
        for out, result in done:
            self._apply(out, result, t0)
        return self._collect()

    def _step_failed(self, sched_out: SchedulerOutput, error: Exception, t0: float) -> None:
        """The runner raised on `sched_out`: the step before it (async scheduling) is applied, then the core undoes
        this one; its suspects end with an error, its other requests are retried. Past MAX_FAILED_STEPS in a row
        the fault is the engine's (a lost device), not a request's: it is raised and the engine stops."""
        self._failed_in_a_row += 1
        if self._failed_in_a_row > MAX_FAILED_STEPS:
            raise error
        log.error("step %d failed (%s: %s); its %d requests are retried one suspect per step", sched_out.step,
                  type(error).__name__, error, len(sched_out.scheduled), exc_info=error)  # fmt: skip
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._apply(*pending, t0)
        message = (f"the engine step running this request failed ({type(error).__name__}: {error}), and so did its "
                   "retry in a step of its own; other requests were not affected")  # fmt: skip
        for u in self.scheduler.fail_step(sched_out):
            parent = self.outputs.parents.get(self.outputs.child_to_parent.get(u.request_id, ""))
            if parent is not None:  # forks waiting for its first token would wait forever: they fail with it
                for cid in [u.request_id, *parent.pending_forks]:
                    self.outputs.on_error(cid, message, internal=True)
                parent.pending_forks = []

    def _collect(self) -> list[RequestOutput]:
        """The step's outputs, after the integrity check (when on) and the finished requests' metrics."""
        if self.config.check_integrity:
            self.scheduler.check_integrity()
        results, finishing = self.outputs.collect()
        for r in results:
            if r.finished:
                self.metrics.observe_finished(len(r.prompt_token_ids),
                                              request_finish_reason([o.finish_reason for o in r.outputs]))
        for parent in finishing:
            self._observe_request(parent)
        return results

    def _apply(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput, t0: float) -> None:
        """Update the scheduler from a step's output and hand its tokens to the output processor. The output is
        resolved here: under async scheduling its ids reach the host only now, after the next step was launched."""
        updates = self.scheduler.update_from_output(sched_out, runner_out.resolve())
        logprobs = runner_out.extras.get("logprobs", {})
        for cid, found in runner_out.extras.get("prompt_logprobs", {}).items():
            if cid in self.outputs.child_to_parent:
                self.outputs.on_prompt_logprobs(cid, found)
        stopped: list[str] = []
        failed, errored = runner_out.extras.get("grammar_failed", {}), []
        new_tokens = 0
        outputs = self.outputs
        parents, child_to_parent = outputs.parents, outputs.child_to_parent  # looked up once, not per row
        for u in updates:
            rid = u.request_id
            parent = parents.get(child_to_parent.get(rid, ""))
            if parent is None:
                continue
            if rid in failed:  # its grammar broke: the token was drawn unconstrained, so it is dropped
                outputs.on_error(rid, failed[rid])
                errored += [rid] if u.finished is None else []
                self._release_forks(parent)
                continue
            new_tokens += len(u.new_token_ids)
            metrics = parent.metrics
            had_first = metrics.first_token_time is not None
            # on_tokens keeps no reference to the list (it extends the outputs' own lists)
            hit_stop = outputs.on_tokens(rid, u.new_token_ids, logprobs.get(rid), u.num_cached_tokens)
            if u.finished is not None:
                outputs.on_finished(rid, u.finished)
            elif hit_stop:
                stopped.append(rid)
            if not had_first and metrics.first_token_time is not None:
                self.metrics.observe_ttft(metrics.first_token_time - metrics.arrival_time)
            if parent.pending_forks:
                self._release_forks(parent)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        if errored:
            self.scheduler.finish_requests(errored, RequestStatus.FINISHED_ERROR)
        self.metrics.observe_inter_token(self.outputs.take_inter_token_gaps(), sched_out.num_batched_tokens)
        if not sched_out.is_empty:
            self.metrics.observe_step(time.perf_counter() - t0, new_tokens)

    def _mark_scheduled(self, sched_out: SchedulerOutput) -> None:
        """First time a request runs (vLLM's end of the queue phase)."""
        now = None
        for s in sched_out.scheduled:
            parent = self.outputs.parents.get(self.outputs.child_to_parent.get(s.request_id, ""))
            if parent is not None and parent.metrics.first_scheduled_time is None:
                now = now or time.monotonic()
                parent.metrics.first_scheduled_time = now

    def _observe_request(self, parent: ParentState) -> None:
        m = parent.metrics
        outs = [c.output for c in parent.children.values()]
        self.metrics.observe_request(
            arrival=m.arrival_time, scheduled=m.first_scheduled_time, first_token=m.first_token_time,
            finished=m.finished_time or time.monotonic(), prompt_tokens=len(parent.prepared.prompt_token_ids),
            generation_tokens=sum(len(o.token_ids) for o in outs), n=parent.prepared.params.n,
            max_tokens=parent.prepared.max_tokens,
        )

    def _release_forks(self, parent: ParentState) -> None:
        if parent.pending_forks and parent.metrics.first_token_time is not None:
            for cid in parent.pending_forks:
                index = parent.children[cid].index
                self.scheduler.add_request(self.processor.make_core_request(parent.prepared, cid, index))
            parent.pending_forks = []

    def metrics_snapshot(self) -> MetricsSnapshot:
        stats = self.scheduler.stats
        store = self.runner.tier
        return self.metrics.snapshot(stats, self.scheduler.num_running, self.scheduler.num_waiting,
                                     self._cache_usage(stats), store.stats.rejected_files if store else 0)

    def _cache_usage(self, stats: SchedulerStats) -> float:
        """vLLM's kv_cache_usage_perc (0..1): KV blocks in use; for a model without attention, state slots."""
        pools = self.runner.pools
        if pools.num_kv_blocks > 1:
            return 1.0 - stats.kv_blocks_free / (pools.num_kv_blocks - 1)
        if pools.num_state_slots:
            return 1.0 - stats.state_slots_free / pools.num_state_slots
        return 0.0
