"""Tool calls in a streamed chat answer: each call goes out as soon as its text is complete, in OpenAI's
delta format (one delta per call with its index, id, type, function name and arguments), and the content
before the first call streams as it comes, less what could still be the start of a call marker.

`ToolCallStream.feed(delta)` takes the model's text piece by piece and answers the (content, calls) to
send now; `finish()` flushes what is left when the choice ends. Content and calls add up to what
recap.server.tools.parse_tool_calls / forced_calls give for the whole text (tests/server/test_tool_stream.py
compares them on random texts split at random points): the calls are the well-formed calls of known tools
up to the first that is not one; when there is none at all, the whole text is content.
"""

from __future__ import annotations

from recap.server.partial_tag import partial_tag
from recap.server.tools import (
    MARKERS,
    NamedToolChoice,
    ToolCall,
    ToolSpec,
    json_values,
    named_call,
    object_call,
    xml_object,
)

# The characters a call can complete on: an object's or array's close, a marker's last character.
_CLOSERS = frozenset("}]>")


class ToolCallStream:
    """One choice's text as it streams: content first, then the calls one by one.

    Phases: "content" (before the first marker; tool_choice auto), "call" (inside a call block),
    "between" (after a block, looking for the next marker), "raw" (no call came of it: the text is
    content), "named" (a forced named call: the whole text is its arguments), "done"."""

    def __init__(self, tools: list[ToolSpec], choice: str | NamedToolChoice, parser: str | None) -> None:
        """`choice`: the effective tool choice (not "none"); `parser`: the format for "auto"."""
        self._known = {t.function.name for t in tools}
        self._named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        self._format = "required" if choice == "required" else parser
        if self._named is None and self._format is None:
            raise ValueError("tool_choice auto needs a tool call parser")
        start, end = MARKERS.get(self._format or "", ("", None))
        self._start, self._end = start, end
        self.text = ""
        self.calls: list[ToolCall] = []
        self._sent = 0  # text[:_sent] went out as content
        self._block = 0  # "call": where the block's start marker is; "between": where to look on
        self._taken = 0  # calls taken from the current block
        if self._named is not None:
            self._phase = "named"
        elif self._format == "required":
            self._phase = "call"  # the grammar writes the array from the first token
        else:
            self._phase = "content"

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """The content and the calls to send once `delta` is added to the text."""
        self.text += delta
        return self._advance(fresh=any(c in _CLOSERS for c in delta), final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left to send when the choice ends."""
        content, calls = self._advance(fresh=True, final=True)
        if not self.calls and self._phase not in ("content", "raw"):  # no call came of it: all is content
            content += self.text[self._sent:]
            self._sent = len(self.text)
        self._phase = "done"
        return content, calls

    def _advance(self, fresh: bool, final: bool) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        text = self.text
        while True:
            if self._phase == "content":
                at = text.find(self._start, self._sent)
                if at < 0:
                    cut = len(text) if final else len(text) - partial_tag(text, self._start)
                    piece = text[self._sent:cut] if final else text[self._sent:cut].rstrip()
                    if piece.strip() or (final and piece):
                        content.append(piece)
                        self._sent += len(piece)
                    return "".join(content), calls
                piece = text[self._sent:at].rstrip()  # the separator before a call is no content
                content.append(piece)
                self._sent += len(piece)
                self._phase, self._block, self._taken = "call", at, 0
            elif self._phase == "call":
                if not fresh:
                    return "".join(content), calls
                objects, closed, next_at = self._read_block(final)
                for obj in objects[self._taken:]:
                    call = object_call(obj, self._known, len(self.calls))
                    if call is None:
                        closed, next_at = True, -1
                        break
                    self._taken += 1
                    self.calls.append(call)
                    calls.append(call)
                if not closed:
                    return "".join(content), calls
                if next_at < 0:  # not well-formed, or the format has one block
                    self._phase = "done" if self.calls else "raw"
                else:
                    self._phase, self._block = "between", next_at
            elif self._phase == "between":
                at = text.find(self._start, self._block)
                if at < 0:
                    return "".join(content), calls
                self._phase, self._block, self._taken = "call", at, 0
            elif self._phase == "raw":
                content.append(text[self._sent:])
                self._sent = len(text)
                return "".join(content), calls
            elif self._phase == "named":
                if final:  # arguments cut short (not JSON) are no call: finish() sends the text as content
                    call = named_call(self._named, text)  # type: ignore[arg-type]
                    if call is not None:
                        self.calls.append(call)
                        calls.append(call)
                    self._phase = "done"
                return "".join(content), calls
            else:
                return "".join(content), calls

    def _read_block(self, final: bool) -> tuple[list[object], bool, int]:
        """The current block's call objects so far, whether the block is over, and where to look for the
        next one (-1: nowhere). A block that can no longer become well-formed ends with None."""
        text, start, end = self.text, self._start, self._end
        body_at = self._block + len(start)
        close = text.find(end, body_at) if end else -1
        if self._format == "qwen3_xml":
            if close < 0:
                return [None] if final else [], final, -1
            return [xml_object(text[self._block: close + len(end)])], True, close + len(end)  # type: ignore[arg-type]
        items, complete = json_values(text[body_at: close if close >= 0 else len(text)])
        if close >= 0:  # the end marker is there: the block is all there is
            return (items if complete else [*items, None]), True, close + len(end) if complete else -1  # type: ignore[operator]
        if final and not complete:
            return [*items, None], True, -1
        if complete and end is None:  # granite, required: the one array closed
            return items, True, -1
        return items, final, -1
