"""Chat prompts: the tokenizer's chat template, with each message end as a segment boundary."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    token_ids: list[int]
    # Token offsets where messages end (DESIGN §4 segment boundaries), ascending, < len(token_ids).
    segment_boundaries: tuple[int, ...]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> ChatPrompt:
    """Render messages with the chat template; boundaries are where each message's text ends.

    A boundary is the longest token prefix shared with the rendering of the messages up to that
    one, so a BPE merge across a message end can only move it earlier, never past shared tokens.
    """
    if not messages:
        raise ValueError("messages must not be empty")
    kw = dict(template_kwargs or {})
    text = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **kw
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    bounds: list[int] = []
    for i in range(1, len(messages) + 1):
        part = tokenizer.apply_chat_template(list(messages[:i]), tokenize=False, add_generation_prompt=False, **kw)
        if not text.startswith(part):
            continue
        b = common_prefix(tokenizer.encode(part, add_special_tokens=False), ids)
        if 0 < b < len(ids) and (not bounds or b > bounds[-1]):
            bounds.append(b)
    return ChatPrompt(text=text, token_ids=ids, segment_boundaries=tuple(bounds))
