"""The prompt checks' fast paths (engine/input_processor.py) against their references on random prompts."""

from __future__ import annotations

import enum
import random

import numpy as np
import pytest

from recap.engine.errors import InvalidRequestError
from recap.engine.input_processor import InputProcessor, all_plain_ints, all_plain_ints_ref
from recap.sampling_params import SamplingParams


class _Id(enum.IntEnum):
    A = 5


_ODD = [True, False, 1.0, "7", None, np.int64(3), _Id.A, 2**70, -1]  # not all of them plain ints


@pytest.mark.parametrize("seed", range(30))
def test_all_plain_ints_equals_its_reference(seed: int) -> None:
    rng = random.Random(seed)
    ids: list[object] = [rng.randrange(-5, 1 << 20) for _ in range(rng.choice([0, 1, 17, 1000]))]
    for _ in range(rng.choice([0, 0, 1, 3])):  # odd values anywhere (or none)
        ids.insert(rng.randint(0, len(ids)), rng.choice(_ODD))
    assert all_plain_ints(ids) == all_plain_ints_ref(ids)


def test_prepare_refuses_what_it_refused() -> None:
    """Bools, floats and numpy ints are refused; an IntEnum member is an int; a long prompt of ids passes."""
    proc = InputProcessor(None, vocab_size=512, max_model_len=40000, eos_token_ids=frozenset())
    params = SamplingParams(max_tokens=1)
    for bad in ([1, True], [1, 2.0], [np.int64(3)], [1, "2"]):
        with pytest.raises(InvalidRequestError, match="must be integers"):
            proc.prepare("r", bad, params, arrival_time=0.0)
    assert proc.prepare("r", [1, _Id.A], params, arrival_time=0.0).prompt_token_ids == [1, 5]
    ids = [random.Random(0).randrange(512) for _ in range(32768)]
    assert proc.prepare("r", ids, params, arrival_time=0.0).prompt_token_ids == ids
    with pytest.raises(InvalidRequestError, match="token id 512 is out of vocabulary"):
        proc.prepare("r", [*ids, 512], params, arrival_time=0.0)
