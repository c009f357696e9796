"""The seeded conversation trace: deterministic, Mooncake-shaped, turns extend their history."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recap.bench.conversations import BlockIds, ConversationTraceConfig, generate, main, unlimited_hit_rate
from recap.bench.trace import MOONCAKE_BLOCK_TOKENS, load_trace

SMALL = ConversationTraceConfig(conversations=40, system_prompts=5, mean_turns=3.0, mean_think_s=5.0)


def test_block_ids_share_equal_prefixes_and_split_at_the_first_different_block() -> None:
    ids = BlockIds()
    a = ids([(0, 700), (1, 400)], 1100)  # blocks: [0:512) [512:1024) [1024:1100)
    b = ids([(0, 700), (1, 400), (2, 600)], 1700)  # extends a: its first two blocks are a's
    c = ids([(0, 700), (3, 400)], 1100)  # diverges inside block 1
    assert len(a) == 3 and len(b) == 4 and b[:2] == a[:2] and b[2] != a[2]  # a's partial block has its own id
    assert c[0] == a[0] and c[1] != a[1]
    assert ids([(0, 700), (1, 400)], 1100) == a  # interned


def test_the_trace_is_seeded_and_turns_extend_the_previous_turn() -> None:
    rows = generate(SMALL)
    assert rows == generate(SMALL) and rows != generate(ConversationTraceConfig(**{**SMALL.__dict__, "seed": 1}))
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    for r in rows:
        assert len(r["hash_ids"]) == -(-r["input_length"] // MOONCAKE_BLOCK_TOKENS)
    # some later request extends an earlier one's whole full blocks (a next turn)
    firsts = {tuple(r["hash_ids"][: r["input_length"] // MOONCAKE_BLOCK_TOKENS]) for r in rows}
    assert any(
        tuple(r["hash_ids"][: len(f)]) == f and len(r["hash_ids"]) > len(f) + 1 for r in rows for f in firsts if f
    )
    assert 0.0 < unlimited_hit_rate(rows) < 1.0


def test_the_command_writes_a_trace_the_replay_reads(tmp_path: Path) -> None:
    out = tmp_path / "conv.jsonl"
    assert main(["--out", str(out), "--conversations", "10", "--system-prompts", "3"]) == 0
    trace = load_trace(out)
    assert len(trace) == len(out.read_text().splitlines()) >= 10
    assert json.loads(out.read_text().splitlines()[0])["hash_ids"][0] == 0
    with pytest.raises(ValueError, match="mean_turns"):
        ConversationTraceConfig(mean_turns=0.5)
