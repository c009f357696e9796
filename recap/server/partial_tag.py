"""What a streamed parser holds back: the end of the text so far that may still become a tag (a tool-call
marker, a think tag) once the next piece arrives."""

from __future__ import annotations


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
