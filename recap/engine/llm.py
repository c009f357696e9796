"""The offline API: `LLM(model).generate(prompts, params)` and `LLM.chat(messages)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from recap.config import CacheConfig, SchedulerConfig
from recap.engine.chat import render_chat
from recap.engine.config import EngineConfig
from recap.engine.llm_engine import LLMEngine
from recap.engine.outputs import RequestOutput
from recap.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "float32",
        quantization: str | None = None,
        seed: int = 0,
        enable_prefix_caching: bool = True,
        checkpoint_policy: str = "recap",
        checkpoint_interval: int | None = None,
        block_size: int = 16,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 32,
        max_model_len: int = 4096,
        kv_cache_bytes: int | None = None,
        state_cache_bytes: int | None = None,
        check_integrity: bool = False,
        num_threads: int | None = None,
    ) -> None:
        self.engine = LLMEngine(
            EngineConfig(
                model=model,
                tokenizer=tokenizer,
                dtype=dtype,
                quantization=quantization,
                seed=seed,
                cache=CacheConfig(
                    block_size=block_size,
                    enable_prefix_caching=enable_prefix_caching,
                    checkpoint_policy=checkpoint_policy,
                    checkpoint_interval=checkpoint_interval,
                    kv_cache_bytes=kv_cache_bytes,
                    state_cache_bytes=state_cache_bytes,
                ),
                scheduler=SchedulerConfig(
                    max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens,
                    max_model_len=max_model_len,
                ),
                check_integrity=check_integrity,
                num_threads=num_threads,
            )
        )

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

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
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = sampling_params if sampling_params is not None else SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        bounds = list(segment_boundaries) if segment_boundaries is not None else [()] * len(prompts)
        prepared = [
            self.engine.prepare(p, sp, segment_boundaries=b, cache_salt=cache_salt)
            for p, sp, b in zip(prompts, plist, bounds)
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
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the chat template; each message end becomes a segment boundary (DESIGN §4)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        rendered = [render_chat(self.engine.tokenizer, c, template_kwargs=chat_template_kwargs) for c in convs]
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
