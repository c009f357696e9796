"""The disk tier's file format and store without a model: a file round-trips bit-exactly, and a flipped byte,
a truncated file, another identity's file or another entry's file is rejected; writes leave no temporary file;
the host and disk stores together (tier_stores.py): an entry moved host -> disk, a load read from both; reports a
step collected before it raised arrive with the next step; window blocks are entries of their own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recap.core.output import CheckpointWrite, SchedulerOutput, TierDrop, TierLoad, TierSave, TierSaved
from recap.core.tier_index import EntryKind, TierKey
from recap.model.cache import KVCache, ModelCaches, StateCache
from recap.runner.disk_tier import DiskTier, entry_file_name
from recap.runner.host_tier import HostTier
from recap.runner.tier_file import EntryHeader, TensorMeta, TierFileError, decode, encode, read_header, write_atomic
from recap.runner.tier_stores import TierStores

KEY = TierKey(EntryKind.CHECKPOINT, 0xABC, 32)


def _file(tmp_path: Path, payload: bytes = b"\x01\x02\x03\x04", identity: str = "id") -> Path:
    header = EntryHeader(int(KEY.kind), KEY.block_hash, KEY.position, identity,
                         (TensorMeta("state.0.ssm", "uint8", (4,), len(payload)),))  # fmt: skip
    path = tmp_path / entry_file_name(KEY)
    write_atomic(path, encode(header, [payload]))
    return path


def test_round_trip_and_atomic_write(tmp_path: Path) -> None:
    path = _file(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    header, offset = read_header(path)
    assert header.payload_bytes == 4 and offset > 0
    _, payload = decode(path.read_bytes(), "id", int(KEY.kind), KEY.block_hash, KEY.position)
    assert bytes(payload) == b"\x01\x02\x03\x04"


@pytest.mark.parametrize("fault", ["flip", "truncate", "identity", "entry"])
def test_bad_files_are_rejected(tmp_path: Path, fault: str) -> None:
    data = bytearray(_file(tmp_path).read_bytes())
    identity, position = "id", KEY.position
    if fault == "flip":
        data[-10] ^= 1
    elif fault == "truncate":
        data = data[:-3]
    elif fault == "identity":
        identity = "another model"
    else:
        position = 48
    with pytest.raises(TierFileError):
        decode(bytes(data), identity, int(KEY.kind), KEY.block_hash, position)


def _caches() -> ModelCaches:
    kv = {0: KVCache({"k": torch.randn(4, 2, 3), "v": torch.randn(4, 2, 3)})}
    state = {1: StateCache({"ssm": torch.randn(3, 5)})}
    return ModelCaches(kv, state, torch.full((3,), -1, dtype=torch.int64), 2, 4, 3)


def test_store_saves_before_reuse_and_loads_bit_exact(tmp_path: Path) -> None:
    caches = _caches()
    caches.slot_positions[1] = 32
    store = TierStores(caches, [DiskTier(tmp_path, "id", caches)])
    kv_key = TierKey(EntryKind.KV, 0x77)
    want_kv = [caches.kv[0].tensors[n][2].clone() for n in ("k", "v")]
    want_state = caches.state[1].tensors["ssm"][1].clone()
    store.step(SchedulerOutput(1, [], tier_saves=[TierSave(kv_key, 2), TierSave(KEY, 1)]))
    for t in (caches.kv[0].tensors["k"], caches.kv[0].tensors["v"], caches.state[1].tensors["ssm"]):
        t.zero_()  # the step's forward reuses the block and slot: the snapshot was taken before
    store.close()
    store = TierStores(caches, [DiskTier(tmp_path, "id", caches)])
    assert sorted(store.scan()) == sorted([kv_key, KEY])
    store.step(SchedulerOutput(2, [], tier_loads=[TierLoad("r", ((kv_key, 3),), (KEY, 2))]))
    store.wait(5.0)
    report = store.step(SchedulerOutput(3, [])).loaded["r"]
    assert report.failed == [] and report.checkpoint is not None and report.checkpoint.slot == 2
    kv = caches.kv[0].tensors
    assert torch.equal(kv["k"][3], want_kv[0]) and torch.equal(kv["v"][3], want_kv[1])
    assert torch.equal(caches.state[1].tensors["ssm"][2], want_state) and int(caches.slot_positions[2]) == 32
    store.close()
    assert DiskTier(tmp_path, "other", caches).scan() == []  # another identity: its own (empty) directory


def test_stores_move_host_to_disk_and_load_from_both(tmp_path: Path) -> None:
    """A host entry moved down (save from the host copy, then its drop, in one step) and a load reading a KV
    block from the host and the checkpoint from disk: both land bit-exact, in one report."""
    caches = _caches()
    caches.slot_positions[1] = 32
    store = TierStores(caches, [HostTier(caches), DiskTier(tmp_path, "id", caches)])
    kv_key = TierKey(EntryKind.KV, 0x77)
    want_kv = [caches.kv[0].tensors[n][2].clone() for n in ("k", "v")]
    want_state = caches.state[1].tensors["ssm"][1].clone()
    report = store.step(SchedulerOutput(1, [], tier_saves=[TierSave(kv_key, 2, 0), TierSave(KEY, 1, 0)]))
    assert sorted(report.saved) == sorted([TierSaved(kv_key, True, 0), TierSaved(KEY, True, 0)])  # host: at once
    assert store.host is not None and store.host.stats.entries == 2
    for t in (caches.kv[0].tensors["k"], caches.kv[0].tensors["v"], caches.state[1].tensors["ssm"]):
        t.zero_()
    store.step(SchedulerOutput(2, [], tier_saves=[TierSave(KEY, 0, 1, 0)], tier_drops=[TierDrop(KEY, 0)]))
    assert store.host.get(KEY) is None and store.host.stats.entries == 1
    store.wait(5.0)
    saved = store.step(SchedulerOutput(3, [])).saved
    assert saved == [TierSaved(KEY, True, 1)]
    load = TierLoad("r", ((kv_key, 3),), (KEY, 2), (0, 1))
    assert store.step(SchedulerOutput(4, [], tier_loads=[load])).loaded == {}  # the disk part is in flight
    store.wait(5.0)
    report = store.step(SchedulerOutput(5, [])).loaded["r"]
    assert report.loaded == [kv_key, KEY] and report.failed == [] and report.checkpoint == CheckpointWrite(32, 2)
    kv = caches.kv[0].tensors
    assert torch.equal(kv["k"][3], want_kv[0]) and torch.equal(kv["v"][3], want_kv[1])
    assert torch.equal(caches.state[1].tensors["ssm"][2], want_state) and int(caches.slot_positions[2]) == 32
    store.close()


def test_reports_of_a_step_that_raised_come_with_the_next_one(tmp_path: Path) -> None:
    """The step collected the disk's finished save, then raised (its forward pass, or one of its own orders): the
    report is carried, not lost (a lost one would leave the entry pending, or a load waiting, for good)."""
    caches = _caches()
    caches.slot_positions[1] = 32
    store = TierStores(caches, [DiskTier(tmp_path, "id", caches)])
    store.step(SchedulerOutput(1, [], tier_saves=[TierSave(KEY, 1)]))
    store.wait(5.0)
    report = store.step(SchedulerOutput(2, []))
    assert report.saved == [TierSaved(KEY, True, 0)]
    store.carry(report)  # the runner's step raised after its tier orders ran
    assert store.step(SchedulerOutput(3, [])).saved == [TierSaved(KEY, True, 0)]
    assert store.step(SchedulerOutput(4, [])).saved == []  # delivered once
    store.step(SchedulerOutput(5, [], tier_saves=[TierSave(TierKey(EntryKind.KV, 0x78), 2)]))
    store.wait(5.0)
    bad = TierLoad("r", (), (KEY, 2), (1,))  # from a tier that is not a store: raises after the step collected
    with pytest.raises(IndexError):
        store.step(SchedulerOutput(6, [], tier_loads=[bad]))
    assert store.step(SchedulerOutput(7, [])).saved == [TierSaved(TierKey(EntryKind.KV, 0x78), True, 0)]
    store.close()


def test_window_blocks_are_entries_of_their_own(tmp_path: Path) -> None:
    """A window block's entry holds the sliding-window layers' rows of that block (not the full-attention ones),
    is filed as `win-...` with its kind in the header, is found again by a scan, and loads bit-exact into another
    window block from disk while a KV block of the same hash loads from the host."""
    caches = _caches()
    caches.window = {2: KVCache({"k": torch.randn(5, 2, 3), "v": torch.randn(5, 2, 3)})}
    disk = DiskTier(tmp_path, "id", caches)
    store = TierStores(caches, [HostTier(caches), disk])
    win_key, kv_key = TierKey(EntryKind.WINDOW, 0x99), TierKey(EntryKind.KV, 0x99)
    want_win = [caches.window[2].tensors[n][4].clone() for n in ("k", "v")]
    want_kv = [caches.kv[0].tensors[n][1].clone() for n in ("k", "v")]
    saved = store.step(SchedulerOutput(1, [], tier_saves=[TierSave(win_key, 4, 1), TierSave(kv_key, 1, 0)])).saved
    store.wait(5.0)
    saved += store.step(SchedulerOutput(2, [])).saved
    assert sorted(saved) == sorted([TierSaved(kv_key, True, 0), TierSaved(win_key, True, 1)])
    path = disk.dir / entry_file_name(win_key)
    assert path.name.startswith("win-") and read_header(path)[0].kind == int(EntryKind.WINDOW)
    assert [t.name.split(".")[0] for t in read_header(path)[0].tensors] == ["window", "window"]
    assert disk.scan() == [win_key]
    for t in (*caches.window[2].tensors.values(), *caches.kv[0].tensors.values()):
        t.zero_()
    load = TierLoad("r", ((kv_key, 3),), None, (0, 1), window=((win_key, 2),))
    store.step(SchedulerOutput(3, [], tier_loads=[load]))
    store.wait(5.0)
    report = store.step(SchedulerOutput(4, [])).loaded["r"]
    assert sorted(report.loaded) == sorted([kv_key, win_key]) and report.failed == [] and report.checkpoint is None
    win, kv = caches.window[2].tensors, caches.kv[0].tensors
    assert torch.equal(win["k"][2], want_win[0]) and torch.equal(win["v"][2], want_win[1])
    assert torch.equal(kv["k"][3], want_kv[0]) and torch.equal(kv["v"][3], want_kv[1])
    assert not kv["k"][2].any() and not win["k"][3].any()  # each kind into its own group's rows only
    store.close()
