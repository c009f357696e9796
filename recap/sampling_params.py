"""Sampling parameters of one request. Torch-free; validated on construction.

Names and meanings follow vLLM's SamplingParams. `n` has no upper bound here: the engine bounds it
(EngineConfig.max_n, `recap serve --max-n`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from recap.structured_output import StructuredOutput

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value
# Temperatures below this act as greedy (vLLM's _SAMPLING_EPS): dividing logits by a subnormal
# temperature overflows them to inf, and the softmax of that is NaN (the first token would be arbitrary).
SAMPLING_EPS = 1e-5
# The seed range vLLM's API takes (a signed 64-bit integer); recap's generators take the seed modulo 2**64,
# so a wider seed would silently draw the same stream as another one.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INT_FIELDS = ("n", "top_k", "min_tokens")
_OPTIONAL_INT_FIELDS = ("seed", "max_tokens", "logprobs", "prompt_logprobs")


def _as_int(name: str, value: object) -> int:
    """An integral value (numpy's too) as an int; a float (even 2.0) or a string is a TypeError naming the field."""
    if not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    return int(value)


def _bias_key(key: object) -> int:
    """A logit_bias key: a token id, or its decimal string (OpenAI's JSON keys are strings)."""
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    return _as_int("logit_bias keys", key)


def _as_float(name: str, value: object) -> float:
    """A real number as a float; NaN is a ValueError (a range check passes or fails it silently)."""
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got nan")
    return float(value)


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
    # The constraint applies after these token ids first appear in the output (a reasoning model's end of its
    # think block, vLLM's reasoning-aware structured output); (): from the first token.
    structured_outputs_after: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._normalize_types()
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
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be a signed 64-bit integer (in [-2**63, 2**63 - 1]), got {self.seed}")

    def _normalize_types(self) -> None:
        """Each field as the type the engine reads (vLLM's names and types). A wrong type is a TypeError naming
        the field, here, rather than a float top_k failing inside a batched step, a float max_tokens or n
        counting past itself, or a non-string stop never matching; None for stop / stop_token_ids is none."""

        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        for name in _FLOAT_FIELDS:
            put(name, _as_float(name, getattr(self, name)))
        for name in _INT_FIELDS:
            put(name, _as_int(name, getattr(self, name)))
        for name in _OPTIONAL_INT_FIELDS:
            if getattr(self, name) is not None:
                put(name, _as_int(name, getattr(self, name)))
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        bad = [s for s in stop if not isinstance(s, str)]
        if bad:
            raise TypeError(f"stop must be a string or a list of strings, got {type(bad[0]).__name__} {bad[0]!r}")
        put("stop", stop)
        put("stop_token_ids", tuple(_as_int("stop_token_ids", t) for t in self.stop_token_ids or ()))
        put("keep_special_token_ids", tuple(_as_int("keep_special_token_ids", t) for t in self.keep_special_token_ids))
        put("structured_outputs_after", tuple(_as_int("structured_outputs_after", t)
                                              for t in self.structured_outputs_after))
        if self.logit_bias is not None:
            bias = {_bias_key(k): _as_float(f"logit_bias[{k!r}]", v) for k, v in self.logit_bias.items()}
            put("logit_bias", bias or None)

    @property
    def greedy(self) -> bool:
        """Argmax sampling: temperature 0, or below SAMPLING_EPS (as vLLM)."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
        )
