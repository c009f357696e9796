"""Structured output offline: JSON schema, JSON object, regex, choice and Lark grammar through llguidance;
the bitmask decoding against a per-token reference; bad specs are typed errors."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from recap import SamplingParams
from recap.engine.errors import InvalidRequestError
from recap.runner.grammar import bitmask_to_bool
from recap.structured_output import StructuredOutput
from tests.engine.test_equivalence import make_llm
from tests.engine.workloads import rnd

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer", "n"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(4))
def test_bitmask_decoding_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([5, 32, 33, 100])
    words = [rng.getrandbits(32) for _ in range((vocab + 31) // 32)]
    raw = b"".join(w.to_bytes(4, "little") for w in words)
    want = [bool(words[t // 32] >> (t % 32) & 1) for t in range(vocab)]
    assert bitmask_to_bool(raw, vocab).tolist() == want
    assert bitmask_to_bool(raw, vocab + 40)[vocab + 32:].sum() == 0  # past the tokenizer: never allowed


@pytest.mark.parametrize("arch", ["bamba", "mamba2"])
def test_outputs_match_their_spec(tiny_models: dict[str, Path], arch: str) -> None:
    llm = make_llm(tiny_models[arch], caching=True)
    prompts = [rnd(7, 9), rnd(8, 14)]

    def run(so: StructuredOutput, temperature: float = 1.0, bounded: bool = True) -> list[str]:
        params = SamplingParams(temperature=temperature, seed=3, max_tokens=60, structured_outputs=so)
        outs = llm.generate(prompts, params)
        # a bounded spec ends (EOS is all the grammar allows once it is complete)
        assert all(o.outputs[0].finish_reason == "stop" for o in outs) or not bounded
        return [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]

    for text in run(StructuredOutput.json(SCHEMA)) + run(StructuredOutput.json(SCHEMA), temperature=0.0):
        value = json.loads(text)
        assert set(value) == {"answer", "n"} and value["answer"] in ("yes", "no") and 0 <= value["n"] <= 99
    # any object: a random model may write one key forever; those that end are objects
    assert all(isinstance(json.loads(t), dict) for t in run(StructuredOutput("json_object"), bounded=False))
    assert all(re.fullmatch(r"[a-c]{3}-[0-9]{2}", t) for t in run(StructuredOutput("regex", r"[a-c]{3}-[0-9]{2}")))
    assert all(t in ("red", "green", "blue") for t in run(StructuredOutput.choice(["red", "green", "blue"])))
    lark = 'start: "x=" NUM ";"\nNUM: /[1-9][0-9]?/'
    assert all(re.fullmatch(r"x=[1-9][0-9]?;", t) for t in run(StructuredOutput("grammar", lark)))


def test_unconstrained_output_differs(tiny_models: dict[str, Path]) -> None:
    llm = make_llm(tiny_models["bamba"], caching=True)
    free = llm.generate([rnd(7, 9)], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.outputs[0].text)


@pytest.mark.parametrize(("so", "match"), [
    (StructuredOutput("regex", "(unclosed"), "invalid regex"),
    (StructuredOutput("json", "{not json"), "invalid json"),
    (StructuredOutput("grammar", "start: undefined_rule"), "invalid grammar"),
])
def test_bad_specs_are_typed_errors(tiny_models: dict[str, Path], so: StructuredOutput, match: str) -> None:
    llm = make_llm(tiny_models["mamba2"], caching=True)
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate([rnd(1, 5)], SamplingParams(max_tokens=4, structured_outputs=so))
    with pytest.raises(ValueError, match="kind must be one of"):
        StructuredOutput("xml")
    assert torch.is_tensor(bitmask_to_bool(b"\x01\x00\x00\x00", 3))


def test_a_matcher_that_fails_mid_generation_ends_the_request_with_an_error(tiny_models: dict[str, Path]) -> None:
    """Three rules of 900 branches: after the first token llguidance's row holds 2,704 items (its cap: 2,000).
    The request ends with finish_reason "error" and the reason, keeping only the token drawn under the
    grammar; the other request of the batch, under a grammar that works, is untouched; nothing leaks."""
    llm = make_llm(tiny_models["bamba"], caching=True)
    wide = "start: a | b | c\n" + "\n".join(f"{r}: " + " | ".join(f'"{r}{i}"' for i in range(900)) for r in "abc")
    broken, fine = llm.generate([rnd(7, 9), rnd(8, 9)], [
        SamplingParams(temperature=1.0, seed=1, max_tokens=20, structured_outputs=StructuredOutput("grammar", wide)),
        SamplingParams(temperature=1.0, seed=1, max_tokens=20, structured_outputs=StructuredOutput.choice(["ab"]))])
    out = broken.outputs[0]
    assert out.finish_reason == "error" and len(out.token_ids) == 1 and "max is 2000" in (broken.error or "")
    assert any(f"{r}{i}".startswith(out.text) for r in "abc" for i in range(900)), out.text
    assert fine.outputs[0].finish_reason == "stop" and fine.outputs[0].text == "ab" and fine.error is None
    llm.engine.scheduler.check_integrity()
    assert llm.engine.runner.grammar is not None
    assert not [rid for rid in llm.engine.runner.grammar._matchers if rid.startswith(broken.request_id)]


def test_ignore_eos_past_a_complete_grammar_is_no_error(tiny_models: dict[str, Path]) -> None:
    """Once the grammar is complete the matcher stops and allows EOS alone: what ignore_eos draws then is EOS,
    never an error and never unconstrained text."""
    llm = make_llm(tiny_models["bamba"], caching=True)
    (out,) = llm.generate([rnd(7, 9)], SamplingParams(temperature=1.0, seed=2, max_tokens=6, ignore_eos=True,
                                                      structured_outputs=StructuredOutput.choice(["ab"])))
    eos = llm.engine.eos_token_ids
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].text.startswith("ab")
    assert set(out.outputs[0].token_ids[-2:]) <= set(eos), out.outputs[0].token_ids
