"""The runner's lower-tier stores in the core's order (host memory, then disk; those configured), and the
routing of a step's tier orders to them.

Per step, before the step's state copies and forward pass: loads of requests gone are cancelled; every save
is snapshotted (from the read pools' block or slot, which this very step may reuse, or from the tier copy it
moves down) and handed to its tier; then drops (after the saves: a copy moving down is read before its
drop); then finished saves and loads are collected; then new loads start. A load's host entries are copied
at once; its disk entries go to the disk store's I/O thread, and the request is reported when both parts
are in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from recap.config import CacheConfig
from recap.core.output import CheckpointWrite, SchedulerOutput, TierLoad, TierLoadReport, TierSave, TierSaved
from recap.core.tier_index import EntryKind, TierKey
from recap.model.cache import ModelCaches
from recap.runner.disk_tier import DiskTier, DiskTierStats, open_disk_tier
from recap.runner.host_tier import HostTier
from recap.runner.tier_rows import Rows, snapshot


@dataclass
class TierStepReport:
    saved: list[TierSaved] = field(default_factory=list)
    loaded: dict[str, TierLoadReport] = field(default_factory=dict)
    disabled: list[int] = field(default_factory=list)  # tiers whose store turned itself off


class TierStores:
    """The stores by level (the core's `TierManager.indexes` order). Main thread only."""

    def __init__(self, caches: ModelCaches, stores: list[HostTier | DiskTier]) -> None:
        self.caches = caches
        self.stores = stores
        self.host = next((s for s in stores if isinstance(s, HostTier)), None)
        self.disk = next((s for s in stores if isinstance(s, DiskTier)), None)
        self.disk_level = stores.index(self.disk) if self.disk is not None else -1
        self._partial: dict[str, TierLoadReport] = {}  # host parts of loads whose disk part is in flight
        self._carried: TierStepReport | None = None  # collected by a step that raised

    @property
    def stats(self) -> DiskTierStats:
        """The disk store's file counters (zeros without one)."""
        return self.disk.stats if self.disk is not None else DiskTierStats()

    @property
    def closed(self) -> bool:
        return self.disk is None or self.disk.closed

    def scan(self) -> list[TierKey]:
        """What the disk store found at start (oldest first), for the core's disk tier."""
        return self.disk.scan() if self.disk is not None else []

    def step(self, out: SchedulerOutput) -> TierStepReport:
        """Run the step's orders; the report holds what the stores finished (and any report `carry` kept)."""
        report, self._carried = self._carried or TierStepReport(), None
        try:
            self._step(out, report)
        except BaseException:
            self.carry(report)  # collected already: the core must still hear of it
            raise
        return report

    def carry(self, report: TierStepReport) -> None:
        """The step raised after `report` was collected: deliver it with the next step's."""
        self._carried = report

    def _step(self, out: SchedulerOutput, report: TierStepReport) -> None:
        if self.disk is not None:
            self.disk.cancel(out.finished_request_ids)
        for rid in out.finished_request_ids & self._partial.keys():
            del self._partial[rid]
        for save in out.tier_saves:
            self._save(save, report)
        for drop in out.tier_drops:
            self.stores[drop.level].drop(drop.key)
        if self.disk is not None:
            saved, loaded, turned_off = self.disk.collect()
            report.saved += [TierSaved(key, ok, self.disk_level) for key, ok in saved]
            for rid, part in loaded.items():
                report.loaded[rid] = _merge(self._partial.pop(rid, TierLoadReport()), part)
            if turned_off:
                report.disabled.append(self.disk_level)
        for load in out.tier_loads:
            self._load(load, report)

    def _save(self, save: TierSave, report: TierStepReport) -> None:
        rows: Rows | None
        if save.from_level < 0:
            rows = snapshot(self.caches, save, pin=self.host is not None and self.host.pin and save.level == 0)
        else:
            src = self.stores[save.from_level]
            rows = src.get(save.key) if isinstance(src, HostTier) else None
        store = self.stores[save.level]
        if isinstance(store, HostTier):
            if rows is not None:
                store.put(save.key, rows)
            report.saved.append(TierSaved(save.key, rows is not None, save.level))
        else:
            store.save(save.key, rows)

    def _load(self, load: TierLoad, report: TierStepReport) -> None:
        """Copy the host entries now; send the disk entries to the I/O thread (reported when they land)."""
        part = TierLoadReport()
        disk: dict[EntryKind, list[tuple[TierKey, int]]] = {kind: [] for kind in EntryKind}
        for key, dest, level in load.entries():
            store = self.stores[level]
            if isinstance(store, DiskTier):
                disk[key.kind].append((key, dest))
            elif store.read_into(key, dest):
                part.loaded.append(key)
                if key.kind == EntryKind.CHECKPOINT:
                    part.checkpoint = CheckpointWrite(key.position, dest)
            else:
                part.failed.append(key)
        if self.disk is None or not any(disk.values()):
            report.loaded[load.request_id] = part
            return
        self._partial[load.request_id] = part
        cp = disk[EntryKind.CHECKPOINT]
        self.disk.load(TierLoad(load.request_id, tuple(disk[EntryKind.KV]), cp[0] if cp else None,
                                window=tuple(disk[EntryKind.WINDOW])))  # fmt: skip

    def wait(self, timeout: float) -> None:
        if self.disk is not None:
            self.disk.wait(timeout)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


def _merge(host: TierLoadReport, disk: TierLoadReport) -> TierLoadReport:
    """One report of a load read partly from each store (the core registers a leading run, whatever the order)."""
    return TierLoadReport(host.loaded + disk.loaded, host.failed + disk.failed, host.checkpoint or disk.checkpoint)


def open_tier_stores(
    cache: CacheConfig, model_dir: Path, dtype: str, quantization: str | None, caches: ModelCaches
) -> TierStores | None:
    """The stores of the tiers `cache` asks for, in the core's order; None without any."""
    stores: list[HostTier | DiskTier] = []
    for name in cache.tier_names:
        if name == "host":
            stores.append(HostTier(caches))
        else:
            disk = open_disk_tier(cache, model_dir, dtype, quantization, caches)
            assert disk is not None
            stores.append(disk)
    return TierStores(caches, stores) if stores else None
