"""The host-memory tier end to end, alone and above the disk tier: cached = uncached when most hits come from
the lower tiers, entries moving host -> disk, and a hit whose KV and state come from different tiers."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from recap.core.output import TierLoad
from recap.engine.output_processor import child_id
from recap.runner.disk_tier import DiskTier
from recap.server.metrics import EngineCollector
from tests.core.helpers import record_loads as record_tier_loads
from tests.engine.test_disk_tier import NUM_CONVS, TURNS, bamba, conversations, make, reference, sizes  # noqa: F401
from tests.engine.test_equivalence import assert_same
from tests.engine.workloads import rnd


def record_loads(llm: object) -> list[TierLoad]:
    """Every load the engine's core plans, as it plans it."""
    return record_tier_loads(llm.engine.scheduler.tiers)  # type: ignore[attr-defined]


def test_host_tier_alone_equals_uncached(bamba: Path, sizes: tuple[int, int]) -> None:  # noqa: F811
    llm = make(bamba, None, sizes=sizes, cache_host_bytes=40 * sizes[0] + 8 * sizes[1])
    got = conversations(llm)
    assert_same(got, reference(bamba), "host tier")
    tiers, store = llm.engine.scheduler.tiers, llm.engine.runner.tier
    assert tiers is not None and store is not None and store.host is not None and store.disk is None
    host = tiers.tier("host")
    assert host.counters.promotions > 0 and store.host.stats.entries_read > 0
    assert store.host.stats.bytes == host.num_bytes and store.host.stats.entries == host.num_entries
    snap = llm.engine.metrics_snapshot()
    assert snap.host_tier.promotions == host.counters.promotions and snap.host_tier_bytes == host.num_bytes
    assert snap.offload_load_bytes == host.counters.loaded_bytes > 0 and snap.offload_store_bytes > 0
    collector = EngineCollector(SimpleNamespace(metrics=lambda: snap), "m", {})  # type: ignore[arg-type]
    series = {m.name: m.samples[0].value for m in collector.collect() if m.samples}
    assert series["recap:host_tier_promotions"] == host.counters.promotions and series["recap:host_tier_entries"] > 0
    llm.close()


@pytest.mark.parametrize("host_blocks", [3, 8])
def test_host_then_disk_equals_uncached(bamba: Path, sizes: tuple[int, int], tmp_path: Path,  # noqa: F811
                                        host_blocks: int) -> None:  # fmt: skip
    """A host tier of a few blocks and checkpoints: it fills, moves its LRU entries to disk, and hits read from both
    (in one load too: KV from one tier, the checkpoint from the other)."""
    llm = make(bamba, tmp_path, sizes=sizes, cache_host_bytes=host_blocks * sizes[0] + sizes[1])
    loads = record_loads(llm)
    got = conversations(llm)
    assert_same(got, reference(bamba), f"host tier of {host_blocks} blocks, then disk")
    tiers, store = llm.engine.scheduler.tiers, llm.engine.runner.tier
    assert tiers is not None and store is not None and store.host is not None and store.disk is not None
    host, disk = tiers.tier("host"), tiers.tier("disk")
    assert host.counters.evictions > 0 and disk.counters.demotions > 0, "nothing moved host -> disk"
    assert host.counters.promotions > 0 and disk.counters.promotions > 0 and store.stats.files_read > 0
    mixed = [ld for ld in loads if len(set(ld.levels)) > 1]
    assert mixed, "no load read from both tiers"
    promoted = {ld.request_id for ld in loads}
    hits = sum(o.num_cached_tokens for o in got)
    tier_hits = sum(o.num_cached_tokens for o in got if child_id(o.request_id, 0) in promoted)
    assert tier_hits > hits // 2, f"most hit tokens should need a lower tier: {tier_hits} of {hits}"
    llm.close()


def test_hits_do_not_depend_on_how_fast_the_disk_writes(bamba: Path, sizes: tuple[int, int], tmp_path: Path,  # noqa: F811
                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A load ordered after a save reads it (the disk store's one FIFO thread): a disk far behind on its writes
    plans the very loads, from the very tiers, that a fast one does, and gives the same tokens."""

    def run(cache_dir: Path) -> tuple[list[object], list[tuple[str, tuple[object, ...], tuple[int, ...]]]]:
        llm = make(bamba, cache_dir, sizes=sizes, cache_host_bytes=3 * sizes[0] + sizes[1])
        loads = record_loads(llm)
        got = conversations(llm)
        llm.close()
        return got, [(ld.request_id, tuple(k for k, _, _ in ld.entries()), ld.levels) for ld in loads]

    fast, fast_loads = run(tmp_path / "fast")
    write = DiskTier._write

    def slow_write(self: DiskTier, *args: object) -> None:
        time.sleep(0.01)
        write(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DiskTier, "_write", slow_write)
    slow, slow_loads = run(tmp_path / "slow")
    assert_same(slow, fast, "a slow disk")
    assert slow_loads == fast_loads and any(len(set(levels)) > 1 for _, _, levels in slow_loads)


def test_restart_finds_what_the_host_tier_held(bamba: Path, sizes: tuple[int, int], tmp_path: Path) -> None:  # noqa: F811
    """The host tier ends with the process: a clean close copies it (and the read pools) to disk, so a restarted
    LLM resumes every conversation from disk."""
    hist = [rnd(100 + c, 40) for c in range(NUM_CONVS)]
    llm = make(bamba, tmp_path, sizes=sizes, cache_host_bytes=30 * sizes[0] + 6 * sizes[1])
    before = conversations(llm, range(TURNS - 1), hist)
    llm.close()
    del llm
    llm = make(bamba, tmp_path, sizes=sizes, cache_host_bytes=30 * sizes[0] + 6 * sizes[1])
    prompts = [list(h) for h in hist]
    after = conversations(llm, range(TURNS - 1, TURNS), hist)
    assert_same(before + after, reference(bamba), "restart with a host tier")
    for o, p in zip(after, prompts):
        prev = len(p) - 9 - 1
        assert o.num_cached_tokens >= prev // 16 * 16 - 16, f"hit {o.num_cached_tokens} of a {len(p)}-token history"
    tiers = llm.engine.scheduler.tiers
    assert tiers is not None and tiers.tier("disk").counters.promotions > 0
    llm.close()
