"""Chat prompts: the tokenizer's chat template, with each message end as a segment boundary.

One render finds every boundary (the cost is linear in the conversation, however many messages or
`cache_control` markers it has): the conversation is rendered once as is and once with a sentinel (a
private-use character pair around the message index) after each message's content; the sentinels'
places in the second text, minus the sentinels before them, are where each message's content ends in
the first. The token offset of a character position is the number of tokens lying wholly before it
(the tokenizer's offset mapping). A template that does not reproduce a content verbatim (the
sentinel-free text differs) falls back to finding each content in order in the text.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

_SENTINEL = re.compile("\ue000(\\d+)\ue001")

# (messages, add_generation_prompt, template variables) -> the rendered text. The default is the tokenizer's
# own template; a server renders a client's template elsewhere (recap.server.template_sandbox).
Renderer = Callable[[list[dict[str, Any]], bool, dict[str, Any]], str]


class RenderLimitExceeded(ValueError):
    """A renderer's resource limit (time, memory, output size) was hit: not a verdict on the messages, so the
    sentinel probe does not fall back on it but fails the render."""


def tokenizer_renderer(tokenizer: Any) -> Renderer:
    def render(messages: list[dict[str, Any]], add_generation_prompt: bool, variables: dict[str, Any]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **variables)

    return render


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    token_ids: list[int]
    # Token offsets where messages end (DESIGN §4 segment boundaries), ascending, < len(token_ids).
    segment_boundaries: tuple[int, ...]
    # Per message, the character span of its content in `text`; None where the template does not show it.
    content_spans: tuple[tuple[int, int] | None, ...] = ()
    # Character end of each token (non-decreasing), for `tokens_before`.
    token_ends: tuple[int, ...] = field(default=(), repr=False)

    def tokens_before(self, char_end: int) -> int:
        """Tokens of `token_ids` that lie wholly inside text[:char_end]."""
        return bisect.bisect_right(self.token_ends, char_end)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _encode_with_ends(tokenizer: Any, text: str) -> tuple[list[int], tuple[int, ...]]:
    """Token ids of `text` and the character end of each (a slow tokenizer without offsets: per-token decode)."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, ends = list(enc["input_ids"]), [e for _, e in enc["offset_mapping"]]
    else:
        ids = tokenizer.encode(text, add_special_tokens=False)
        ends, pos = [], 0
        for tid in ids:  # approximate: decoded pieces in order
            piece = tokenizer.decode([tid])
            found = text.find(piece, pos) if piece else pos
            pos = found + len(piece) if found >= 0 else pos
            ends.append(pos)
    return ids, tuple(itertools.accumulate(ends, max))


def _content_spans(
    render: Renderer, messages: Sequence[dict[str, Any]], text: str, gen: bool, kw: dict[str, Any]
) -> list[tuple[int, int] | None]:
    contents = [m.get("content") if isinstance(m.get("content"), str) else None for m in messages]
    marked = [dict(m, content=c + f"\ue000{i}\ue001") if c is not None else m
              for i, (m, c) in enumerate(zip(messages, contents))]
    spans: list[tuple[int, int] | None] = [None] * len(messages)
    try:
        probe = render(marked, gen, kw)
    except RenderLimitExceeded:
        raise
    except Exception:  # noqa: BLE001 - a template that rejects the sentinel: find the contents instead
        probe = None
    if probe is not None and _SENTINEL.sub("", probe) == text:
        removed = 0
        for m in _SENTINEL.finditer(probe):
            i, end = int(m.group(1)), m.start() - removed
            removed += len(m.group(0))
            c = contents[i] if i < len(contents) else None
            if c is not None and spans[i] is None and text.startswith(c, end - len(c)):
                spans[i] = (end - len(c), end)
        return spans
    pos = 0
    for i, c in enumerate(contents):
        start = text.find(c, pos) if c else -1
        if start >= 0:
            spans[i] = (start, start + len(c))
            pos = start + len(c)
    return spans


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    render: Renderer | None = None,
    continue_final_message: bool = False,
) -> ChatPrompt:
    """Render messages with the chat template (`render`: another renderer than the tokenizer's template);
    boundaries are where each message's content ends. `continue_final_message`: the text ends with the final
    message's content, left open for the model to continue (an assistant turn the client prefilled), as
    transformers' apply_chat_template cuts it; ValueError with add_generation_prompt, or where the template does
    not show that content."""
    if not messages:
        raise ValueError("messages must not be empty")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    kw = dict(template_kwargs or {})
    render = render or tokenizer_renderer(tokenizer)
    text = render(list(messages), add_generation_prompt, kw)
    spans = _content_spans(render, messages, text, add_generation_prompt, kw)
    if continue_final_message:
        text = continued_text(render, messages, kw)
        spans = [s if s is None or s[1] <= len(text) else None for s in spans]
    ids, ends = _encode_with_ends(tokenizer, text)
    bounds: list[int] = []
    for span in spans:
        b = bisect.bisect_right(ends, span[1]) if span is not None else 0
        if 0 < b < len(ids) and (not bounds or b > bounds[-1]):
            bounds.append(b)
    return ChatPrompt(text=text, token_ids=ids, segment_boundaries=tuple(bounds), content_spans=tuple(spans),
                      token_ends=ends)


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' own tag, so a template sees the text it would


