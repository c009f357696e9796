"""Trace replay: token expansion, trace formats, budgets, and hand-computed hit rates through the real scheduler."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from recap.bench.bounds import kv_belady_hits, kv_lru_hits, oracle_hits, reuse_intervals
from recap.bench.replay import add_bench_replay_parser, build_setup, main, replay, unbounded_kv_blocks
from recap.bench.shapes import get_shape, kv_blocks_for_bytes, state_slots_for_bytes
from recap.bench.trace import MOONCAKE_BLOCK_TOKENS, TokenExpander, load_trace, prompt_token_ids
from recap.bench.variants import parse_policy
from recap.units import parse_bytes

# -- token expansion -------------------------------------------------------------------------------


def test_expansion_keeps_equal_prefixes_equal_and_splits_at_the_first_different_id() -> None:
    ex = TokenExpander()
    a = ex.expand([7, 8, 9], 1300)
    b = ex.expand([7, 8, 10], 1400)
    assert len(a) == 1300 and len(b) == 1400
    assert a[:1024] == b[:1024]
    assert a[1024] != b[1024]  # the header spells the id: different ids differ from their first token
    assert ex.expand([7, 8, 9], 1300) == a  # deterministic
    assert TokenExpander().expand([7, 8, 9], 1300) == a  # across instances
    assert all(0 <= t < ex.vocab_size for t in a + b)


def test_expansion_distinct_ids_never_collide_and_last_block_is_partial() -> None:
    ex = TokenExpander(vocab_size=50)
    firsts = {tuple(ex.block(h)[:16]) for h in range(3000)}  # 3000 > vocab: the header uses more digits
    assert len(firsts) == 3000
    assert len(ex.expand([1, 2, 3], 2 * MOONCAKE_BLOCK_TOKENS + 5)) == 1029
    assert ex.expand([1, 2, 3], 1029)[1024:] == ex.block(3)[:5]
    with pytest.raises(ValueError, match="do not cover"):
        ex.expand([1, 2], 1100)


# -- trace formats ---------------------------------------------------------------------------------


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


BAILIAN = [  # Alibaba's qwen_trace shape: 16-token hash blocks, seconds; turn 2 extends turn 1's first 6 blocks
    {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.0, "input_length": 100, "output_length": 4, "type": "text",
     "turn": 1, "hash_ids": [1, 2, 3, 4, 5, 6, 7]},
    {"chat_id": 2, "parent_chat_id": 1, "timestamp": 30.5, "input_length": 150, "output_length": 4, "type": "text",
     "turn": 2, "hash_ids": [1, 2, 3, 4, 5, 6, 8, 9, 10, 11]},
]


def test_bailian_traces_parse_with_their_own_block_size_and_seconds(tmp_path: Path) -> None:
    first, second = load_trace(_write(tmp_path / "b.jsonl", BAILIAN))
    assert (first.hash_block_tokens, second.timestamp_ms, second.arrival_s) == (16, 30500.0, 30.5)
    a, b = prompt_token_ids(first), prompt_token_ids(second)
    assert (len(a), len(b)) == (100, 150)
    assert a[:96] == b[:96] and a[96] != b[96]  # the sixth block is the last they share
    assert b[96:112] == TokenExpander().block(8)[:16]
    mooncake_in_16 = {"timestamp": 2, "input_length": 40, "output_length": 1, "hash_ids": [5, 6, 7]}
    (req,) = load_trace(_write(tmp_path / "m.jsonl", [mooncake_in_16]), hash_block_tokens=16, time_unit="s")
    assert (req.hash_block_tokens, req.timestamp_ms, len(prompt_token_ids(req))) == (16, 2000.0, 40)
    with pytest.raises(ValueError, match="in 512-token blocks .*--trace-block-tokens"):
        load_trace(tmp_path / "m.jsonl")
    with pytest.raises(ValueError, match="blocks of 4..512"):
        load_trace(tmp_path / "m.jsonl", hash_block_tokens=2)


def test_a_bailian_trace_replays_its_shared_turns_as_hits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path / "b.jsonl", BAILIAN)
    assert main(["--trace", str(path), "--policy", "none", "all", "--kv-unbounded", "--state-checkpoints", "64"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["hit_rate"] == pytest.approx({"none": 0.0, "all": 96 / 250}, abs=1e-6)
    with pytest.raises(SystemExit) as e:  # read in another block size than it was hashed in: an error, exit 2
        main(["--trace", str(path), "--trace-block-tokens", "512", "--policy", "all", "--kv-unbounded",
              "--state-checkpoints", "8"])
    assert e.value.code == 2 and "7 hash ids for input_length 100 in 512-token blocks" in capsys.readouterr().err



def test_both_trace_formats_parse_and_sort_by_timestamp(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]},
        {"timestamp": 1, "prompt_token_ids": [4, 5, 6], "output_length": 2, "segment_boundaries": [2]},
        {"timestamp": 5, "input_length": 512, "output_length": 1, "hash_ids": [0]},
    ]
    trace = load_trace(_write(tmp_path / "t.jsonl", rows))
    assert [r.index for r in trace] == [1, 0, 2]
    recap_req, mooncake_req, one_block = trace
    assert recap_req.token_ids == (4, 5, 6) and recap_req.segment_boundaries == (2,)
    assert prompt_token_ids(recap_req) == [4, 5, 6]
    assert mooncake_req.hash_ids == (0, 1) and mooncake_req.num_prompt_tokens == 600
    assert len(prompt_token_ids(mooncake_req)) == 600
    assert prompt_token_ids(one_block) == prompt_token_ids(mooncake_req)[:512]
    assert len(load_trace(tmp_path / "t.jsonl", limit=2)) == 2


@pytest.mark.parametrize(
    "row, message",
    [
        ({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0]}, "hash ids"),
        ({"timestamp": 0, "output_length": 1}, "neither"),
        ({"timestamp": 0, "prompt_token_ids": [1]}, "output_length"),
    ],
)
def test_bad_trace_lines_are_errors(tmp_path: Path, row: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_trace(_write(tmp_path / "bad.jsonl", [row]))


def test_shared_trace_parses_if_present() -> None:
    path = Path("/work/shared/traces/synthetic_trace.jsonl")
    if not path.exists():
        pytest.skip("shared trace not mounted")
    trace = load_trace(path, limit=50)
    assert len(trace) == 50 and all(r.hash_ids for r in trace)
    assert [r.timestamp_ms for r in trace] == sorted(r.timestamp_ms for r in trace)


# -- budgets ---------------------------------------------------------------------------------------


def test_budgets_parse_and_translate() -> None:
    assert parse_bytes("72GB") == 72 * 10**9
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("1.5 MB") == 1_500_000
    assert parse_bytes("512") == 512
    for bad in ("12 parsecs", "GB", "-1GB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    shape = get_shape("hybrid-7b")
    assert shape.kv_bytes_per_token == 64 * 1024
    assert round(shape.state_bytes_per_slot / 1e6, 1) == 26.8
    assert kv_blocks_for_bytes(shape, parse_bytes("72GB"), 16) == 72 * 10**9 // (64 * 1024 * 16) + 1
    assert state_slots_for_bytes(shape, parse_bytes("8GB")) == 298


def _args(trace: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_replay_parser(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["replay", "--trace", str(trace), *extra])


def test_state_checkpoints_reserve_running_slots_and_kv_unbounded_covers_the_trace(tmp_path: Path) -> None:
    rows = [{"timestamp": i, "prompt_token_ids": list(range(100)), "output_length": 20} for i in range(3)]
    path = _write(tmp_path / "t.jsonl", rows)
    trace = load_trace(path)
    args = _args(path, "--kv-unbounded", "--state-checkpoints", "10", "--max-num-seqs", "4")
    setup = build_setup(args, trace)
    assert setup.num_state_slots == 14
    assert setup.num_kv_blocks == unbounded_kv_blocks(trace, 16, 4) >= 3 * 8 + 1
    assert setup.scheduler.max_model_len == 120
    bytes_setup = build_setup(_args(path, "--kv-cache-bytes", "1GiB", "--state-cache-bytes", "1GB"), trace)
    assert bytes_setup.num_kv_blocks == 2**30 // (64 * 1024 * 16) + 1
    assert bytes_setup.num_state_slots == 10**9 // get_shape("hybrid-7b").state_bytes_per_slot


# -- replay through the real scheduler -------------------------------------------------------------

X, Y, Z, W = (list(range(base, base + n)) for base, n in ((1000, 64), (2000, 32), (3000, 32), (4000, 32)))


def _xyz_trace(tmp_path: Path, segments: bool = False) -> Path:
    """A = X+Y, B = X+Z, C = X+W, D = A again; 96-token prompts, each arriving after the last finished."""
    prompts = [X + Y, X + Z, X + W, X + Y]
    rows = [
        {
            "timestamp": 10_000 * i,
            "prompt_token_ids": p,
            "output_length": 2,
            **({"segment_boundaries": [64]} if segments else {}),
        }
        for i, p in enumerate(prompts)
    ]
    return _write(tmp_path / "xyz.jsonl", rows)


# Hit per request (A, B, C, D), 16-token blocks. The prompt end of a 96-token prompt is 80.
# none: nothing. align: only D, from A's prompt end at 80 (B and C diverge at 64).
# all: B and C at 64 (A checkpointed every boundary), D at 80.
# recap: B's KV hit (64) runs past its checkpoint hit (0): it learns the branch point 64, so C hits 64.
# recap with a segment boundary at 64: A already checkpoints 64, so B hits too.
EXPECTED = {
    "none": [0, 0, 0, 0],
    "align": [0, 0, 0, 80],
    "all": [0, 64, 64, 80],
    "recap": [0, 0, 64, 80],
    "recap:no-branch": [0, 0, 0, 80],
}


@pytest.mark.parametrize("policy", sorted(EXPECTED))
def test_tiny_trace_gives_the_hand_computed_hit_rate(tmp_path: Path, policy: str) -> None:
    path = _xyz_trace(tmp_path)
    trace = load_trace(path)
    setup = build_setup(_args(path, "--kv-unbounded", "--state-checkpoints", "64"), trace)
    res = replay(trace, policy, setup, check_integrity=True)
    hits = EXPECTED[policy]
    assert res.requests == 4 and res.prompt_tokens == 4 * 96
    assert res.cached_tokens == sum(hits)
    assert res.hit_rate == pytest.approx(sum(hits) / 384)
    assert res.prefill_flops_saved == pytest.approx(sum(setup.shape.prefill_flops(0, n) for n in hits))
    assert (res.checkpoints_created == 0) == (policy == "none")


def test_segment_boundaries_give_a_hit_on_the_second_sharing_request(tmp_path: Path) -> None:
    path = _xyz_trace(tmp_path, segments=True)
    trace = load_trace(path)
    setup = build_setup(_args(path, "--kv-unbounded", "--state-checkpoints", "64"), trace)
    assert replay(trace, "recap", setup, check_integrity=True).cached_tokens == 64 + 64 + 80


def test_mooncake_trace_replays_with_hits_at_the_shared_512_blocks(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1300, "output_length": 3, "hash_ids": [0, 1, 2]},
        {"timestamp": 60_000, "input_length": 1400, "output_length": 3, "hash_ids": [0, 1, 3]},
        {"timestamp": 120_000, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 4]},
    ]
    path = _write(tmp_path / "m.jsonl", rows)
    trace = load_trace(path)
    setup = build_setup(_args(path, "--kv-unbounded", "--state-checkpoints", "400"), trace)
    assert replay(trace, "all", setup).cached_tokens == 1024 + 1024
    assert replay(trace, "recap", setup, check_integrity=True).cached_tokens == 1024  # branch learnt by the 2nd
    assert replay(trace, "align", setup).cached_tokens == 0  # prompt ends sit in the unshared last block


def test_cli_prints_a_table_and_a_final_json_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _xyz_trace(tmp_path)
    out_json = tmp_path / "out.json"
    argv = ["--trace", str(path), "--policy", "none", "all", "recap:interval=2"]
    argv += ["--kv-unbounded", "--state-checkpoints", "64", "--json-out", str(out_json)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["hit_rate"] == pytest.approx(
        {"none": 0.0, "all": 208 / 384, "recap:interval=2": 208 / 384}, abs=1e-6
    )
    assert [r["policy"] for r in summary["results"]] == ["none", "all", "recap:interval=2"]
    assert any(line.startswith("| recap:interval=2") for line in lines)
    assert json.loads(out_json.read_text())["hit_rate"] == summary["hit_rate"]


def test_cli_check_integrity_checks_every_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from recap.core.scheduler import Scheduler

    checked = []
    original = Scheduler.check_integrity
    monkeypatch.setattr(Scheduler, "check_integrity", lambda self: checked.append(1) or original(self))
    argv = ["--trace", str(_xyz_trace(tmp_path)), "--policy", "recap", "--kv-unbounded", "--state-checkpoints", "8"]
    assert main(argv) == 0 and not checked
    assert main([*argv, "--check-integrity"]) == 0 and len(checked) > 3


def test_policy_specs_parse_and_reject_typos() -> None:
    spec = parse_policy("recap:interval=32,geometric,no-branch,ladder=3,end-grid=256,no-tail")
    got = (spec.interval, spec.geometric, spec.branch, spec.ladder, spec.end_grid, spec.tail)
    assert got == (32, True, False, 3, 256, False)
    assert parse_policy("align:kv-lru").kv_lru
    assert parse_policy("align").cache_config(16).checkpoint_policy == "align"
    for bad in ("lru", "recap:interval=0", "recap:fast", "align:geometric", "recap:evict=lru", "recap:ladder=x"):
        with pytest.raises(ValueError):
            parse_policy(bad)


def test_branch_point_outlives_deeper_one_shot_checkpoints(tmp_path: Path) -> None:
    """B learns the branch point X (64); three unrelated requests then churn a 4-slot pool; D shares X."""
    others = [list(range(10_000 * k, 10_000 * k + 96)) for k in range(1, 4)]
    prompts = [X + Y, X + Z, X + W, *others, X + list(range(5000, 5032))]
    rows = [{"timestamp": 10_000 * i, "prompt_token_ids": p, "output_length": 2} for i, p in enumerate(prompts)]
    path = _write(tmp_path / "churn.jsonl", rows)
    trace = load_trace(path)
    setup = build_setup(_args(path, "--kv-unbounded", "--state-checkpoints", "3", "--max-num-seqs", "1"), trace)
    assert setup.num_state_slots == 4
    hits = replay(trace, "recap", setup, check_integrity=True).cached_tokens
    # C and D hit the branch point B learned: its evidence (observed sharing, then C's hit) triples its
    # value, so the prompt ends and snapshots of the unrelated requests (deeper, never shared) go first.
    # (GreedyDual ages it out eventually: with four unrelated requests it is gone, by design.)
    assert hits == 64 + 64


def test_offline_bounds_on_the_tiny_trace(tmp_path: Path) -> None:
    trace = load_trace(_xyz_trace(tmp_path))
    ivs = reuse_intervals(trace, 16)
    assert [(iv.start, iv.end, iv.tokens) for iv in ivs] == [(0, 1, 64), (1, 2, 64), (0, 3, 80)]
    assert ivs[0].key == ivs[1].key != ivs[2].key
    assert oracle_hits(ivs, len(trace), capacity=8) == 64 + 64 + 80  # = the unlimited bound
    assert oracle_hits(ivs, len(trace), capacity=1) == 64 + 64  # one slot: X@64 (held 0..2) beats X+Y@80


def test_default_shape_is_sized_like_the_model_runner() -> None:
    torch = pytest.importorskip("torch")
    from recap.model.config import load_config
    from recap.model.default_model import ensure_random_model

    shape = get_shape("default")
    cfg = load_config(ensure_random_model())
    assert shape.state_bytes_per_slot == cfg.state_bytes_per_slot(torch.float32) > 0
    assert shape.kv_bytes_per_token == cfg.kv_bytes_per_token(torch.float32) > 0
    assert shape.num_attention_layers == len(cfg.attention_layers)


def test_requests_that_cannot_fit_the_kv_pool_are_counted_as_rejected(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "prompt_token_ids": list(range(96)), "output_length": 2},  # 7 blocks: never fits
        {"timestamp": 1, "prompt_token_ids": list(range(20)), "output_length": 2},  # 2 blocks
    ]
    path = _write(tmp_path / "big.jsonl", rows)
    trace = load_trace(path)
    setup = build_setup(_args(path, "--kv-cache-bytes", "2MiB", "--state-checkpoints", "4"), trace)
    assert setup.num_kv_blocks == 3  # 2 MiB = 2 blocks of 16 x 64 KiB, plus the null block
    res = replay(trace, "recap", setup, check_integrity=True)
    assert (res.requests, res.rejected, res.prompt_tokens) == (1, 1, 20)


def test_kv_bounds_lru_loses_what_foresight_keeps(tmp_path: Path) -> None:
    """A = X + a, B unrelated (one chain as long as A), C = X + c; a KV cache of 3 blocks of 4 tokens."""
    x, a, c = list(range(8)), [100, 101, 102, 103], [200, 201, 202, 203]
    prompts = [x + a, list(range(300, 312)), x + c]
    rows = [{"timestamp": i, "prompt_token_ids": p, "output_length": 1} for i, p in enumerate(prompts)]
    trace = load_trace(_write(tmp_path / "kv.jsonl", rows))
    # LRU: B's three blocks push out all of A, so C finds nothing.
    assert kv_lru_hits(trace, 12, block_size=4) == 0
    # Belady: A's tail block and B's deeper blocks are never used again; X's two blocks wait for C.
    assert kv_belady_hits(trace, 12, block_size=4) == 8
    assert kv_lru_hits(trace, 24, block_size=4) == kv_belady_hits(trace, 24, block_size=4) == 8


# -- lower tiers (recap/bench/replay_tiers.py) ------------------------------------------------------
# The xyz trace under `align` with one checkpoint's worth of slots (+ one running): B's prompt end evicts
# A's, C's evicts B's, so D (= A) misses in the read pool alone; a tier that kept A's checkpoint serves it.


def _tiered(path: Path, *extra: str) -> tuple[list, object]:
    trace = load_trace(path)
    base = ("--kv-unbounded", "--state-checkpoints", "1", "--max-num-seqs", "1")
    return trace, build_setup(_args(path, *base, *extra), trace)


def test_a_tier_serves_the_hit_the_read_pool_alone_lost(tmp_path: Path) -> None:
    trace, read_pool_only = _tiered(_xyz_trace(tmp_path))
    assert replay(trace, "align", read_pool_only, check_integrity=True).cached_tokens == 0
    _, tiered = _tiered(_xyz_trace(tmp_path), "--disk-cache-bytes", "1GB")
    res = replay(trace, "align", tiered, check_integrity=True)
    assert res.cached_tokens == 80  # D hits A's prompt end, promoted from the disk tier
    assert res.tiers is not None and res.tiers["requests_promoted"] == 1 and res.tiers["tier_hit_tokens"] == 80
    (disk,) = res.tiers["tiers"]
    assert disk["name"] == "disk" and disk["demotions"] == 3 and disk["promoted_entries"] == 1  # A, B, C; then A


def test_a_tier_keeps_no_more_than_its_byte_budget(tmp_path: Path) -> None:
    slot = get_shape("hybrid-7b").state_bytes_per_slot
    trace, one = _tiered(_xyz_trace(tmp_path), "--disk-cache-bytes", str(slot))
    res = replay(trace, "align", one, check_integrity=True)
    (disk,) = res.tiers["tiers"]  # type: ignore[index]
    assert disk["entries"] == 1 and disk["peak_bytes"] == disk["bytes"] == slot and disk["evictions"] == 2
    assert res.cached_tokens == 0  # A's checkpoint went (LRU) to make room for B's, then C's
    _, two = _tiered(_xyz_trace(tmp_path), "--disk-cache-bytes", str(2 * slot))
    assert replay(trace, "align", two, check_integrity=True).cached_tokens == 80


def test_the_copy_from_a_tier_enters_the_modelled_ttft(tmp_path: Path) -> None:
    slot = get_shape("hybrid-7b").state_bytes_per_slot
    trace, slow = _tiered(_xyz_trace(tmp_path), "--host-cache-bytes", "1GB", "--host-bandwidth", "0.5")
    _, fast = _tiered(_xyz_trace(tmp_path), "--host-cache-bytes", "1GB", "--host-bandwidth", "50")
    a, b = replay(trace, "align", slow), replay(trace, "align", fast)
    assert a.cached_tokens == b.cached_tokens == 80
    assert a.tiers["mean_copy_s"] == pytest.approx(slot / 0.5e9)  # type: ignore[index]
    assert b.tiers["mean_copy_s"] == pytest.approx(slot / 50e9)  # type: ignore[index]
    # only D waited for a copy: the mean over 4 requests moves by a quarter of the difference
    assert a.mean_ttft_s - b.mean_ttft_s == pytest.approx((slot / 0.5e9 - slot / 50e9) / 4)
