"""Structured output on the runner: one llguidance matcher per request, fed the request's generated
tokens, giving the mask of tokens the grammar allows next."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from recap.structured_output import StructuredOutput, short_error

log = logging.getLogger("recap.runner")


class GrammarFailed(Exception):
    """A request's matcher cannot go on (llguidance's row or lexer limits): the request ends with an error."""


class GrammarBackend:
    """Builds matchers over the engine's tokenizer (the llguidance tokenizer is built once, lazily)."""

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(eos_token_ids)
        self._lltok: Any = None
        self._matchers: dict[str, tuple[Any, int]] = {}  # request id -> (matcher, tokens consumed)
        # request id -> where its constraint starts in its output (structured_outputs_after), once found, or
        # how far the search got (negative: -searched), so that each step reads only the new tokens
        self._starts: dict[str, int] = {}

    def _ll_tokenizer(self) -> Any:
        if self._lltok is None:
            import llguidance.hf

            self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, eos_token=self.eos_token_ids or None)
        return self._lltok

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._starts.pop(request_id, None)

    def start(self, request_id: str, after: Sequence[int], output_ids: Sequence[int]) -> int | None:
        """Where the constraint starts in `output_ids`: just past the first `after` (0 when `after` is
        empty); None while it has not appeared (the output is still free: a think block)."""
        if not after:
            return 0
        known = self._starts.get(request_id, 0)
        if known > 0:
            return known
        n = len(after)
        first = max(0, -known - n + 1)  # an occurrence may straddle what was searched and the new tokens
        for i in range(first, len(output_ids) - n + 1):
            if tuple(output_ids[i:i + n]) == tuple(after):
                self._starts[request_id] = i + n
                return i + n
        self._starts[request_id] = -len(output_ids) if output_ids else 0
        return None

    def _matcher(self, request_id: str, so: StructuredOutput) -> tuple[Any, int]:
        entry = self._matchers.get(request_id)
        if entry is None:
            from llguidance import LLMatcher, LLParserLimits

            try:
                grammar = so.compiled()
            except ValueError as e:
                raise GrammarFailed(str(e)) from None
            # verbose_errors off: an error names the limit, not the whole grammar and parser state
            entry = (LLMatcher(self._ll_tokenizer(), grammar, log_level=0,
                               limits=LLParserLimits(verbose_errors=False)), 0)
        return entry

    def allowed(
        self, request_id: str, so: StructuredOutput, output_ids: Sequence[int], vocab: int
    ) -> torch.Tensor:
        """Bool mask [vocab] of the tokens the grammar allows after `output_ids`. Raises GrammarFailed (logged
        here, once: the engine then ends the request) when the matcher cannot be built or goes past a limit."""
        try:
            matcher, consumed = self._matcher(request_id, so)
            # a stopped matcher (its grammar complete, EOS consumed) keeps allowing EOS and takes no more tokens:
            # what ignore_eos draws after the end is no error
            if len(output_ids) > consumed and not matcher.is_stopped():
                matcher.consume_tokens(list(output_ids[consumed:]))
            self._matchers[request_id] = (matcher, len(output_ids))
            mask = None if matcher.is_error() else matcher.compute_bitmask()
            if matcher.is_error():
                raise GrammarFailed(f"structured output failed: {short_error(matcher.get_error())}")
        except GrammarFailed as e:
            self._matchers.pop(request_id, None)
            log.warning("request %s: %s (%s, %d tokens in); it ends with an error", request_id, e, so.kind,
                        len(output_ids))
            raise
        return bitmask_to_bool(mask, vocab)


def bitmask_to_bool(bitmask: bytes, vocab: int) -> torch.Tensor:
    """llguidance's bitmask (little-endian 32-bit words, token t = bit t of the stream) -> bool [vocab];
    ids past the mask (model vocab larger than the tokenizer's) are not allowed."""
    raw = torch.frombuffer(bytearray(bitmask), dtype=torch.uint8)
    bits = ((raw.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten().bool()
    out = torch.zeros(vocab, dtype=torch.bool)
    n = min(vocab, bits.numel())
    out[:n] = bits[:n]
    return out
