"""The disk tier end to end: cached = uncached when hits come from disk, faults (flipped byte, truncated file,
another model's file, a budget of a few blocks, an unwritable directory) give the right tokens and say so in
the counters, and a restarted LLM on the same directory resumes a conversation without re-prefilling it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from recap import LLM
from recap.engine.outputs import RequestOutput
from recap.server.metrics import EngineCollector
from recap.server.vllm_metrics import VllmCollector
from tests.engine.conftest import tiny_model_dir
from tests.engine.test_equivalence import assert_same
from tests.engine.workloads import GREEDY, rnd

NUM_CONVS, TURNS = 4, 3


@pytest.fixture(scope="module")
def bamba(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("tier"), "bamba")


@pytest.fixture(scope="module")
def sizes(bamba: Path) -> tuple[int, int]:
    runner = make(bamba, None, caching=False).engine.runner
    return runner.kv_bytes_per_token * 16, runner.state_bytes_per_slot


def make(path: Path, cache_dir: Path | None, caching: bool = True, sizes: tuple[int, int] | None = None,
         **kw: object) -> LLM:  # fmt: skip
    """Read pools too small for more than one conversation at a time: later turns hit from disk."""
    opts: dict[str, object] = {"block_size": 16, "max_model_len": 128, "check_integrity": True, "seed": 0,
                               "max_num_seqs": 2, **kw}  # fmt: skip
    if sizes is not None:
        opts.setdefault("kv_cache_bytes", 14 * sizes[0])
        opts.setdefault("state_cache_bytes", 4 * sizes[1])
    if cache_dir is not None:
        opts["cache_dir"] = str(cache_dir)
    return LLM(str(path), enable_prefix_caching=caching, checkpoint_policy="recap", **opts)  # type: ignore[arg-type]


def conversations(llm: LLM, turns: range = range(TURNS), hist: list[list[int]] | None = None) -> list[RequestOutput]:
    """NUM_CONVS conversations, one turn of each in turn: each evicts the others from the tiny read pools."""
    hist = hist if hist is not None else [rnd(100 + c, 40) for c in range(NUM_CONVS)]
    outs = []
    for turn in turns:
        for c in range(NUM_CONVS):
            o = llm.generate([hist[c]], GREEDY)[0]
            outs.append(o)
            hist[c] = hist[c] + o.outputs[0].token_ids + rnd(1000 * turn + c, 9)
    return outs


_REF: dict[str, list[RequestOutput]] = {}


def reference(path: Path) -> list[RequestOutput]:
    if "ref" not in _REF:
        _REF["ref"] = conversations(make(path, None, caching=False))
    return _REF["ref"]


def tier_stats(llm: LLM) -> tuple[object, object]:
    tiers, store = llm.engine.scheduler.tiers, llm.engine.runner.tier
    assert tiers is not None and store is not None
    return tiers.tier("disk").counters, store.stats


def test_hits_from_disk_equal_uncached(bamba: Path, sizes: tuple[int, int], tmp_path: Path) -> None:
    llm = make(bamba, tmp_path, sizes=sizes)
    got = conversations(llm)
    assert_same(got, reference(bamba), "disk tier")
    counters, store = tier_stats(llm)
    assert counters.promotions > 0 and store.files_read > 0, "no hit came from disk"
    assert sum(o.num_cached_tokens for o in got[NUM_CONVS:]) > 0
    snap = llm.engine.metrics_snapshot()
    assert snap.tier.promotions == counters.promotions and snap.tier_entries > 0 and snap.tier_bytes > 0
    collector = EngineCollector(SimpleNamespace(metrics=lambda: snap), "m", {})  # type: ignore[arg-type]
    series = {m.name: m.samples[0].value for m in collector.collect() if m.samples}
    assert series["recap:disk_tier_promotions"] == counters.promotions and series["recap:disk_tier_entries"] > 0
    # bytes moved each way, also under vLLM's offloading names: what was promoted is what the store read
    assert counters.loaded_bytes == store.bytes_read == snap.offload_load_bytes > 0
    assert series["recap:disk_tier_load_bytes"] == counters.loaded_bytes
    assert series["recap:disk_tier_store_bytes"] == counters.stored_bytes == snap.offload_store_bytes > 0
    vllm = {m.name: m.samples[0].value for m in VllmCollector(SimpleNamespace(metrics=lambda: snap), "m", {}).collect()
            if m.samples}  # fmt: skip
    assert vllm["vllm:kv_offload_load_bytes"] == counters.loaded_bytes
    assert vllm["vllm:kv_offload_store_bytes"] == counters.stored_bytes
    no_tier = conversations(make(bamba, None, sizes=sizes))
    assert sum(o.num_cached_tokens for o in got) > sum(o.num_cached_tokens for o in no_tier)
    llm.close()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.rtier"))


@pytest.mark.parametrize("fault", ["flip", "truncate", "foreign"])
def test_bad_files_are_rejected_and_recomputed(bamba: Path, sizes: tuple[int, int], tmp_path: Path,
                                               fault: str) -> None:  # fmt: skip
    llm = make(bamba, tmp_path, sizes=sizes)
    hist = [rnd(100 + c, 40) for c in range(NUM_CONVS)]
    first = conversations(llm, range(1), hist)
    llm.close()
    files = _files(tmp_path)
    assert files
    for f in files:
        data = bytearray(f.read_bytes())
        if fault == "flip":
            data[len(data) // 2] ^= 0x10
            f.write_bytes(bytes(data))
        elif fault == "truncate":
            f.write_bytes(bytes(data[: len(data) - 7]))
    if fault == "foreign":  # another model (its config differs by a byte): its identity, its directory
        other_model = tmp_path / "other_model"
        shutil.copytree(bamba, other_model)
        with open(other_model / "config.json", "a") as f:
            f.write("\n")
        other = make(other_model, tmp_path, sizes=sizes)
        assert other.engine.runner.tier is not None
        assert other.engine.runner.tier.disk is not None
        foreign_dir = other.engine.runner.tier.disk.dir
        other.close()
        for f in files:  # our files, moved where the other model looks
            os.replace(f, foreign_dir / f.name)
        llm = make(other_model, tmp_path, sizes=sizes)
    else:
        llm = make(bamba, tmp_path, sizes=sizes)
    rest = conversations(llm, range(1, TURNS), hist)
    if fault != "foreign":
        assert_same(first + rest, reference(bamba), fault)
    counters, store = tier_stats(llm)
    assert store.rejected_files > 0  # a truncated or foreign file already at the scan, a flipped byte when read
    assert counters.promotions_failed > 0 or fault != "flip"
    llm.close()


def test_restart_resumes_from_disk(bamba: Path, sizes: tuple[int, int], tmp_path: Path) -> None:
    """Serve two turns, stop, start a new LLM on the same directory: the third turn hits its whole history."""
    hist = [rnd(100 + c, 40) for c in range(NUM_CONVS)]
    llm = make(bamba, tmp_path, sizes=sizes)
    before = conversations(llm, range(TURNS - 1), hist)
    llm.close()
    del llm
    llm = make(bamba, tmp_path, sizes=sizes)
    prompts = [list(h) for h in hist]
    after = conversations(llm, range(TURNS - 1, TURNS), hist)
    assert_same(before + after, reference(bamba), "restart")
    for o, p in zip(after, prompts):
        prev = len(p) - 9 - 1  # the previous turn's prompt and output but its last token (9 new tokens follow)
        assert o.num_cached_tokens >= prev // 16 * 16 - 16, f"hit {o.num_cached_tokens} of a {len(p)}-token history"
    counters, store = tier_stats(llm)
    assert counters.promotions > 0 and store.files_read > 0
    llm.close()


def test_budget_of_a_few_blocks(bamba: Path, sizes: tuple[int, int], tmp_path: Path) -> None:
    llm = make(bamba, tmp_path, sizes=sizes, cache_disk_bytes=3 * sizes[0] + sizes[1])
    assert_same(conversations(llm), reference(bamba), "tiny disk budget")
    tiers = llm.engine.scheduler.tiers
    assert tiers is not None and tiers.tier("disk").num_bytes <= 3 * sizes[0] + sizes[1]
    assert tiers.tier("disk").counters.evictions > 0
    llm.close()
    on_disk = sum(f.stat().st_size for f in _files(tmp_path))
    assert on_disk <= 3 * sizes[0] + sizes[1] + 4096 * 4, "files beyond the budget stayed on disk"


def test_unwritable_directory_turns_the_tier_off(bamba: Path, sizes: tuple[int, int], tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    llm = make(bamba, blocker / "cache", sizes=sizes)
    assert_same(conversations(llm), reference(bamba), "unwritable directory")
    tiers = llm.engine.scheduler.tiers
    assert tiers is not None and not tiers.enabled and tiers.tier("disk").num_entries == 0
    llm.close()
