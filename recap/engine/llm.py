"""The offline API: `LLM(model).generate(prompts, params)` and `LLM.chat(messages)`, with vLLM's
keyword names. Keywords vLLM has for hardware recap does not drive (tensor parallelism, GPU memory,
CUDA graphs) are accepted at the values that mean "one CPU process" and refused otherwise."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from recap.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from recap.engine.chat import render_chat
from recap.engine.config import EngineConfig
from recap.engine.llm_engine import LLMEngine
from recap.engine.outputs import RequestOutput
from recap.engine.prompts import parse_prompts
from recap.engine.vllm_compat import checkpoint_policy_for, resolve_dtype
from recap.model.quant import QUANTIZATIONS
from recap.sampling_params import SamplingParams

log = logging.getLogger("recap")
Prompt = str | Sequence[int] | dict[str, Any]


def _check_hardware(tensor_parallel_size: int, pipeline_parallel_size: int, quantization: str | None,
                    tokenizer_mode: str, gpu_memory_utilization: float) -> None:
    if tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size must be 1 (recap runs one CPU process), got {tensor_parallel_size}")
    if pipeline_parallel_size != 1:
        raise ValueError(f"pipeline_parallel_size must be 1 (recap runs one CPU process), got {pipeline_parallel_size}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization is not supported for {quantization!r} (recap offers {QUANTIZATIONS} or None)")
    if tokenizer_mode not in ("auto", "hf"):
        raise ValueError(f"tokenizer_mode must be 'auto' (the folder's Hugging Face tokenizer), got {tokenizer_mode!r}")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")


class LLM:
    """vLLM's offline entry point. `device`: "auto" (CUDA when torch sees a GPU, else the CPU), "cpu" or
    "cuda[:N]"; `kernels`: "auto" (Triton on a GPU, torch's on a CPU), "torch" or "triton".
    `gpu_memory_utilization`: on a GPU, the share of its memory the process may hold (the pools take what the
    weights leave; kv_cache_bytes / state_cache_bytes fix them instead); `memory_limit_bytes`: on a CPU, the memory
    the process may hold in all (default: measured, recap/runner/host_memory.py): a model whose weights, pools and
    runtime do not fit raises MemoryPlanError (before loading the weights where their size alone is too much);
    `enforce_eager` keeps torch's kernels only (no native decode kernels, as vLLM's flag turns off CUDA graphs);
    `trust_remote_code` has no effect (recap runs only its own implementations of the architectures it supports,
    never code from a checkpoint).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        seed: int | None = 0,
        enable_prefix_caching: bool = True,
        checkpoint_policy: str | None = None,
        mamba_cache_mode: str | None = None,
        checkpoint_interval: int | None = None,
        block_size: int = 16,
        max_num_batched_tokens: int = 2048, max_num_seqs: int = 32,
        async_scheduling: bool = False,  # vLLM's: the next step is scheduled while the current one runs
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = None, state_cache_bytes: int | None = None,
        cache_dir: str | None = None,  # the disk tier (docs/tiers.md): checkpoints and KV blocks spill there
        cache_disk_bytes: int | None = None,
        cache_host_bytes: int | None = None,  # the host-memory tier between the read pools and the disk tier
        check_integrity: bool = False,
        num_threads: int | None = None,
        max_n: int = 16,
        generation_config: str = "auto",
        device: str = "auto",
        kernels: str = "auto",
        gpu_memory_utilization: float = 0.9,
        memory_limit_bytes: int | None = None,
        speculative_config: dict[str, Any] | str | None = None,  # vLLM's: {"method": "ngram", ...}
        # vLLM's names for what one recap process has no use for: accepted at their neutral values.
        tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
        enforce_eager: bool = False,
        trust_remote_code: bool = False,
        quantization: str | None = None,  # None, "int8" (model/quant.py), "int4" or "int4_k" (super-blocks)
        head_quantization: str = "auto",  # the output head's precision under it: "auto" (int8), "int8", "same"
        quantization_imatrix: str | None = None,  # an importance matrix for the int4 fits (`recap imatrix`)
        tokenizer_mode: str = "auto",
        disable_log_stats: bool = True,
    ) -> None:
        _check_hardware(tensor_parallel_size, pipeline_parallel_size, quantization, tokenizer_mode,
                        gpu_memory_utilization)
        del trust_remote_code, disable_log_stats  # no effect, see the class docstring
        cache = CacheConfig(
            block_size=block_size, enable_prefix_caching=enable_prefix_caching,
            checkpoint_policy=checkpoint_policy_for(checkpoint_policy, mamba_cache_mode),
            checkpoint_interval=checkpoint_interval, kv_cache_bytes=kv_cache_bytes, state_cache_bytes=state_cache_bytes,
            cache_dir=cache_dir, cache_disk_bytes=cache_disk_bytes, cache_host_bytes=cache_host_bytes,
        )  # fmt: skip
        scheduler = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len or SchedulerConfig().max_model_len, async_scheduling=async_scheduling,
        )  # fmt: skip
        self.engine = LLMEngine(EngineConfig(
            model=model, tokenizer=tokenizer, dtype=resolve_dtype(dtype, device), quantization=quantization,
            native_decode=not enforce_eager, device=device, kernels=kernels, head_quantization=head_quantization,
            quantization_imatrix=quantization_imatrix, gpu_memory_utilization=gpu_memory_utilization,
            memory_limit_bytes=memory_limit_bytes, seed=0 if seed is None else seed, cache=cache, scheduler=scheduler,
            check_integrity=check_integrity, num_threads=num_threads, max_n=max_n, generation_config=generation_config,
            derive_max_model_len=max_model_len is None,
            speculative=SpeculativeConfig.parse(speculative_config),
        ))  # fmt: skip

    def close(self) -> None:
        """Flush the disk tier's writes (a new LLM on the same cache_dir then finds every entry)."""
        self.engine.close()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's method)."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        segment_boundaries: Sequence[Sequence[int]] | None = None,
        cache_salt: str | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        parsed = parse_prompts(prompts)
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(parsed)
        if len(plist) != len(parsed):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        bounds = list(segment_boundaries) if segment_boundaries is not None else [()] * len(parsed)
        prepared = [
            self.engine.prepare(p.prompt, sp, segment_boundaries=b,
                                cache_salt=p.cache_salt if p.cache_salt is not None else cache_salt)
            for p, sp, b in zip(parsed, plist, bounds)
        ]
        for p in prepared:
            self.engine.add_prepared(p)
        return self._run([p.request_id for p in prepared], use_tqdm)
    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the chat template (or `chat_template`, with `tools` rendered by it, as vLLM's LLM.chat);
        each message end becomes a segment boundary (docs/design.md §4). `continue_final_message` (with
        `add_generation_prompt` False) leaves the final message open for the model to continue, as vLLM's."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kw = dict(chat_template_kwargs or {})
        if chat_template is not None:
            kw["chat_template"] = chat_template
        if tools is not None:
            kw["tools"] = list(tools)
        flags = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
        rendered = [render_chat(self.engine.tokenizer, c, template_kwargs=kw, **flags) for c in convs]
        return self.generate(
            [r.token_ids for r in rendered],
            sampling_params,
            segment_boundaries=[r.segment_boundaries for r in rendered],
            cache_salt=cache_salt,
            use_tqdm=use_tqdm,
        )

    def _run(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), disable=not use_tqdm, desc="generate")
        idle = 0
        while self.engine.has_unfinished_requests():
            outs = self.engine.step()
            idle = 0 if outs else idle + 1
            if idle > 10_000:
                raise RuntimeError("engine made no progress in 10,000 steps (scheduler stall)")
            for out in outs:
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[r] for r in order]
