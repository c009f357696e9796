"""The token logprobs of a /v1/responses answer's `output_text` (`include: ["message.output_text.logprobs"]`,
`top_logprobs` alternatives each): the chat path's logprobs (recap.server.logprobs) of the content's tokens only.

Which tokens are the content's: each output token covers the characters of its text, laid end to end; with
--reasoning-parser a token belongs to the content when any of its characters lies after the end of `</think>`
(recap.server.reasoning.ReasoningStream.content_chars), so the think block's tokens and the end tag's own
token are left out, and a token that straddles the tag and the content counts as content. Without a parser,
or when the answer starts as content, every token is the content's: the list is chat's, token for token.
An answer that never leaves its think block has no content tokens. Tool-call text parsed out of the content
stays in its tokens (the tokens are the model's, not the text left after parsing).

Whole answers use `content_logprobs`; a stream feeds each step's tokens to `StreamedLogprobs`, which gives them
out once the content's start is known, so the deltas joined are the whole answer's list.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from recap.engine.outputs import Logprob
from recap.server.logprobs import chat_logprobs
from recap.server.reasoning import ReasoningStream
from recap.server.responses import ChatTokenLogprob

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for the Responses API's top_logprobs
INCLUDE_LOGPROBS = "message.output_text.logprobs"


def content_from(read: ReasoningStream | None) -> int | None:
    """Where the content starts in the answer's text: 0 without a reasoning parser, None while unknown."""
    return 0 if read is None else read.content_chars


def _ends(token_text: Callable[[int], str], token_ids: Sequence[int], at: int) -> list[int]:
    """Each token's end in the text, its texts laid end to end from `at`."""
    ends = []
    for tok in token_ids:
        at += len(token_text(tok))
        ends.append(at)
    return ends


def content_logprobs(token_text: Callable[[int], str], token_ids: Sequence[int], lps: Sequence[dict[int, Logprob]],
                     k: int, start: int | None) -> list[ChatTokenLogprob]:  # fmt: skip
    """The logprobs of a whole answer's content tokens (`start`: `content_from`; None: no content)."""
    if start is None:
        return []
    ends = _ends(token_text, token_ids, 0)
    first = next((i for i, end in enumerate(ends) if end > start), len(ends))
    return chat_logprobs(token_text, token_ids[first:], lps[first:], k).content


def delta_shape(entries: Sequence[ChatTokenLogprob]) -> list[dict[str, Any]]:
    """Logprobs as the text events carry them (the SDK's ResponseTextDeltaEvent.Logprob: no `bytes`)."""
    return [{"token": e.token, "logprob": e.logprob,
             "top_logprobs": [{"token": t.token, "logprob": t.logprob} for t in e.top_logprobs]} for e in entries]


class StreamedLogprobs:
    """One streamed answer's content logprobs: tokens wait until the content's start is known, then go out with
    the next text event; those that end before it (reasoning) are dropped."""

    def __init__(self, token_text: Callable[[int], str], k: int, read: ReasoningStream | None) -> None:
        self.token_text, self.k, self.read = token_text, k, read
        self._chars = 0  # where the next token's text starts
        self._waiting: list[tuple[int, int, dict[int, Logprob]]] = []  # (token, its end, its logprobs)

    def add(self, token_ids: Sequence[int], lps: Sequence[dict[int, Logprob]]) -> None:
        ends = _ends(self.token_text, token_ids, self._chars)
        if ends:
            self._chars = ends[-1]
        self._waiting.extend(zip(token_ids, ends, lps))

    @property
    def ready(self) -> bool:
        """Whether content tokens wait to go out."""
        start = content_from(self.read)
        return start is not None and any(end > start for _, end, _ in self._waiting)

    def take(self) -> list[ChatTokenLogprob]:
        """The content tokens that arrived and were not given out yet (none while the content's start is
        unknown)."""
        start = content_from(self.read)
        if start is None:
            return []
        ready = [(tok, lp) for tok, end, lp in self._waiting if end > start]
        self._waiting = []
        return chat_logprobs(self.token_text, [t for t, _ in ready], [lp for _, lp in ready], self.k).content
