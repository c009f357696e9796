"""Incremental detokenization with stop strings.

Decoding one token at a time and concatenating breaks multi-byte characters (a byte-level BPE
splits them across tokens), so text is released only once the decoded tail is no longer an
incomplete UTF-8 sequence (U+FFFD). For streaming, the last `max(len(stop)) - 1` characters are
held back until they can no longer begin a stop string.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from recap.sampling_params import SamplingParams

Decode = Callable[[list[int], bool], str]  # (ids, skip_special_tokens) -> text: one tokenizer's decode

# Tokens of context re-decoded with each new token, so merges across the boundary render right.
_CONTEXT_TOKENS = 6


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids `decode(..., skip_special_tokens=True)` drops: the named special tokens and added tokens
    marked special."""
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return frozenset(ids)


def tokenizer_decode(tokenizer: Any) -> Decode:
    """`tokenizer.decode(ids, skip_special_tokens=...)` of one list of ids. Where that call comes down to the Rust
    tokenizer's own decode (a transformers fast tokenizer with the stock decode that cleans up no spaces), the
    Rust decode is called directly: transformers' wrapper (argument conversion and checks) is about two thirds of
    a call, and the engine decodes twice per new token of every request (IncrementalDetokenizer.add)."""

    def reference(ids: list[int], skip: bool) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip)

    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return reference
    cls = type(tokenizer)
    stock = (isinstance(tokenizer, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
             and cls._decode is TokenizersBackend._decode)  # fmt: skip
    if not stock or tokenizer.clean_up_tokenization_spaces:
        return reference
    backend = tokenizer.backend_tokenizer

    def rust(ids: list[int], skip: bool) -> str:
        return backend.decode(ids, skip_special_tokens=skip)

    return rust


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, params: SamplingParams, decode: Decode | None = None) -> None:
        """`decode`: the tokenizer's decode (tokenizer_decode(tokenizer) where None; the engine makes it once)."""
        self.tokenizer = tokenizer
        self._decode_ids = tokenizer_decode(tokenizer) if decode is None else decode
        self.params = params
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._sent = 0  # characters of `text` already released as deltas
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self.stopped = False  # a stop string matched; text is truncated
        self.stop_str: str | None = None
        # skipped by hand when some special tokens must stay (tokenizers skip all or none)
        self._drop: frozenset[int] | None = None
        if params.skip_special_tokens and params.keep_special_token_ids:
            self._drop = special_token_ids(tokenizer) - set(params.keep_special_token_ids)

    def _decode(self, ids: list[int]) -> str:
        if self._drop is not None:
            return self._decode_ids([i for i in ids if i not in self._drop], False)
        return self._decode_ids(ids, self.params.skip_special_tokens)

    def add(self, new_ids: list[int]) -> bool:
        """Append tokens; returns True when a stop string ended the text."""
        for tok in new_ids:
            if self.stopped:
                break
            self.token_ids.append(tok)
            prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
            full = self._decode(self.token_ids[self._prefix_offset :])
            if full.endswith("\ufffd") or len(full) <= len(prefix):
                continue  # incomplete character: wait for more tokens
            start = len(self.text)
            self.text += full[len(prefix) :]
            self._prefix_offset = max(0, len(self.token_ids) - _CONTEXT_TOKENS)
            self._prefix_offset = min(self._prefix_offset, self._read_offset)
            self._read_offset = len(self.token_ids)
            self._check_stop(start)
        return self.stopped

    def _check_stop(self, new_from: int) -> None:
        if not self.params.stop:
            return
        lo = max(0, new_from - self._hold)
        best: tuple[int, str] | None = None
        for s in self.params.stop:
            i = self.text.find(s, lo)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[: i + len(s)] if self.params.include_stop_str_in_output else self.text[:i]
            self.stopped = True
            self.stop_str = s

    def flush(self) -> None:
        """At the end, release whatever decoded text is still pending (e.g. a trailing partial char)."""
        if self.stopped:
            return
        tail = self._decode(self.token_ids[self._prefix_offset :])
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        if len(tail) > len(prefix):
            self.text += tail[len(prefix) :]
            self._read_offset = len(self.token_ids)

    def take_delta(self, finished: bool) -> str:
        """Text not yet released; while running, keep back what could still start a stop string."""
        end = len(self.text) if (finished or self.stopped) else max(self._sent, len(self.text) - self._hold)
        delta = self.text[self._sent : end]
        self._sent = end
        return delta
