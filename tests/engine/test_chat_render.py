"""render_chat (one render, offsets) equals its plain reference (a render and an encode per message)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from recap.engine.chat import render_chat, render_chat_reference
from recap.model import default_model

ALPHABET = "abc xyz QRS 123 .,!? é ü 中文 \n\t"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path: Path = tmp_path_factory.mktemp("chat-tok")
    default_model.save_tokenizer(path, default_model.SEED)
    return AutoTokenizer.from_pretrained(path)


def conversation(rng: random.Random) -> list[dict[str, str]]:
    n = rng.randint(1, 12)
    msgs = [{"role": "system", "content": "Be brief."}] if rng.random() < 0.5 else []
    for i in range(n):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 60))).strip() or "x"
        if rng.random() < 0.2 and msgs:  # repeated contents must not confuse the positions
            text = msgs[-1]["content"]
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return msgs


@pytest.mark.parametrize("seed", range(40))
def test_render_chat_equals_the_reference(tokenizer: Any, seed: int) -> None:
    rng = random.Random(seed)
    msgs = conversation(rng)
    gen = rng.random() < 0.8
    fast, ref = render_chat(tokenizer, msgs, add_generation_prompt=gen), render_chat_reference(
        tokenizer, msgs, add_generation_prompt=gen)
    assert (fast.text, fast.token_ids, fast.content_spans) == (ref.text, ref.token_ids, ref.content_spans)
    assert fast.segment_boundaries == ref.segment_boundaries
    for (start, end), m in zip(fast.content_spans, msgs):  # type: ignore[misc]
        assert fast.text[start:end] == m["content"]


def test_a_template_that_alters_contents_falls_back_to_finding_them(tokenizer: Any) -> None:
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = "{% for m in messages %}[{{ m.role }}] {{ m.content | upper }}\n{% endfor %}"
    msgs = [{"role": "user", "content": "HELLO"}, {"role": "assistant", "content": "abc"}]
    out = render_chat(tokenizer, msgs, add_generation_prompt=False)
    assert out.content_spans[0] == (7, 12) and out.content_spans[1] is None  # "abc" is shown as "ABC"
    assert len(out.segment_boundaries) == 1


@pytest.mark.parametrize("seed", range(24))
def test_continue_final_message_cuts_where_transformers_does(tokenizer: Any, seed: int) -> None:
    """An open final message (a prefilled assistant turn): the text and ids transformers' apply_chat_template gives
    with continue_final_message=True (what vLLM sends), and the earlier messages' boundaries unchanged."""
    rng = random.Random(1000 + seed)
    msgs = conversation(rng)
    last = msgs[-1]["content"]
    msgs[-1]["content"] = rng.choice([last, last + " ", " " + last + "\n", last + last[:3]])
    out = render_chat(tokenizer, msgs, add_generation_prompt=False, continue_final_message=True)
    want = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False,
                                         continue_final_message=True)  # fmt: skip
    assert out.text == want and out.text.rstrip().endswith(msgs[-1]["content"].strip())
    assert out.token_ids == tokenizer.encode(want, add_special_tokens=False)
    closed = render_chat(tokenizer, msgs, add_generation_prompt=False)
    assert out.segment_boundaries == tuple(b for b in closed.segment_boundaries if b < len(out.token_ids))
    assert out.content_spans[:-1] == closed.content_spans[:-1]


def test_continue_final_message_refusals(tokenizer: Any) -> None:
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, here"}]
    with pytest.raises(ValueError, match="cannot both be true"):
        render_chat(tokenizer, msgs, add_generation_prompt=True, continue_final_message=True)
    hiding = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    hiding.chat_template = "{% for m in messages %}[{{ m.role }}] {{ m.content | upper }}\n{% endfor %}"
    with pytest.raises(ValueError, match="does not reproduce the final message"):
        render_chat(hiding, msgs, add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ValueError, match="no text to continue"):
        render_chat(tokenizer, msgs[:1] + [{"role": "assistant", "content": None}], add_generation_prompt=False,
                    continue_final_message=True)  # fmt: skip
