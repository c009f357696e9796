"""One choice's answer as it streams, split the way the whole answer is (recap.server.chat.assistant_message):
first its reasoning (recap.server.reasoning, with --reasoning-parser), then its content, from which the tool-call
parser (recap.server.tool_stream) takes the calls. The tool parser reads the content only, so a call written
inside the think block stays reasoning text, never a call."""

from __future__ import annotations

from dataclasses import dataclass, field

from recap.server.reasoning import ReasoningStream
from recap.server.tool_stream import ToolCallStream
from recap.server.tools import ToolCall


@dataclass
class AnswerPieces:
    """What to send for one step of one choice."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class AnswerStream:
    """`reasoning` / `tools`: the choice's splitters (None: no reasoning parser / no tool parsing)."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None) -> None:
        self.reasoning, self.tools = reasoning, tools

    @property
    def called(self) -> bool:
        """Whether any tool call went out."""
        return self.tools is not None and bool(self.tools.calls)

    def feed(self, delta: str) -> AnswerPieces:
        if self.reasoning is None:
            return self._content(delta, final=False)
        thought, said = self.reasoning.feed(delta)
        return self._with(thought, self._content(said, final=False))

    def finish(self) -> AnswerPieces:
        """What is left when the choice ends (held-back tag starts, a call still open)."""
        if self.reasoning is None:
            return self._content("", final=True)
        thought, said = self.reasoning.finish()
        return self._with(thought, self._content(said, final=True))

    def step(self, delta: str, last: bool) -> AnswerPieces:
        """`feed`, and `finish` too when this is the choice's last step."""
        pieces = self.feed(delta)
        if last:
            more = self.finish()
            pieces.reasoning += more.reasoning
            pieces.content += more.content
            pieces.calls += more.calls
        return pieces

    @staticmethod
    def _with(thought: str, rest: AnswerPieces) -> AnswerPieces:
        rest.reasoning = thought
        return rest

    def _content(self, text: str, final: bool) -> AnswerPieces:
        if self.tools is None:
            return AnswerPieces(content=text)
        content, calls = self.tools.feed(text) if text else ("", [])
        if final:
            more_content, more_calls = self.tools.finish()
            content, calls = content + more_content, calls + more_calls
        return AnswerPieces(content=content, calls=calls)
