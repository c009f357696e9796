"""Engine TokenLogprobs -> the OpenAI logprobs shapes of completions and of chat."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from recap.engine.outputs import TokenLogprob
from recap.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

# JSON has no -inf; OpenAI clients expect a number (vLLM clamps the same way).
MIN_LOGPROB = -9999.0


def _clamp(v: float) -> float:
    return v if v > MIN_LOGPROB else MIN_LOGPROB


def completion_logprobs(
    token_text: Callable[[int], str], lps: Sequence[TokenLogprob], text_offset: int
) -> tuple[CompletionLogprobs, int]:
    """Logprobs of `lps`, whose text starts at `text_offset` of the choice; also the offset after them."""
    out = CompletionLogprobs()
    for lp in lps:
        text = token_text(lp.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(_clamp(lp.logprob))
        out.top_logprobs.append({token_text(t): _clamp(v) for t, v in lp.top})
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out, text_offset


def chat_logprobs(token_text: Callable[[int], str], lps: Sequence[TokenLogprob]) -> ChatLogprobs:
    content = []
    for lp in lps:
        text = token_text(lp.token_id)
        top = [TopLogprob(token=(s := token_text(t)), logprob=_clamp(v), bytes=list(s.encode())) for t, v in lp.top]
        content.append(ChatTokenLogprob(token=text, logprob=_clamp(lp.logprob), bytes=list(text.encode()),
                                        top_logprobs=top))
    return ChatLogprobs(content=content)
