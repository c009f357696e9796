"""Engine logprobs (vLLM's {token id: Logprob} per position) -> the OpenAI shapes of completions and chat."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from recap.engine.outputs import Logprob
from recap.server.responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    LogprobEntry,
    PromptLogprobsOut,
    TopLogprob,
)

# JSON has no -inf; OpenAI clients expect a number (vLLM clamps the same way).
MIN_LOGPROB = -9999.0


def _clamp(v: float) -> float:
    return v if v > MIN_LOGPROB else MIN_LOGPROB


def _top(d: dict[int, Logprob], k: int) -> list[tuple[int, float]]:
    """The k best candidates of one position, best first (the sampled token only if it is among them)."""
    ranked = sorted(d.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
    return [(t, lp.logprob) for t, lp in ranked[:k]]


def _with_chosen(d: dict[int, Logprob], tok: int, k: int) -> list[tuple[int, float]]:
    """The chosen token, then the k best others: OpenAI's legacy completions return the sampled token's logprob
    with the top `logprobs` ("up to logprobs+1 elements"), as vLLM does (so `logprobs: 0` gives the chosen one)."""
    return [(tok, d[tok].logprob)] + [(t, v) for t, v in _top(d, k + 1) if t != tok][:k]


def completion_logprobs(
    token_text: Callable[[int], str], token_ids: Sequence[int], lps: Sequence[dict[int, Logprob] | None], k: int,
    text_offset: int, out: CompletionLogprobs | None = None,
) -> tuple[CompletionLogprobs, int]:
    """Logprobs of `token_ids` (whose text starts at `text_offset` of the choice), appended to `out`;
    also the offset after them. A None entry (the first prompt token under echo) has no logprob."""
    out = out if out is not None else CompletionLogprobs()
    for tok, d in zip(token_ids, lps):
        text = token_text(tok)
        out.tokens.append(text)
        if d is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            out.token_logprobs.append(_clamp(d[tok].logprob))
            out.top_logprobs.append({token_text(t): _clamp(v) for t, v in _with_chosen(d, tok, k)})
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out, text_offset


def chat_logprobs(
    token_text: Callable[[int], str], token_ids: Sequence[int], lps: Sequence[dict[int, Logprob]], k: int
) -> ChatLogprobs:
    content = []
    for tok, d in zip(token_ids, lps):
        text = token_text(tok)
        top = [TopLogprob(token=(s := token_text(t)), logprob=_clamp(v), bytes=list(s.encode())) for t, v in _top(d, k)]
        content.append(ChatTokenLogprob(token=text, logprob=_clamp(d[tok].logprob), bytes=list(text.encode()),
                                        top_logprobs=top))
    return ChatLogprobs(content=content)


def prompt_logprobs_out(plp: Sequence[dict[int, Logprob] | None] | None) -> PromptLogprobsOut | None:
    """vLLM's `prompt_logprobs` field: per prompt token {token id: {logprob, rank, decoded_token}}."""
    if plp is None:
        return None
    return [None if d is None else {t: LogprobEntry(logprob=_clamp(lp.logprob), rank=lp.rank,
                                                    decoded_token=lp.decoded_token) for t, lp in d.items()}
            for d in plp]
