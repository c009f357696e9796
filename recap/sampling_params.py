"""Sampling parameters of one request. Torch-free; validated on construction.

Names and meanings follow vLLM's SamplingParams. `n` has no upper bound here: the engine bounds it
(EngineConfig.max_n, `recap serve --max-n`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recap.structured_output import StructuredOutput

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value
# Temperatures below this act as greedy (vLLM's _SAMPLING_EPS): dividing logits by a subnormal
# temperature overflows them to inf, and the softmax of that is NaN (the first token would be arbitrary).
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    # Penalties (vLLM semantics): presence/frequency over the generated tokens, subtracted from the
    # logits; repetition over prompt and generated tokens, dividing positive logits and multiplying
    # negative ones. 0, 0 and 1 are off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    max_tokens: int | None = 16  # None: up to the model length
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0: only the sampled one)
    # Logprobs of every prompt token (the first has none) with this many top alternatives; such a
    # request computes its whole prompt (no prefix-cache hit), as in vLLM.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Special tokens whose text stays although skip_special_tokens: a tool parser's call markers, which
    # some tokenizers mark special (the parser must see them; everything else special is still skipped).
    keep_special_token_ids: tuple[int, ...] = ()
    # The output must match this (a JSON schema, regex, choice or grammar; recap/structured_output.py).
    structured_outputs: StructuredOutput | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "keep_special_token_ids", tuple(int(t) for t in self.keep_special_token_ids))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()} or None)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        for tok, bias in (self.logit_bias or {}).items():
            if tok < 0:
                raise ValueError(f"logit_bias: token id {tok} is negative")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias: the bias of token {tok} must be in [-100, 100], got {bias}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        """Argmax sampling: temperature 0, or below SAMPLING_EPS (as vLLM)."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias))
