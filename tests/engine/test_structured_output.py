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
