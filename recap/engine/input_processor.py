"""Turns user input into validated core Requests: tokenization, limits, token-id checks."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from recap.core.request import Request
from recap.engine.errors import InvalidRequestError
from recap.sampling_params import SamplingParams


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    segment_boundaries: tuple[int, ...]
    cache_salt: str | None
    arrival_time: float
    # Disaggregation (recap.disagg): None, or how the prompt's KV moves between instances.
    kv_transfer: Any = None


def can_speculate(params: SamplingParams) -> bool:
    """Whether the verifier reproduces this request's sampler at every draft position (runner/speculative.py):
    greedy or sampled, with penalties, logit bias and min_tokens applied per position as the plain sampler would.
    A grammar (its matcher would have to walk the drafts) and logprobs (reported per emitted token) are not
    handled yet: such requests decode without drafts."""
    return params.structured_outputs is None and params.logprobs is None


def _fork_seed(seed: int, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def all_plain_ints_ref(ids: Sequence[object]) -> bool:
    """Whether every id is an int and none a bool (the reference of all_plain_ints)."""
    return all(isinstance(t, int) and not isinstance(t, bool) for t in ids)


def all_plain_ints(ids: Sequence[object]) -> bool:
    """all_plain_ints_ref in one pass in C when every id is exactly an int (the usual prompt: ~8x cheaper, ~1 ms
    on a 32k-token prompt otherwise); other types (int subclasses, anything else) take the reference."""
    return set(map(type, ids)) <= {int} or all_plain_ints_ref(ids)


class InputProcessor:
    """Read-only over the tokenizer and limits, so any thread may call it."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int], max_n: int = 16
    ) -> None:
        self.tokenizer = tokenizer
        self.max_n = max_n
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids

    def tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty")
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if isinstance(prompt, (bytes, bytearray)):
            raise InvalidRequestError("prompt must be a string or a list of token ids")
        ids = list(prompt)
        if not all_plain_ints(ids):
            raise InvalidRequestError("prompt token ids must be integers")
        return None, ids

    def prepare(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        segment_boundaries: Sequence[int] = (),
        cache_salt: str | None = None,
        arrival_time: float,
        fit_max_tokens: bool = False,
    ) -> PreparedRequest:
        """`fit_max_tokens`: params.max_tokens is a default the client did not send (the model's
        generation_config, or the API's own default): a prompt that leaves less room than it caps it at the room,
        as vLLM does, instead of refusing a length the client never asked for."""
        if params.n > self.max_n:
            raise InvalidRequestError(
                f"n: {params.n} choices asked, at most {self.max_n} are allowed (--max-n)"
            )
        text, ids = self.tokenize(prompt)
        if not ids:
            raise InvalidRequestError("prompt has no tokens")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is out of vocabulary (vocab size {self.vocab_size})")
        max_tokens = self._length(len(ids), params, fit_max_tokens)
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise InvalidRequestError(f"stop token id {bad_stop[0]} is out of vocabulary")
        bad_bias = [t for t in params.logit_bias or () if not 0 <= t < self.vocab_size]
        if bad_bias:
            raise InvalidRequestError(f"logit_bias: token id {bad_bias[0]} is out of vocabulary")
        bounds = sorted({int(b) for b in segment_boundaries if 0 < int(b) < len(ids)})
        if params.structured_outputs is not None:
            try:
                params.structured_outputs.check()
            except ValueError as e:
                raise InvalidRequestError(str(e)) from None
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError("cache_salt must be a string")
        return PreparedRequest(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=ids,
            params=params,
            max_tokens=max_tokens,
            segment_boundaries=tuple(bounds),
            cache_salt=cache_salt,
            arrival_time=arrival_time,
        )

    def _length(self, prompt_len: int, params: SamplingParams, fit: bool) -> int:
        """The tokens the request may generate: its max_tokens checked against the room its prompt leaves (unset:
        all of that room); `fit`: a default the client did not send, capped at that room (vLLM's) instead of
        refused."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise InvalidRequestError(
                f"prompt has {prompt_len} tokens; this model's maximum context length is {self.max_model_len} "
                "and at least one token must be generated"
            )
        max_tokens = params.max_tokens
        if fit and max_tokens is not None:
            max_tokens = min(max_tokens, room)
        if max_tokens is not None and max_tokens > room:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; you requested "
                f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} for the completion)"
            )
        if params.min_tokens > (max_tokens or room):
            raise InvalidRequestError("min_tokens must not exceed max_tokens")
        return max_tokens or room

    def make_core_request(self, p: PreparedRequest, child_id: str, index: int) -> Request:
        params = p.params
        if params.seed is not None and index > 0:
            # Each fork of a seeded request draws its own reproducible stream.
            params = dataclasses.replace(params, seed=_fork_seed(params.seed, index))
        return Request(
            request_id=child_id,
            prompt_token_ids=list(p.prompt_token_ids),
            max_tokens=p.max_tokens,
            eos_token_ids=frozenset() if p.params.ignore_eos else self.eos_token_ids,
            stop_token_ids=frozenset(p.params.stop_token_ids),
            min_tokens=p.params.min_tokens,
            segment_boundaries=p.segment_boundaries,
            cache_salt=p.cache_salt,
            sampling_params=params,
            arrival_time=p.arrival_time,
            prompt_logprobs=p.params.prompt_logprobs is not None and index == 0,
            speculate=can_speculate(p.params),
            host_tokens=params.has_penalties or params.structured_outputs is not None,
        )
