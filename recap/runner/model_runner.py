"""ModelRunner: SchedulerOutput -> ForwardBatch -> model -> sampled tokens and written checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from recap.backends import Backend, backend_for
from recap.backends.graph_memory import StepLimits
from recap.config import CacheConfig, CacheLayout, SchedulerConfig
from recap.core.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from recap.core.speculation import drafting_rows
from recap.kernels.batch import build_forward_batch
from recap.kernels.kernel_set import TORCH_KERNELS, KernelSet
from recap.kernels.metadata import ForwardBatch, SeqSpec
from recap.model.cache import ModelCaches
from recap.model.footprint import held_weight_bytes, prefill_activation_bytes, widest_linear
from recap.model.loader import LoadedModel
from recap.model.quant import QUANTIZATIONS
from recap.runner.device import device_pool_budget
from recap.runner.grammar import GrammarBackend, GrammarFailed
from recap.runner.host_copy import CheckpointReads, PendingSamples, resolve_now
from recap.runner.host_memory import MemoryLimit, process_memory_limit
from recap.runner.memory import (
    RUNTIME_OVERHEAD_BYTES,
    MemoryPlan,
    PoolSizes,
    pool_share_base,
    remedies,
    size_pools,
    weight_format,
)
from recap.runner.placeholders import SampledIds
from recap.runner.sampler import RowLogprobs, Sampler, SampleRow, position_generator, row_logprobs, takes_argmax
from recap.runner.speculative import VerifyRow, greedy_emit, position_rows, verify_emit, verify_rows
from recap.runner.tier_stores import TierStepReport, open_tier_stores
from recap.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine builds and attaches it
    from recap.runner.draft_model import DraftModelRunner
    from recap.runner.mtp_drafter import MTPDrafter

_GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class RunnerConfig:
    dtype: torch.dtype = torch.float32
    device: str = "cpu"  # where the model's weights are; the pools and each step's metadata go there too
    seed: int | None = 0
    kernels: KernelSet = field(default=TORCH_KERNELS)  # the ops the layers call (kernels/kernel_set.py)
    gpu_memory_utilization: float = 0.9  # on a GPU: the share of its memory the process may hold
    # On the CPU: the memory the process may hold in all; the plan (weights + pools + runtime) is refused with
    # MemoryPlanError before the pools are allocated when it does not fit. None: measured (host_memory.py).
    memory_limit: MemoryLimit | None = None
    # Speculative decoding: the most drafts per verify row; this many scratch state slots per drafting row of a
    # step (core/speculation.drafting_rows) hold the states inside verify rows (runner/speculative.py). 0: none.
    num_speculative_tokens: int = 0
    # Async scheduling (core/async_scheduling.py): keep each step's sampled ids for the next step's placeholders.
    async_scheduling: bool = False


class ModelRunner:
    """Owns the model, the backend that runs it (recap/backends/: built from the loaded model's flags and
    the device), its KV/state tensors and the sampler. Stateless across steps otherwise, but for the drafter's and
    the grammar's per-request state (dropped when the scheduler reports a request gone)."""

    # speculative method "draft_model" (runner/draft_model.py) or "mtp" (runner/mtp_drafter.py): the engine's
    drafter: DraftModelRunner | MTPDrafter | None = None

    def __init__(
        self,
        loaded: LoadedModel,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        runner_config: RunnerConfig,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.model = loaded.model
        self.config = loaded.config
        self.backend: Backend = backend_for(loaded, runner_config.device, runner_config.kernels)
        self.backend.prepare(self.model)
        self.cache_config, self.runner_config, self.eos_token_ids = cache_config, runner_config, eos_token_ids
        dtype = runner_config.dtype
        self.device = torch.device(runner_config.device)
        self.kv_bytes_per_token = self.config.kv_bytes_per_token(dtype)
        self.window_bytes_per_token = self.config.window_bytes_per_token(dtype)
        self.state_bytes_per_slot = self.config.state_bytes_per_slot(dtype)
        on_cpu = self.device.type == "cpu"
        self.memory_limit = (runner_config.memory_limit or process_memory_limit()) if on_cpu else None
        # A GPU's host tier lives outside the device memory its plan is about.
        self.host_tier_bytes = (cache_config.cache_host_bytes or 0) if on_cpu else 0
        self.weights = held_weight_bytes(self.model)  # measured once the backend has made its copies
        self.overhead_bytes = RUNTIME_OVERHEAD_BYTES + prefill_activation_bytes(
            scheduler_config.max_num_batched_tokens, widest_linear(self.model, self.config.vocab_size))
        self.graph_bytes = self.backend.graph_bytes(self.model, StepLimits(
            scheduler_config.max_num_seqs, scheduler_config.max_model_len, cache_config.block_size))
        self.pools: PoolSizes = self._size_pools(cache_config, scheduler_config, runner_config)
        # Scratch slots past the core's pool: never handed out by it, never registered (runner/speculative.py).
        spec_rows = drafting_rows(scheduler_config.max_num_seqs)
        self.num_scratch_slots = runner_config.num_speculative_tokens * spec_rows if self.state_bytes_per_slot else 0
        self.quantization = loaded.linear_backend if loaded.linear_backend in QUANTIZATIONS else None
        plan = self.memory_plan()
        plan.check(remedies(dtype, self.quantization, plan))  # before a byte of the pools is allocated
        self.caches = ModelCaches.allocate(
            self.config,
            num_kv_blocks=self.pools.num_kv_blocks,
            block_size=cache_config.block_size,
            num_state_slots=self.pools.num_state_slots + self.num_scratch_slots,
            dtype=dtype,
            device=self.device,
            num_window_blocks=self.pools.num_window_blocks,
            zeros=self.backend.cache_zeros(),  # the CPU fast path streams them as it streams the weights
        )
        self.has_kv, self.has_window = self.kv_bytes_per_token > 0, self.window_bytes_per_token > 0
        self.has_state = self.state_bytes_per_slot > 0
        self.tier = open_tier_stores(cache_config, loaded.path, str(dtype), self.quantization, self.caches)
        self.sampler = Sampler(runner_config.seed)
        # Structured output (recap/runner/grammar.py); set by the engine, which owns the tokenizer.
        self.grammar: GrammarBackend | None = None
        self._grammar_failed: dict[str, str] = {}  # this step's: request id -> why its matcher failed
        self.sampled_ids = SampledIds()  # the last step's, for placeholder rows (async scheduling)

    def _size_pools(self, cache: CacheConfig, sched: SchedulerConfig, runner: RunnerConfig) -> PoolSizes:
        """The pools, out of what the weights, the runtime and the decode graphs leave (the graphs are captured
        after the pools are allocated: their bytes are kept back from a GPU's pool budget too)."""
        share = None if self.memory_limit is None else pool_share_base(
            self.memory_limit, self.weights.total, self.overhead_bytes + self.graph_bytes + self.host_tier_bytes)
        budget = device_pool_budget(self.device, runner.gpu_memory_utilization)
        return size_pools(cache, sched, self.kv_bytes_per_token, self.state_bytes_per_slot, available=share,
                          window_bytes_per_token=self.window_bytes_per_token,
                          device_budget=None if budget is None else max(budget - self.graph_bytes, 0))  # fmt: skip

    def attach_drafter(self, drafter: DraftModelRunner | MTPDrafter) -> None:
        """Use this drafter (speculative method "draft_model" or "mtp"); the memory plan, with it, is checked again
        (MemoryPlanError when it no longer fits)."""
        self.drafter = drafter
        plan = self.memory_plan()
        plan.check(remedies(self.runner_config.dtype, self.quantization, plan))

    def memory_plan(self) -> MemoryPlan:
        """The bytes this runner holds: the weights as measured at start (parameters, buffers, and what the linear
        layers keep beside them), the two pools and speculation's scratch slots, the runtime overhead, the backend's
        decode graphs (estimated before capture), against the memory limit (CPU)."""
        w = self.weights
        return MemoryPlan(w.parameters, w.linear_copies, self.pools, self.cache_config.block_size,
                          self.overhead_bytes, self.memory_limit,
                          weight_format(self.runner_config.dtype, self.quantization, self.backend.head_backend),
                          num_scratch_slots=self.num_scratch_slots,
                          draft_bytes=self.drafter.total_bytes if self.drafter is not None else 0,
                          graph_bytes=self.graph_bytes, host_tier_bytes=self.host_tier_bytes)  # fmt: skip

    @property
    def layout(self) -> CacheLayout:
        return CacheLayout(
            block_size=self.cache_config.block_size,
            num_kv_blocks=self.pools.num_kv_blocks,
            num_state_slots=self.pools.num_state_slots,
            has_kv=self.has_kv,
            has_state=self.has_state,
            kv_bytes_per_token=self.kv_bytes_per_token,
            state_bytes_per_slot=self.state_bytes_per_slot,
            flops_per_token=self.config.flops_per_token(),
            sliding_window=self.config.sliding_window,
            num_window_blocks=self.pools.num_window_blocks,
            window_bytes_per_token=self.window_bytes_per_token,
        )

    def _spec(self, s: ScheduledRequest, verify: VerifyRow | None = None) -> SeqSpec:
        writes = [(c.position, c.slot) for c in s.checkpoints]
        return SeqSpec(
            token_ids=s.token_ids,
            context_len=s.num_computed_tokens,
            block_ids=s.block_ids,
            state_slot=s.state_slot,
            checkpoints=writes if verify is None else verify.extra_writes(writes),
            sample=s.sample and verify is None,  # a verify row's logits are read at every position (_verify)
            window_block_ids=s.window_block_ids,
        )

    def build_batch(self, out: SchedulerOutput, verify: list[VerifyRow] | None = None) -> ForwardBatch:
        by_row = {v.row: v for v in verify or ()}
        batch = build_forward_batch(
            self.backend.shape_rows([self._spec(s, by_row.get(row)) for row, s in enumerate(out.scheduled)]),
            block_size=self.cache_config.block_size,
            chunk_size=self.config.ssm_chunk_size,
            with_attention=self.has_kv,
            with_ssm=self.has_state,
            device=self.device,
            with_window=self.has_window,
            kernels=self.backend.kernels,
        )
        batch.num_draft_tokens = sum(len(v.drafts) for v in by_row.values())
        return batch

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_request_ids:
            if self.drafter is not None:
                self.drafter.forget(rid)
            if self.grammar is not None:
                self.grammar.drop(rid)
        tier = self.tier.step(out) if self.tier is not None else None  # saves first: copies may reuse their slots
        try:
            return _with_tier(self._run(out, tier), tier)
        except BaseException:
            if tier is not None and self.tier is not None:
                self.tier.carry(tier)  # what the store reported goes out with the next step
            raise

    def _run(self, out: SchedulerOutput, tier: TierStepReport | None) -> ModelRunnerOutput:
        """The step after its tier orders: state copies, the forward pass, sampling and reports."""
        for src, dst in out.state_copies:
            self.caches.copy_state(src, dst)
        if out.is_empty:
            if tier is not None and not tier.loaded and self.tier is not None:
                self.tier.wait(0.01)  # nothing to run but loads in flight: do not spin
            return ModelRunnerOutput()
        drafted: dict[str, list[int]] = {}
        if self.drafter is not None:
            out, drafted = self.drafter.propose(out)
        verify = self._verify_rows(out)
        batch = self.build_batch(out, verify)
        if self.runner_config.async_scheduling:  # placeholder rows take the last step's sampled ids
            self.sampled_ids.fill(out.scheduled, batch.input_ids)
        if self.has_state and batch.planned_checkpoints:
            self.caches.slot_positions[[p[2] for p in batch.planned_checkpoints]] = -1
        result = ModelRunnerOutput()
        rows = [out.scheduled[r] for r in batch.sample_rows]
        if rows and not verify and all(self._takes_argmax(s) for s in rows):  # the backend's head and argmax
            hidden, ids = self.backend.forward_greedy(self.model, batch, self.caches)  # where the model runs
        else:
            hidden = self.backend.forward(self.model, batch, self.caches)
            ids = self._sample(rows, batch, hidden, result) if rows else torch.empty(0, dtype=torch.int64)
        if verify:
            self._verify(out, batch, hidden, verify, result)
        if self.drafter is not None:  # it commits its drafts and takes the hidden states it needs (an MTP head)
            result.draft_token_ids = drafted
            self.drafter.after_step(out, batch, hidden, result)
        if any(s.prompt_logprobs for s in out.scheduled):
            result.extras["prompt_logprobs"] = self._prompt_logprobs(out, batch, hidden)
        self._report(out, batch, [s.request_id for s in rows], ids, result)
        return result

    def _report(self, out: SchedulerOutput, batch: ForwardBatch, request_ids: list[str], ids: torch.Tensor,
                result: ModelRunnerOutput) -> None:  # fmt: skip
        """The step's sampled ids and the positions its kernels wrote into the planned checkpoint slots (not what
        was planned): read now, or, under async scheduling, copying to the host until the engine resolves the
        output (runner/host_copy.py); the next step's placeholders take the ids where they are."""
        reads, positions = self._checkpoint_reads(out, batch) if self.has_state else (None, None)
        if not self.runner_config.async_scheduling:
            resolve_now(result, request_ids, ids, reads, positions)
            return
        if request_ids or reads is not None:  # a prefill chunk mid-prompt reads nothing
            result.pending = PendingSamples(request_ids, ids, reads, positions)
        self.sampled_ids.keep(request_ids, ids, batch.input_ids.device)

    def _sample(self, rows: list[ScheduledRequest], batch: ForwardBatch, hidden: torch.Tensor,
                result: ModelRunnerOutput) -> torch.Tensor:  # fmt: skip
        """Sample `rows` (the batch's sampled rows) from their logits; their ids, on the host (the sampler read the
        logits there). On a GPU the sampler takes greedy rows' argmax there, else one copy of the rows' logits to
        the host."""
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        sampled = self.sampler(logits, [self._sample_row(s, logits.shape[-1]) for s in rows])
        result.extras["logprobs"] = {s.request_id: lp for s, lp in zip(rows, sampled.logprobs) if lp is not None}
        if self._grammar_failed:  # their tokens were drawn unconstrained: the engine drops them
            result.extras["grammar_failed"], self._grammar_failed = self._grammar_failed, {}
        return torch.tensor(sampled.token_ids, dtype=torch.int64)

    def _takes_argmax(self, s: ScheduledRequest) -> bool:
        """Whether the row's token is the argmax of its raw logits and nothing else is asked of them."""
        params: SamplingParams = s.sampling_params or _GREEDY
        banned = s.num_output_tokens < params.min_tokens and bool(self._stop_ids(params))
        return takes_argmax(params, banned, params.structured_outputs is not None)

    def close(self) -> None:
        """Finish the disk tier's queued writes (a restarted server finds them)."""
        if self.tier is not None:
            self.tier.close()

    def _verify_rows(self, out: SchedulerOutput) -> list[VerifyRow]:
        if not any(s.num_draft_tokens for s in out.scheduled):
            return []
        base = self.pools.num_state_slots
        return verify_rows(out.scheduled, iter(range(base, base + self.num_scratch_slots)), self.has_state)

    def _verify(self, out: SchedulerOutput, batch: ForwardBatch, hidden: torch.Tensor, verify: list[VerifyRow],
                result: ModelRunnerOutput) -> None:  # fmt: skip
        """Verify every verify row from one logits computation (greedy acceptance, or rejection sampling for a
        sampled request); the state after the accepted tokens becomes the running state (runner/speculative.py)."""
        qsl = batch.query_start_loc.tolist()
        index = torch.cat([torch.arange(qsl[v.row], qsl[v.row + 1], device="cpu") for v in verify]).to(hidden.device)
        logits = self.model.compute_logits(hidden[index]).float()
        targets = torch.argmax(logits, dim=-1).tolist()
        host: torch.Tensor | None = None  # the sampler works on the host: one copy, if a row needs it
        off = 0
        for v in verify:
            n = len(v.drafts) + 1
            s = out.scheduled[v.row]
            params: SamplingParams = s.sampling_params or _GREEDY
            if params.greedy and not params.has_penalties and params.min_tokens == 0:  # argmax of the raw logits
                emitted = greedy_emit(v.drafts, targets[off : off + n])
            else:
                host = logits.cpu() if host is None else host
                rows = position_rows(self._sample_row(s, logits.shape[-1]), v.drafts, s.num_output_tokens,
                                     self._stop_ids(params))  # fmt: skip
                emitted = verify_emit(host[off : off + n], v.drafts, rows, self.sampler.generator)
            off += n
            accepted = len(emitted) - 1
            if v.state_slots and accepted < len(v.drafts):
                self._restore_state(v, accepted)
            result.spec_token_ids[v.request_id] = emitted

    def _restore_state(self, v: VerifyRow, accepted: int) -> None:
        """Copy the state after first + accepted tokens into the running slot, checking the position the kernels
        wrote there (provenance, as for a checkpoint)."""
        src = v.state_slots[accepted]
        written = int(self.caches.slot_positions[src])
        if written != v.first + accepted:
            raise RuntimeError(f"{v.request_id}: slot {src} holds the state at {written}, not {v.first + accepted}")
        self.caches.copy_state(src, v.running_slot)

    def _sample_row(self, s: ScheduledRequest, vocab: int) -> SampleRow:
        params: SamplingParams = s.sampling_params or _GREEDY
        seeded = params.seed is not None and not params.greedy
        gen = position_generator(params.seed, s.num_output_tokens) if seeded else None  # type: ignore[arg-type]
        banned = self._stop_ids(params) if s.num_output_tokens < params.min_tokens else ()
        allowed = None
        if params.structured_outputs is not None:
            if self.grammar is None:
                raise RuntimeError("a structured-output request reached a runner without a grammar backend")
            start = self.grammar.start(s.request_id, params.structured_outputs_after, s.output_token_ids)
            try:
                if start is not None:
                    allowed = self.grammar.allowed(s.request_id, params.structured_outputs,
                                                   s.output_token_ids[start:], vocab)
            except GrammarFailed as e:
                self._grammar_failed[s.request_id] = str(e)
        return SampleRow(params, gen, banned, s.prompt_token_ids, s.output_token_ids, allowed)

    def _stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        """The tokens a request may not sample before min_tokens: its stop ids and (unless ignored) EOS."""
        return tuple(sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)))

    def _prompt_logprobs(
        self, out: SchedulerOutput, batch: ForwardBatch, hidden: torch.Tensor
    ) -> dict[str, tuple[int, list[RowLogprobs]]]:
        """Per request: (first position, logprobs of the prompt tokens at first+1, first+2, ...) that
        this chunk's positions predict; the raw distribution, as for sampled tokens."""
        found: dict[str, tuple[int, list[RowLogprobs]]] = {}
        qsl = batch.query_start_loc.tolist()
        for row, s in enumerate(out.scheduled):
            prompt = s.prompt_token_ids
            start = s.num_computed_tokens
            stop = min(start + len(s.token_ids), len(prompt) - 1)  # the last prompt token predicts no prompt token
            if not s.prompt_logprobs or stop <= start:
                continue
            k = (s.sampling_params.prompt_logprobs or 0) if s.sampling_params is not None else 0
            lp = torch.log_softmax(self.model.compute_logits(hidden[qsl[row]:qsl[row] + stop - start]).cpu(), -1)
            found[s.request_id] = (start, [row_logprobs(lp[j], prompt[start + 1 + j], k) for j in range(stop - start)])
        return found

    def _checkpoint_reads(self, out: SchedulerOutput,
                          batch: ForwardBatch) -> tuple[CheckpointReads | None, torch.Tensor | None]:  # fmt: skip
        """The step's planned checkpoints outside speculation's scratch slots (verify rows' states are none) and the
        positions the kernels wrote into their slots, gathered where the pools are."""
        scratch = self.pools.num_state_slots
        planned = [(row, slot) for row, _pos, slot in batch.planned_checkpoints if slot < scratch]
        if not planned:
            return None, None
        reads = CheckpointReads([out.scheduled[row].request_id for row, _ in planned], [slot for _, slot in planned])
        return reads, self.caches.slot_positions[reads.slots]


def _with_tier(result: ModelRunnerOutput, tier: TierStepReport | None) -> ModelRunnerOutput:
    if tier is not None:
        result.tier_saved, result.tier_loaded, result.tier_disabled = tier.saved, tier.loaded, tier.disabled
    return result
