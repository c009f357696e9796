"""Lower tiers without files, for the FakeExecutor: saves, drops and loads in integers, one step late.

Order per step, as the real runner's (runner/disk_tier.py): loads of requests reported gone are cancelled;
saves are snapshotted (before anything can reuse their block or slot); drops delete; loads ordered by an
earlier step finish (their data lands in the destination blocks and slot, then they are reported); this
step's loads start. Saves are reported written one step after their order (or later: `hold_reports`).
Entries are stored per tier (level, key); a save from a tier (`from_level`) copies that tier's entry, which
must be there.

In validate mode the snapshot is the simulated content (each position's prefix hash in a KV or window block,
or the slot's (position, prefix hash)) and a load writes it back, so a load of the wrong entry fails the executor's
next read. `corrupt` keys fail their load (counted, forgotten), as a corrupt file does; the next
`fail_saves` saves are not written and reported failed, as on a full disk (a load ordered meanwhile fails).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recap.core.output import CheckpointWrite, ModelRunnerOutput, SchedulerOutput, TierLoad, TierLoadReport, TierSaved
from recap.core.tier_index import EntryKind, TierKey

Memory = dict[int, int]
Slots = dict[int, tuple[int, int]]


@dataclass
class FakeTier:
    block_size: int
    store: dict[tuple[int, TierKey], object] = field(default_factory=dict)  # (level, key) -> content
    corrupt: set[TierKey] = field(default_factory=set)  # their next load fails (from any tier)
    disable_next: int | None = None  # report this tier's store off at the next step
    fail_saves: int = 0  # the next this many saves fail
    hold_reports: bool = False  # a slow store: saves land in order, their reports wait
    num_saves: int = 0
    num_loads: int = 0
    _saved: list[TierSaved] = field(default_factory=list)
    _loads: list[TierLoad] = field(default_factory=list)

    def step(self, out: SchedulerOutput, result: ModelRunnerOutput, kv: Memory, slots: Slots, validate: bool,
             window: Memory | None = None) -> None:  # fmt: skip
        """Apply the step's tier orders to the simulated memory (`window`: the window group's blocks); report into
        `result`."""
        blocks = {EntryKind.KV: kv, EntryKind.WINDOW: window if window is not None else {}}
        self._loads = [load for load in self._loads if load.request_id not in out.finished_request_ids]
        if not self.hold_reports:
            result.tier_saved, self._saved = self._saved, []
        for save in out.tier_saves:
            if save.from_level >= 0:
                data = self.store[save.from_level, save.key]  # moved down before the drop beside it
            else:
                data = self._snapshot(save.key, save.source, blocks, slots) if validate else True
            written = self.fail_saves == 0
            self.fail_saves -= not written
            if written:
                self.store[save.level, save.key] = data
            self._saved.append(TierSaved(save.key, written, save.level))
            self.num_saves += 1
        for drop in out.tier_drops:
            self.store.pop((drop.level, drop.key), None)
        for load in self._loads:
            result.tier_loaded[load.request_id] = self._load(load, blocks, slots, validate)
        self._loads = list(out.tier_loads)
        if self.disable_next is not None:
            result.tier_disabled, self.disable_next = [self.disable_next], None

    def _snapshot(self, key: TierKey, source: int, blocks: dict[EntryKind, Memory], slots: Slots) -> object:
        bs = self.block_size
        if key.kind != EntryKind.CHECKPOINT:
            return [blocks[key.kind].get(source * bs + o) for o in range(bs)]
        state = slots.get(source)
        assert state is not None and state[0] == key.position, f"save of {key} from slot {source} holding {state}"
        return state

    def _load(self, load: TierLoad, blocks: dict[EntryKind, Memory], slots: Slots, validate: bool) -> TierLoadReport:
        report = TierLoadReport()
        self.num_loads += 1
        for key, dest, level in load.entries():
            data = self.store.get((level, key))
            if data is None or key in self.corrupt:
                self.corrupt.discard(key)
                self.store.pop((level, key), None)
                report.failed.append(key)
                continue
            if validate:
                if key.kind != EntryKind.CHECKPOINT:
                    assert isinstance(data, list)
                    self._write_block(dest, data, blocks[key.kind])
                else:
                    assert isinstance(data, tuple)
                    slots[dest] = data
            if key.kind == EntryKind.CHECKPOINT:
                report.checkpoint = CheckpointWrite(key.position, dest)
            report.loaded.append(key)
        return report

    def _write_block(self, dest: int, data: list[int | None], kv: Memory) -> None:
        bs = self.block_size
        for o, value in enumerate(data):
            if value is None:
                kv.pop(dest * bs + o, None)
            else:
                kv[dest * bs + o] = value
