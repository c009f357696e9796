"""Incremental detokenization: multi-byte characters, stop strings, streaming hold-back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from recap.engine.detokenizer import IncrementalDetokenizer, special_token_ids, tokenizer_decode
from recap.model.default_model import save_tokenizer
from recap.sampling_params import SamplingParams
from recap.server.tools import special_marker_ids


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


def _marker_tokenizer(tmp_path: Path) -> Any:
    """A real byte-level BPE whose Hermes call markers are special tokens (as some checkpoints ship them)."""
    from transformers import AutoTokenizer

    save_tokenizer(tmp_path, seed=0, vocab_size=300)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    return tok


def test_special_tool_markers_are_kept_and_other_specials_skipped(tmp_path: Path) -> None:
    tok = _marker_tokenizer(tmp_path)
    special = special_token_ids(tok)
    assert tok.eos_token_id in special
    keep = special_marker_ids(tok, "hermes", special)
    assert len(keep) == 2 and set(keep) <= special
    assert special_marker_ids(tok, "granite", special) == ()  # its marker is no single token here
    text = 'Sure.<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]

    def stream(params: SamplingParams) -> tuple[str, str]:
        d = IncrementalDetokenizer(tok, params)
        pieces = []
        for t in ids:
            d.add([t])
            pieces.append(d.take_delta(False))
        d.flush()
        pieces.append(d.take_delta(True))
        return "".join(pieces), d.text

    assert stream(SamplingParams(keep_special_token_ids=keep)) == (text, text)  # markers in, EOS out
    erased = stream(SamplingParams())[1]
    assert "<tool_call>" not in erased and erased.startswith("Sure.")  # what a parser could not read
    assert stream(SamplingParams(skip_special_tokens=False))[1].endswith("</tool_call>" + tok.eos_token)


@pytest.mark.parametrize("clean_up", [False, True])
def test_direct_decode_equals_the_tokenizers_decode(tmp_path: Path, clean_up: bool) -> None:
    """The Rust tokenizer's decode called directly (tokenizer_decode's fast path) gives transformers' decode, special
    tokens and added tokens included; a tokenizer that cleans up spaces keeps transformers' decode."""
    import torch

    tok = _marker_tokenizer(tmp_path)
    tok.clean_up_tokenization_spaces = clean_up
    decode = tokenizer_decode(tok)
    assert decode.__name__ == ("reference" if clean_up else "rust")
    g = torch.Generator().manual_seed(0)
    vocab = len(tok)
    for n in (1, 2, 5, 17, 40):
        ids = torch.randint(0, vocab, (n,), generator=g).tolist() + [tok.eos_token_id, vocab - 1]
        for skip in (True, False):
            assert decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip), (ids, skip)
    assert tokenizer_decode(ByteTokenizer()).__name__ == "reference"  # not a transformers tokenizer
