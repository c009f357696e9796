"""Prompts as vLLM's offline API takes them: a string, a list of token ids, {"prompt": str},
{"prompt_token_ids": [...]}, or a list of any of these. A dict may also carry `cache_salt`; any
other key is an error naming it (a dict is never read as a sequence of its keys)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from recap.engine.errors import InvalidRequestError

_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


@dataclass(frozen=True)
class ParsedPrompt:
    prompt: str | list[int]
    cache_salt: str | None = None


def _is_token_ids(x: Any) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, str) and bool(x) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


def _one(p: Any, where: str) -> ParsedPrompt:
    if isinstance(p, str):
        return ParsedPrompt(p)
    if _is_token_ids(p):
        return ParsedPrompt(list(p))
    if isinstance(p, Mapping):
        unknown = sorted(set(p) - _KEYS)
        if unknown:
            raise InvalidRequestError(f"{where}: unsupported prompt key(s) {unknown} (recap takes {sorted(_KEYS)})")
        has_text, has_ids = "prompt" in p, "prompt_token_ids" in p
        if has_text == has_ids:
            raise InvalidRequestError(f"{where}: give exactly one of 'prompt' and 'prompt_token_ids'")
        salt = p.get("cache_salt")
        if has_text:
            if not isinstance(p["prompt"], str):
                raise InvalidRequestError(f"{where}: 'prompt' must be a string")
            return ParsedPrompt(p["prompt"], salt)
        if not _is_token_ids(p["prompt_token_ids"]):
            raise InvalidRequestError(f"{where}: 'prompt_token_ids' must be a non-empty list of integers")
        return ParsedPrompt(list(p["prompt_token_ids"]), salt)
    raise InvalidRequestError(f"{where}: a prompt is a string, a list of token ids or a dict with 'prompt' or "
                              f"'prompt_token_ids', got {type(p).__name__}")


def parse_prompts(prompts: Any) -> list[ParsedPrompt]:
    """One entry per prompt; a single prompt is a batch of one."""
    if isinstance(prompts, (str, Mapping)) or _is_token_ids(prompts):
        return [_one(prompts, "prompt")]
    if not isinstance(prompts, Sequence) or not prompts:
        raise InvalidRequestError("prompts must be a prompt or a non-empty list of prompts")
    return [_one(p, f"prompt {i}") for i, p in enumerate(prompts)]
