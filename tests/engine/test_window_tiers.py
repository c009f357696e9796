"""Cache tiers for models with sliding-window attention layers, end to end: LFM3 (short convs, full and
sliding-window attention; a window of 40 tokens, so a hit needs the 3 window blocks before it) and
RecurrentGemma (RG-LRU and local attention only: no full-attention group; a window of 24 tokens, 2 blocks).
Conversations through read pools too small to keep them hit from the host tier, the disk tier, or host above
disk, window blocks included, with tokens equal to an uncached run; a restarted LLM resumes from disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from recap import LLM
from recap.core.output import TierLoad
from recap.core.tier_index import EntryKind
from recap.engine.output_processor import child_id
from recap.engine.outputs import RequestOutput
from tests.engine.conftest import tiny_model_dir
from tests.engine.test_disk_tier import NUM_CONVS, TURNS, conversations, make
from tests.engine.test_equivalence import assert_same
from tests.engine.test_host_tier import record_loads
from tests.engine.workloads import rnd

MODELS = {
    "lfm3": {"layer_types": ["conv", "sliding_attention", "full_attention", "conv"], "sliding_window": 40},
    "recurrent_gemma": {"attention_window_size": 24},
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("wtier"), request.param, **MODELS[request.param])


_SIZES: dict[Path, tuple[int, int]] = {}
_REF: dict[Path, list[RequestOutput]] = {}


def sizes(path: Path) -> tuple[int, int]:
    """(bytes of one block of both attention groups, of one state slot): the pools and tiers are sized in them."""
    if path not in _SIZES:
        llm = make(path, None, caching=False)
        runner = llm.engine.runner
        assert runner.window_bytes_per_token > 0
        _SIZES[path] = (runner.kv_bytes_per_token + runner.window_bytes_per_token) * 16, runner.state_bytes_per_slot
        llm.close()
    return _SIZES[path]


def reference(path: Path) -> list[RequestOutput]:
    if path not in _REF:
        llm = make(path, None, caching=False)
        _REF[path] = conversations(llm)
        llm.close()
    return _REF[path]


def tiered(path: Path, cache_dir: Path | None, **kw: object) -> LLM:
    kw.setdefault("kv_cache_bytes", 9 * sizes(path)[0])
    return make(path, cache_dir, sizes=sizes(path), **kw)


def window_loads(loads: list[TierLoad]) -> list[tuple[int, ...]]:
    """The tiers each load read window blocks from (one entry per window block)."""
    return [tuple(level for key, _, level in ld.entries() if key.kind == EntryKind.WINDOW) for ld in loads]


@pytest.mark.parametrize("tiers", ["host", "disk", "host+disk"])
def test_window_model_hits_from_the_tiers_equal_uncached(model: Path, tmp_path: Path, tiers: str) -> None:
    """Read pools of 9 blocks per attention group and 4 state slots hold about two of the four conversations; a
    host tier alone of 40 blocks, a disk tier alone, or a host tier of 2 blocks and a slot above disk."""
    block, slot = sizes(model)
    kw: dict[str, object] = {"cache_host_bytes": (40 * block + 4 * slot) if tiers == "host" else (2 * block + slot)}
    llm = tiered(model, tmp_path if "disk" in tiers else None, **(kw if "host" in tiers else {}))
    loads = record_loads(llm)
    got = conversations(llm)
    assert_same(got, reference(model), f"{tiers} tier")
    indexes = llm.engine.scheduler.tiers.indexes  # type: ignore[union-attr]
    assert [t.name for t in indexes] == tiers.split("+")
    levels = window_loads(loads)
    assert sum(1 for lv in levels if lv) > len(loads) // 2, f"few loads read window blocks: {levels}"
    for level, index in enumerate(indexes):
        assert index.counters.promotions > 0, f"no hit came from the {index.name} tier"
        assert any(level in lv for lv in levels), f"no window block was read from the {index.name} tier"
        assert index.num_bytes <= index.budget_bytes
    if tiers == "host+disk":
        assert any(len(set(lv)) > 1 for lv in levels), "no load read window blocks from both tiers"
    promoted = {ld.request_id for ld in loads}
    hits = sum(o.num_cached_tokens for o in got)
    tier_hits = sum(o.num_cached_tokens for o in got if child_id(o.request_id, 0) in promoted)
    assert tier_hits > hits // 2, f"most hit tokens should need a lower tier: {tier_hits} of {hits}"
    store = llm.engine.runner.tier
    assert store is not None
    if store.host is not None:  # the core's entry bytes are the rows' bytes, window entries included
        assert store.host.stats.bytes == indexes[0].num_bytes and store.host.stats.entries == indexes[0].num_entries
    if "disk" in tiers:
        assert store.stats.files_read > 0
        assert any(p.name.startswith("win-") for p in tmp_path.rglob("*.rtier")), "no window block file"
    if tiers == "disk":
        assert indexes[0].counters.loaded_bytes == store.stats.bytes_read > 0
    llm.close()
    if tiers == "disk":
        without = make(model, None, sizes=sizes(model), kv_cache_bytes=9 * block)
        assert hits > sum(o.num_cached_tokens for o in conversations(without)), "the tiers added no hit"
        without.close()


def test_window_model_restart_resumes_from_disk(model: Path, tmp_path: Path) -> None:
    """Two turns, a clean close (the read pools' window blocks are flushed to disk too), a new LLM on the same
    directory: the third turn hits its history from disk, window blocks and all."""
    hist = [rnd(100 + c, 40) for c in range(NUM_CONVS)]
    llm = tiered(model, tmp_path)
    before = conversations(llm, range(TURNS - 1), hist)
    llm.close()
    del llm
    llm = tiered(model, tmp_path)
    store = llm.engine.runner.tier
    assert store is not None and any(k.kind == EntryKind.WINDOW for k in store.scan()), "no window file survived"
    loads = record_loads(llm)
    prompts = [list(h) for h in hist]
    after = conversations(llm, range(TURNS - 1, TURNS), hist)
    assert_same(before + after, reference(model), "restart")
    for o, p in zip(after, prompts):
        prev = len(p) - 9 - 1  # the previous turn's prompt and output but its last token (9 new tokens follow)
        assert o.num_cached_tokens >= prev // 16 * 16 - 16, f"hit {o.num_cached_tokens} of a {len(p)}-token history"
    assert any(window_loads(loads)), "no window block was read from disk after the restart"
    tiers = llm.engine.scheduler.tiers
    assert tiers is not None and tiers.tier("disk").counters.promotions > 0
    llm.close()
