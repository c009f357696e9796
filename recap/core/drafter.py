"""Drafters: what proposes the draft tokens a speculative decode step verifies (docs/speculative.md).

A drafter reads only a request's committed tokens (prompt + accepted outputs): a rejected draft never reaches
it, so nothing it keeps (the n-gram index) can hold one. Torch-free; a draft model or MTP heads are later
drafters behind the same protocol (they would propose from the runner's side of the step).
"""

from __future__ import annotations

from typing import Protocol

from recap.core.request import Request


class Drafter(Protocol):
    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that may follow the request's tokens ([] : nothing to propose)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request left the scheduler: drop what is kept for it."""
        ...


class _Index:
    """One request's n-gram index: n-gram -> end (exclusive) of its latest occurrence, over tokens[:upto]."""

    __slots__ = ("tokens", "ends", "upto")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}
        self.upto = 0  # n-grams ending at or before this end are indexed


def continuation(tokens: list[int], end: int, max_tokens: int) -> list[int]:
    """The tokens after position `end`, copied as LZ77 copies: where they run into the end of `tokens` the copy goes
    on from its own start, so a match close to the end proposes its repeating pattern (a run of one token
    proposes max_tokens of it, not 1)."""
    out: list[int] = []
    n = len(tokens)
    for j in range(end, end + max_tokens):
        out.append(tokens[j] if j < n else out[j - n])
    return out


class NgramDrafter:
    """Prompt lookup (vLLM's `ngram` method): find the longest n-gram (n from max down to min) that ends the
    request's tokens and occurred before; propose the tokens that followed its latest earlier occurrence
    (`continuation`).

    The index grows incrementally from the request's committed tokens: O(max_n - min_n + 1) dict updates per
    new token, one lookup per n per step.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, _Index] = {}

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = _Index()
        tokens = index.tokens
        have = len(tokens)
        tokens.extend(request.token_slice(have, request.num_tokens))  # committed tokens only ever grow
        assert len(tokens) == request.num_tokens, f"{request.request_id}: token count went down"
        self._extend(index, len(tokens) - 1)  # every end but the current one: a match must lie before it
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            end = index.ends.get(tuple(tokens[-n:]))
            if end is not None:
                return continuation(tokens, end, max_tokens)
        return []

    def _extend(self, index: _Index, upto: int) -> None:
        tokens, ends, lo, hi = index.tokens, index.ends, self.min_n, self.max_n
        for end in range(index.upto + 1, upto + 1):
            for n in range(lo, min(hi, end) + 1):
                ends[tuple(tokens[end - n : end])] = end
        index.upto = max(index.upto, upto)

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)


def ngram_propose_ref(tokens: list[int], min_n: int, max_n: int, max_tokens: int) -> list[int]:
    """Plain reference of NgramDrafter.propose: scan for the latest earlier occurrence of each suffix."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                period = tokens[end:]  # what followed the match; repeated where it runs out (periodic extension)
                return (period * (max_tokens // len(period) + 1))[:max_tokens]
    return []

