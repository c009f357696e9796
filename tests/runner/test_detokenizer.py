"""Incremental detokenization: multi-byte characters, stop strings, streaming hold-back."""

from __future__ import annotations

import pytest

from recap.engine.detokenizer import IncrementalDetokenizer
from recap.sampling_params import SamplingParams


class ByteTokenizer:
    """Each token is one UTF-8 byte: the harshest case for incremental decoding."""

    def encode(self, s: str) -> list[int]:
        return list(s.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text", ["plain ascii", "héllo wörld", "日本語のテキスト", "emoji 🎉🚀 end", "tab\tnew\nline"])
def test_streamed_deltas_rebuild_the_text(text: str) -> None:
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok, SamplingParams())
    pieces = []
    for t in tok.encode(text):
        d.add([t])
        pieces.append(d.take_delta(False))
    d.flush()
    pieces.append(d.take_delta(True))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_truncates_and_is_never_streamed() -> None:
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok, SamplingParams(stop=("STOP",)))
    streamed = []
    stopped = False
    for t in tok.encode("abc STOP more"):
        stopped = d.add([t])
        streamed.append(d.take_delta(stopped))
        if stopped:
            break
    assert stopped and d.text == "abc " and "".join(streamed) == "abc "
    assert d.stop_str == "STOP"


def test_stop_string_kept_when_asked() -> None:
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok, SamplingParams(stop=("xy", "z"), include_stop_str_in_output=True))
    assert d.add(tok.encode("aaz bxy")) and d.text == "aaz"
