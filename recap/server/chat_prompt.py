"""Chat messages -> prompt token ids + segment boundaries (DESIGN §4).

Every message end is a boundary (render_chat). `cache_control` markers add explicit ones: on a
message, at that message's end; on a content part, at the end of that part's text. A marker
whose text the template does not reproduce verbatim falls back to its message's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from recap.engine.chat import common_prefix, render_chat
from recap.server.errors import APIError
from recap.server.protocol import ChatMessage


@dataclass(frozen=True)
class ChatInput:
    token_ids: list[int]
    segment_boundaries: tuple[int, ...]  # message ends and explicit markers, merged, ascending
    explicit_boundaries: tuple[int, ...]  # from cache_control markers only


def _render(tokenizer: Any, dicts: list[dict[str, Any]], gen: bool, kw: dict[str, Any]) -> str:
    return tokenizer.apply_chat_template(dicts, tokenize=False, add_generation_prompt=gen, **kw)


def _offset_of_text(tokenizer: Any, text: str, char_end: int, ids: list[int]) -> int:
    """Tokens of `ids` that lie wholly inside text[:char_end]."""
    return common_prefix(tokenizer.encode(text[:char_end], add_special_tokens=False), ids)


def _marker_offsets(
    tokenizer: Any, messages: list[ChatMessage], text: str, ids: list[int], kw: dict[str, Any]
) -> list[int]:
    dicts = [m.template_dict() for m in messages]
    out: list[int] = []
    for i, m in enumerate(messages):
        marked_parts = [] if isinstance(m.content, str) or m.content is None else [
            j for j, p in enumerate(m.content) if p.cache_control is not None]
        if m.cache_control is None and not marked_parts:
            continue
        upto = _render(tokenizer, dicts[: i + 1], False, kw)
        msg_end = _offset_of_text(tokenizer, text, len(upto), ids) if text.startswith(upto) else 0
        if m.cache_control is not None and msg_end:
            out.append(msg_end)
        if not marked_parts:
            continue
        before = _render(tokenizer, dicts[:i], False, kw) if i else ""
        start = text.find(m.text(), len(before) if text.startswith(before) else 0)
        parts = m.parts()
        for j in marked_parts:
            if start < 0:
                if msg_end:
                    out.append(msg_end)
                continue
            char_end = start + sum(len(p) for p in parts[: j + 1]) + j  # parts joined by "\n"
            out.append(_offset_of_text(tokenizer, text, char_end, ids))
    return [b for b in out if 0 < b < len(ids)]


def build_chat_input(
    tokenizer: Any, messages: list[ChatMessage], template_kwargs: dict[str, Any] | None = None
) -> ChatInput:
    """Raises APIError (400) when the chat template rejects the conversation. `template_kwargs`: extra
    template variables (`tools`, the request's chat_template_kwargs)."""
    dicts = [m.template_dict() for m in messages]
    kw = dict(template_kwargs or {})
    try:
        rendered = render_chat(tokenizer, dicts, add_generation_prompt=True, template_kwargs=kw)
        explicit = _marker_offsets(tokenizer, messages, rendered.text, rendered.token_ids, kw)
    except Exception as e:  # noqa: BLE001 - jinja raise_exception / missing template: the client's input
        raise APIError(f"the chat template rejected the messages: {e}", param="messages") from None
    merged = tuple(sorted(set(rendered.segment_boundaries) | set(explicit)))
    return ChatInput(rendered.token_ids, merged, tuple(sorted(set(explicit))))
