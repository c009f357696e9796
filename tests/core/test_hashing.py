"""Block hashes: deterministic across processes, chained, isolated by salt and extra keys, incremental."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recap.core.hashing import BlockHasher, block_hash, chain_hashes, root_hash
from recap.core.request import Request


def test_same_tokens_same_hashes_and_only_full_blocks() -> None:
    root = root_hash(None)
    a = chain_hashes(root, list(range(10)), 4)
    assert len(a) == 2  # 10 tokens: two full blocks, the partial one is never hashed
    assert a == chain_hashes(root, list(range(10)), 4)
    assert a[0] == block_hash(root, [0, 1, 2, 3])
    assert a[1] == block_hash(a[0], [4, 5, 6, 7])


def test_chain_depends_on_every_earlier_block() -> None:
    root = root_hash(None)
    a = chain_hashes(root, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = chain_hashes(root, [9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix


def test_salt_and_extra_keys_change_every_hash() -> None:
    tokens = list(range(8))
    plain = chain_hashes(root_hash(None), tokens, 4)
    salted = chain_hashes(root_hash("tenant-a"), tokens, 4)
    other = chain_hashes(root_hash("tenant-b"), tokens, 4)
    adapter = chain_hashes(root_hash(None, ("lora-1",)), tokens, 4)
    mm = chain_hashes(root_hash(None, (("img", 7),)), tokens, 4)
    all_chains = [plain, salted, other, adapter, mm]
    for i, x in enumerate(all_chains):
        for y in all_chains[i + 1 :]:
            assert not set(x) & set(y)


def test_encoding_is_unambiguous() -> None:
    assert root_hash(None, ("1",)) != root_hash(None, (1,))
    assert root_hash(None, ("ab", "c")) != root_hash(None, ("a", "bc"))
    assert root_hash(None, (True,)) != root_hash(None, (1,))
    assert root_hash("") != root_hash(None)
    with pytest.raises(TypeError):
        root_hash(None, (object(),))


def test_deterministic_across_processes() -> None:
    code = (
        "from recap.core.hashing import chain_hashes, root_hash;"
        "print(chain_hashes(root_hash('s', ('x', 3)), list(range(12)), 4))"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": seed}
        ).stdout
        for seed in ("1", "2")
    }
    assert len(runs) == 1
    assert runs.pop().strip() == str(chain_hashes(root_hash("s", ("x", 3)), list(range(12)), 4))


def test_hasher_extends_incrementally_over_outputs() -> None:
    r = Request("r", list(range(6)), max_tokens=10, cache_salt="s")
    hasher = BlockHasher(4)
    hasher.update(r)
    assert len(r.block_hashes) == 1
    first = r.block_hashes[0]
    r.output_token_ids += [6, 7]
    hasher.update(r)
    assert len(r.block_hashes) == 2 and r.block_hashes[0] == first  # earlier blocks never recomputed
    r.output_token_ids += [8]
    hasher.update(r)
    assert len(r.block_hashes) == 2
    assert r.block_hashes == chain_hashes(root_hash("s"), list(range(9)), 4)


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=70),
    outputs=st.lists(st.lists(st.integers(0, 2**31), max_size=9), max_size=5),
    block_size=st.sampled_from([1, 3, 4, 16]),
)
def test_batched_hasher_equals_the_per_block_reference(
    prompt: list[int], outputs: list[list[int]], block_size: int
) -> None:
    """BlockHasher converts all new tokens at once; chain_hashes hashes block by block: same chain."""
    r = Request("r", prompt, max_tokens=100, cache_salt="t")
    hasher = BlockHasher(block_size)
    hasher.update(r)
    for more in outputs:
        r.output_token_ids += more
        hasher.update(r)
    assert r.block_hashes == chain_hashes(root_hash("t"), prompt + [t for m in outputs for t in m], block_size)
