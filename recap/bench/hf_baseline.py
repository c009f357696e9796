"""The external baseline: transformers' `generate` on the same checkpoint (AutoModelForCausalLM).

No cache is kept across requests: every request re-runs its whole prompt, one request at a time
(requests of a group run back to back; each TTFT is measured from that request's own start, so it
excludes queueing behind the others). TTFT is when `generate` hands its first new token to the
streamer; greedy unless the recipe says otherwise, exactly `max_tokens` new tokens (min_new_tokens).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from recap.bench.runners import CacheReport, ConfigSpec, RequestResult
from recap.bench.workloads import BenchRequest


class _FirstTokenClock:
    """A `generate` streamer: the first `put` is the prompt, the second the first new token."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.monotonic()

    def end(self) -> None:
        pass


class HFRunner:
    def __init__(self, spec: ConfigSpec, model_path: str, threads: int, pad_token_id: int = 0) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # the "falling back to the reference implementation" notes
        torch.set_num_threads(threads)
        self.spec = spec
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.pad_token_id = pad_token_id

    def warmup(self) -> None:
        self._generate(list(range(16, 64)), 2, 0.0)

    def _generate(self, prompt: Sequence[int], max_tokens: int, temperature: float) -> tuple[list[int], float]:
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        clock = _FirstTokenClock()
        kw: dict[str, Any] = {"do_sample": False}
        if temperature > 0:
            kw = {"do_sample": True, "temperature": temperature, "top_k": 0}
        t0 = time.monotonic()
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=self.pad_token_id,
                streamer=clock,
                **kw,
            )
        end = time.monotonic()
        ttft = (clock.first or end) - t0
        return out[0, ids.shape[1] :].tolist(), ttft

    def run(self, group: Sequence[BenchRequest], wave: int) -> list[RequestResult]:
        results = []
        for r in group:
            t0 = time.monotonic()
            output, ttft = self._generate(r.prompt, r.max_tokens, r.temperature)
            results.append(
                RequestResult(r.rid, r.session, r.step, wave, list(r.prompt), output, 0, ttft, time.monotonic() - t0)
            )
        return results

    def cache_report(self) -> CacheReport:
        return CacheReport()

    def close(self) -> None:
        del self.model
