"""Structured output on the runner: one llguidance matcher per request, fed the request's generated
tokens, giving the mask of tokens the grammar allows next."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from recap.structured_output import StructuredOutput

log = logging.getLogger("recap.runner")


class GrammarBackend:
    """Builds matchers over the engine's tokenizer (the llguidance tokenizer is built once, lazily)."""

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(eos_token_ids)
        self._lltok: Any = None
        self._matchers: dict[str, tuple[Any, int]] = {}  # request id -> (matcher, tokens consumed)

    def _ll_tokenizer(self) -> Any:
        if self._lltok is None:
            import llguidance.hf

            self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, eos_token=self.eos_token_ids or None)
        return self._lltok

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def allowed(
        self, request_id: str, so: StructuredOutput, output_ids: Sequence[int], vocab: int
    ) -> torch.Tensor | None:
        """Bool mask [vocab] of the tokens the grammar allows after `output_ids`; None (unconstrained, logged)
        if the matcher broke (it cannot when every token came from its mask: the engine must not die of it)."""
        from llguidance import LLMatcher

        entry = self._matchers.get(request_id)
        if entry is None:
            entry = (LLMatcher(self._ll_tokenizer(), so.grammar(), log_level=0), 0)
        matcher, consumed = entry
        if len(output_ids) > consumed:
            matcher.consume_tokens(list(output_ids[consumed:]))
        self._matchers[request_id] = (matcher, len(output_ids))
        if matcher.is_error():
            log.warning("structured output of %s left unconstrained: %s", request_id, matcher.get_error())
            return None
        return bitmask_to_bool(matcher.compute_bitmask(), vocab)


def bitmask_to_bool(bitmask: bytes, vocab: int) -> torch.Tensor:
    """llguidance's bitmask (little-endian 32-bit words, token t = bit t of the stream) -> bool [vocab];
    ids past the mask (model vocab larger than the tokenizer's) are not allowed."""
    raw = torch.frombuffer(bytearray(bitmask), dtype=torch.uint8)
    bits = ((raw.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten().bool()
    out = torch.zeros(vocab, dtype=torch.bool)
    n = min(vocab, bits.numel())
    out[:n] = bits[:n]
    return out
