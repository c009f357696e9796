"""Reasoning parsers (vLLM's `--reasoning-parser`): a reasoning model's answer split into its think block
(`reasoning`) and the rest (`content`), on the decoded text, whole or as it streams.

Parsers, by vLLM's names (tags `<think>` ... `</think>` for all of them):
- `qwen3` (Qwen3, Qwen3-Next, Qwen3.5): reasoning only inside a think block that was opened, by the output
  itself (its first non-blank text is `<think>`) or by the chat template (the generation prompt ends in an
  open `<think>`, as Qwen3.5 and the Thinking models render it); an answer with no opened block is all content.
- `deepseek_r1` (also `nemotron_v3`, `minimax_m2`: the same split in vLLM): the end tag alone splits; the text
  before it is reasoning, since the start tag may have been in the prompt (Nemotron-3 Nano, MiniMax-M2).
Both: a leading start tag in the output is dropped; with no end tag (max_tokens hit while thinking) the whole
answer is reasoning; whitespace after `</think>` stays in the content, as vLLM leaves it.

Where the answer starts (`opening`) is read from the generation prompt, the rendered text after the last
message (vLLM's `prompt_is_reasoning_end`, scoped to this turn so an earlier turn's block does not count): an
open `<think>` starts the answer inside the block; a closed one (`enable_thinking: false`: the template
pre-fills an empty block) makes it all content, as does `enable_thinking: false` with no tag at all.

`split_reasoning` reads a whole text; `ReasoningStream` reads it piece by piece and holds back what could still
be the start of a tag, so the pieces joined are `split_reasoning`'s split (tests/server/test_reasoning.py checks
it at every split point).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from recap.server.partial_tag import partial_tag

Opening = Literal["open", "strict", "content"]


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    # qwen3: text is reasoning only once a block was opened; deepseek_r1: everything before the end tag is
    start_required: bool = False


_QWEN3 = ReasoningFormat("qwen3", start_required=True)
_R1 = ReasoningFormat("deepseek_r1")
PARSERS: dict[str, ReasoningFormat] = {"qwen3": _QWEN3, "deepseek_r1": _R1, "nemotron_v3": _R1, "minimax_m2": _R1}


def reasoning_format(name: str) -> ReasoningFormat:
    """The parser named `name`; a ValueError listing the known ones otherwise (a startup error)."""
    fmt = PARSERS.get(name)
    if fmt is None:
        raise ValueError(f"unknown reasoning parser {name!r}; recap knows {', '.join(PARSERS)}")
    return fmt


def opening(fmt: ReasoningFormat, generation_prompt: str, enable_thinking: Any = None) -> Opening:
    """Where the answer starts: "open" (inside a think block: reasoning until the end tag), "strict" (content
    unless the answer opens a block) or "content" (no reasoning at all). `generation_prompt`: the rendered text
    after the last message; `enable_thinking`: the request's chat_template_kwargs value, if any."""
    start, end = generation_prompt.rfind(fmt.start), generation_prompt.rfind(fmt.end)
    if start > end:
        return "open"
    if end >= 0 or enable_thinking is False:  # the template closed the block, or thinking was turned off
        return "content"
    return "strict" if fmt.start_required else "open"


def split_reasoning(text: str, fmt: ReasoningFormat, where: Opening) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer; None for an empty part."""
    if where == "content":
        return None, text or None
    lead = text.lstrip()
    if lead.startswith(fmt.start):
        body = lead[len(fmt.start):]
    elif where == "strict":
        return None, text or None
    else:
        body = text
    reasoning, found, content = body.partition(fmt.end)
    return reasoning or None, (content or None) if found else None


class ReasoningStream:
    """One answer's text as it streams, split into reasoning and content pieces.

    Phases: "lead" (before the first non-blank text decides whether a block opens), "reasoning" (inside the
    block), "content". `reasoning_chars`: where the reasoning ends in the text (the end tag's start, or the
    whole text while it has not ended), for counting reasoning tokens; `content_chars`: where the content starts
    (after the end tag; None until known), for the content's own token logprobs."""

    def __init__(self, fmt: ReasoningFormat, where: Opening) -> None:
        self.fmt = fmt
        self._strict = where == "strict"
        self._phase = "content" if where == "content" else "lead"
        self._pending = ""  # text not yet given out (a blank lead, or what may be the start of a tag)
        self._seen = 0  # characters read before _pending
        self.reasoning_chars = 0
        self.content_chars: int | None = 0 if where == "content" else None

    @property
    def in_reasoning(self) -> bool:
        """Inside the think block (an answer that ends here was all reasoning)."""
        return self._phase == "reasoning"

    def feed(self, delta: str) -> tuple[str, str]:
        """The (reasoning, content) to send once `delta` is added."""
        self._pending += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """What is left to send when the answer ends."""
        return self._advance(final=True)

    def _take(self, n: int) -> str:
        piece, self._pending = self._pending[:n], self._pending[n:]
        self._seen += n
        return piece

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        start, end = self.fmt.start, self.fmt.end
        while True:
            if self._phase == "lead":
                lead = self._pending.lstrip()
                if lead.startswith(start):
                    self._take(len(self._pending) - len(lead) + len(start))  # the blank lead and the tag go
                    self._phase = "reasoning"
                elif not final and start.startswith(lead):
                    return "".join(reasoning), "".join(content)  # undecided: blank, or a prefix of the tag
                else:
                    self._phase = "content" if self._strict else "reasoning"
                    self.content_chars = self._seen if self._strict else None
            elif self._phase == "reasoning":
                at = self._pending.find(end)
                if at >= 0:
                    reasoning.append(self._take(at))
                    self.reasoning_chars = self._seen
                    self._take(len(end))
                    self._phase = "content"
                    self.content_chars = self._seen
                    continue
                keep = 0 if final else partial_tag(self._pending, end)
                reasoning.append(self._take(len(self._pending) - keep))
                self.reasoning_chars = self._seen
                return "".join(reasoning), "".join(content)
            else:
                content.append(self._take(len(self._pending)))
                return "".join(reasoning), "".join(content)


def reasoning_tokens(token_texts: list[str], read: ReasoningStream) -> int:
    """How many output tokens the reasoning took, once `read` has read the whole answer: those whose text lies
    wholly before where the end tag starts (vLLM counts the tokens before `</think>`), or all of them when the
    answer ended inside its block."""
    if read.in_reasoning:
        return len(token_texts)
    n, chars = 0, 0
    for text in token_texts:
        chars += len(text)
        if chars > read.reasoning_chars or read.reasoning_chars == 0:
            break
        n += 1
    return n


def read_answer(text: str, fmt: ReasoningFormat, where: Opening) -> ReasoningStream:
    """A whole answer read as it would stream: its reasoning and content boundaries set."""
    read = ReasoningStream(fmt, where)
    read.feed(text)
    read.finish()
    return read


def answer_reasoning_tokens(text: str, token_texts: list[str], fmt: ReasoningFormat, where: Opening) -> int:
    """reasoning_tokens of a whole answer."""
    return reasoning_tokens(token_texts, read_answer(text, fmt, where))
