"""Chat messages -> prompt token ids + segment boundaries (DESIGN §4).

Every message end is a boundary (render_chat). `cache_control` markers add explicit ones: on a
message, at that message's end; on a content part, at the end of that part's text. All come from
the one render (recap.engine.chat), so their cost does not grow with the number of markers. A
marker whose message the template does not reproduce verbatim is dropped (no boundary there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from recap.engine.chat import ChatPrompt, Renderer, RenderLimitExceeded, render_chat
from recap.http.errors import APIError
from recap.server.protocol import ChatCompletionRequest, ChatMessage
from recap.server.template_sandbox import request_template


@dataclass(frozen=True)
class ChatInput:
    token_ids: list[int]
    segment_boundaries: tuple[int, ...]  # message ends and explicit markers, merged, ascending
    explicit_boundaries: tuple[int, ...]  # from cache_control markers only
    # The rendered text after the last message's content: the generation prompt (where a template opens or
    # closes a think block for the answer; recap.server.reasoning.opening)
    generation_prompt: str = ""


@dataclass(frozen=True)
class TemplateInputs:
    """What a chat request renders with besides its messages: its own template (None: the tokenizer's), the
    template variables (tools, reasoning effort, chat_template_kwargs) and vLLM's generation-prompt flags.
    One reading for the replica that serves the request and the router that hashes its prompt."""

    template: str | None
    kwargs: dict[str, Any]
    add_generation_prompt: bool
    continue_final_message: bool

    @classmethod
    def of(cls, req: ChatCompletionRequest) -> TemplateInputs:
        """Raises APIError for a malformed template field (recap.server.template_sandbox.request_template)."""
        template, kwargs = request_template(req.chat_template, req.chat_template_kwargs)
        if req.tools:
            kwargs["tools"] = [t.template_dict() for t in req.tools]
        if req.reasoning_effort is not None:  # vLLM's: a template variable, and thinking off for "none"
            kwargs["reasoning_effort"] = req.reasoning_effort
            kwargs.setdefault("enable_thinking", req.reasoning_effort != "none")
        return cls(template, kwargs, req.add_generation_prompt, req.continue_final_message)

    def render(self, tokenizer: Any, messages: list[ChatMessage], render: Renderer | None = None) -> ChatInput:
        """build_chat_input with these inputs; `render`: the request's own template's renderer, if it has one."""
        return build_chat_input(tokenizer, messages, self.kwargs, render,
                                add_generation_prompt=self.add_generation_prompt,
                                continue_final_message=self.continue_final_message)


def _marker_offsets(messages: list[ChatMessage], rendered: ChatPrompt) -> list[int]:
    out: list[int] = []
    for m, span in zip(messages, rendered.content_spans):
        marked_parts = [] if isinstance(m.content, str) or m.content is None else [
            j for j, p in enumerate(m.content) if p.cache_control is not None]
        if span is None or (m.cache_control is None and not marked_parts):
            continue
        start, end = span
        if m.cache_control is not None:
            out.append(rendered.tokens_before(end))
        parts = m.parts()
        for j in marked_parts:
            char_end = start + sum(len(p) for p in parts[: j + 1]) + j  # parts joined by "\n"
            out.append(rendered.tokens_before(char_end))
    n = len(rendered.token_ids)
    return [b for b in out if 0 < b < n]


def build_chat_input(
    tokenizer: Any, messages: list[ChatMessage], template_kwargs: dict[str, Any] | None = None,
    render: Renderer | None = None, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
) -> ChatInput:
    """Raises APIError (400) when the chat template rejects the conversation or a renderer's limit is hit.
    `template_kwargs`: extra template variables (`tools`, the request's chat_template_kwargs); `render`: the
    request's own template (recap.server.template_sandbox) instead of the tokenizer's; `add_generation_prompt` and
    `continue_final_message`: vLLM's (and apply_chat_template's) flags of the same names."""
    dicts = [m.template_dict() for m in messages]
    kw = dict(template_kwargs or {})
    try:
        rendered = render_chat(tokenizer, dicts, add_generation_prompt=add_generation_prompt, template_kwargs=kw,
                               render=render, continue_final_message=continue_final_message)  # fmt: skip
    except RenderLimitExceeded as e:
        raise APIError(str(e), param="chat_template", code="chat_template_limit") from None
    except Exception as e:  # noqa: BLE001 - jinja raise_exception / missing template: the client's input
        raise APIError(f"the chat template rejected the messages: {e}", param="messages") from None
    explicit = _marker_offsets(messages, rendered)
    merged = tuple(sorted(set(rendered.segment_boundaries) | set(explicit)))
    ends = [span[1] for span in rendered.content_spans if span is not None]
    tail = rendered.text[max(ends, default=0):]
    return ChatInput(rendered.token_ids, merged, tuple(sorted(set(explicit))), tail)