def continued_text(render: Renderer, messages: Sequence[dict[str, Any]], kw: dict[str, Any]) -> str:
    """The conversation rendered without a generation prompt and cut where the final message's text ends, open for
    the model to continue it: as transformers' apply_chat_template(continue_final_message=True) does (the text
    rendered with a tag after that message's text, or after its last text part, cut at the tag; before any spacing
    the template trimmed there), so the prompt's ids are the ones vLLM sends. ValueError where the message has no
    text or the template does not show it."""
    *head, final = messages
    content = final.get("content")
    tagged = dict(final)
    if isinstance(content, str):
        tagged["content"] = content + _CONTINUE_TAG
    elif isinstance(content, (list, tuple)) and any(isinstance(p, dict) and "text" in p for p in content):
        parts = [dict(p) if isinstance(p, dict) else p for p in content]
        last = max(i for i, p in enumerate(parts) if isinstance(p, dict) and "text" in p)
        parts[last]["text"] = str(parts[last]["text"]) + _CONTINUE_TAG
        content, tagged["content"] = parts[last]["text"][: -len(_CONTINUE_TAG)], parts
    else:
        raise ValueError("continue_final_message: the final message has no text to continue")
    text = render([*head, tagged], False, kw)
    tag = _CONTINUE_TAG.strip()
    if str(content).strip() not in text or tag not in text:
        raise ValueError("continue_final_message: the chat template does not reproduce the final message's content, "
                         "so there is no place to continue it from")
    at = text.rindex(tag)
    return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()


def render_chat_reference(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> ChatPrompt:
    """The plain form of render_chat (one render and one encode per message: quadratic), for tests.

    Message i's content ends where its last occurrence ends in the rendering of messages[:i+1];
    its boundary is the longest token prefix shared by that text's encoding and the whole prompt's.
    """
    kw = dict(template_kwargs or {})
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **kw)
    ids = tokenizer.encode(text, add_special_tokens=False)
    bounds: list[int] = []
    spans: list[tuple[int, int] | None] = []
    for i, m in enumerate(messages):
        part = tokenizer.apply_chat_template(list(messages[: i + 1]), tokenize=False, add_generation_prompt=False,
                                             **kw)
        c = m.get("content")
        start = part.rfind(c) if isinstance(c, str) and text.startswith(part) else -1
        spans.append(None if start < 0 else (start, start + len(c)))
        if start < 0:
            continue
        b = common_prefix(tokenizer.encode(text[: start + len(c)], add_special_tokens=False), ids)
        if 0 < b < len(ids) and (not bounds or b > bounds[-1]):
            bounds.append(b)
    return ChatPrompt(text=text, token_ids=ids, segment_boundaries=tuple(bounds), content_spans=tuple(spans))
