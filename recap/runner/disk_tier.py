"""The disk tier's store, runner side: checkpoints, KV and window blocks as files, written and read by one I/O
thread.

The cache core decides what to save, drop and load (recap/core/tiers.py); this store does it, driven by
runner/tier_stores.py each step (before the step's state copies and forward pass): loads of requests gone are
cancelled; saves arrive as host copies of their rows (snapshotted from the read pools, or the host tier's
copy) and are queued for writing; drops are queued; loads the I/O thread finished are verified and copied
into their blocks and slot, then reported; new loads are queued. One FIFO thread, so a drop never overtakes
the write of the same file.

Files live in `<cache_dir>/<identity digest>/`, one per entry (tier_file.py: header, payload, checksum;
atomic writes). The identity covers the weights' checksum, dtype, quantization, block size, the state layout
version and every cache tensor's shape and dtype: another model, dtype or layout has another directory and
never reads these files. A corrupt, truncated or foreign file is counted (`rejected_files`), deleted, and
reported failed (the core falls back to what it holds, or recomputes). An unwritable directory or a full
disk turns the store off with a warning and reports it (`disabled`): requests never fail for it.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from recap.config import CacheConfig
from recap.core.output import CheckpointWrite, TierLoad, TierLoadReport
from recap.core.tier_index import EntryKind, TierKey
from recap.model.cache import ModelCaches
from recap.runner.tier_file import TMP_SUFFIX, EntryHeader, TensorMeta, TierFileError, decode, encode, read_header
from recap.runner.tier_file import write_atomic as _write_atomic
from recap.runner.tier_rows import Rows, copy_in, entry_tensors

log = logging.getLogger(__name__)


# Bump when the meaning of a state slot's or KV block's bytes changes (a kernel's state layout): older files
# then belong to another identity and are never read.
TIER_LAYOUT_VERSION = 1
_IDENTITY_FILES = (".safetensors", ".bin", ".pt", ".pth")


def model_identity(model_dir: Path, dtype: str, quantization: str | None, block_size: int, caches: ModelCaches) -> str:
    """A digest of what makes cached bytes valid: the weights' checksum (xxh3-128 over the weight files and
    config.json), dtype, quantization, block size, TIER_LAYOUT_VERSION and every cache tensor's row shape and dtype."""
    digest = xxhash.xxh3_128()
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file() and (path.suffix in _IDENTITY_FILES or path.name == "config.json"):
            digest.update(path.name.encode())
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
    rows = [(n, str(t.dtype), list(t.shape)) for kind in EntryKind
            for n, t in entry_tensors(caches, TierKey(kind, 0), 0)]  # fmt: skip
    digest.update(json.dumps([dtype, quantization, block_size, TIER_LAYOUT_VERSION, rows]).encode())
    return digest.hexdigest()


@dataclass
class DiskTierStats:
    files_written: int = 0
    bytes_written: int = 0
    files_read: int = 0
    bytes_read: int = 0
    rejected_files: int = 0  # corrupt, truncated or foreign files deleted instead of loaded
    write_errors: int = 0


_FILE_PREFIX = {EntryKind.KV: "kv", EntryKind.CHECKPOINT: "cp", EntryKind.WINDOW: "win"}


def entry_file_name(key: TierKey) -> str:
    return f"{_FILE_PREFIX[key.kind]}-{key.block_hash:032x}-{key.position}.rtier"


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


class DiskTier:
    """One directory of entry files for one model identity. Thread-safe between `step` and its I/O thread."""

    def __init__(self, root: Path, identity: str, caches: ModelCaches) -> None:
        self.dir = Path(root) / identity
        self.identity = identity
        self.caches = caches
        self.stats = DiskTierStats()
        self.disabled = False
        self.closed = False
        self._report_disabled = False
        self._jobs: queue.Queue[tuple[str, object] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._saved: list[tuple[TierKey, bool]] = []
        self._loaded: dict[str, tuple[TierLoad, dict[TierKey, memoryview | None]]] = {}
        self._load_rids: set[str] = set()  # main thread only: loads submitted, not yet applied
        self._cancelled: set[str] = set()  # main thread only: their requests left; their data is discarded
        self._in_flight = 0
        self._done = threading.Condition(self._lock)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe{TMP_SUFFIX}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            self._turn_off(f"cannot write to {self.dir}: {e}")
        self._thread = threading.Thread(target=self._run, name="recap-disk-tier", daemon=True)
        self._thread.start()

    # -- start --------------------------------------------------------------------------------
    def scan(self) -> list[TierKey]:
        """This identity's entries on disk, oldest first; leftover temporary files and bad headers are deleted."""
        if self.disabled:
            return []
        found: list[tuple[float, TierKey]] = []
        for path in self.dir.iterdir():
            if path.name.endswith(TMP_SUFFIX):
                path.unlink(missing_ok=True)  # a write a crash interrupted
                continue
            try:
                header, _ = read_header(path)
                key = TierKey(EntryKind(header.kind), header.block_hash, header.position)
                if header.identity != self.identity or entry_file_name(key) != path.name:
                    raise TierFileError("foreign or misnamed file")
                found.append((path.stat().st_mtime, key))
            except (TierFileError, ValueError, OSError):
                self.stats.rejected_files += 1
                path.unlink(missing_ok=True)
        return [key for _, key in sorted(found)]

    # -- orders (main thread; runner/tier_stores.py routes a step's orders here) ----------------
    def cancel(self, finished: set[str]) -> None:
        """Requests gone: their loads' data is discarded when it arrives (their blocks may be reused from now on)."""
        self._cancelled |= finished & self._load_rids

    def save(self, key: TierKey, rows: Rows | None) -> None:
        """Queue a write of host copies of the entry's rows (None: nothing to write, reported failed)."""
        if rows is None or self.disabled:
            with self._lock:
                self._saved.append((key, False))
            return
        self._submit("save", (key, rows))

    def drop(self, key: TierKey) -> None:
        self._submit("drop", key)

    def load(self, load: TierLoad) -> None:
        self._load_rids.add(load.request_id)
        self._submit("load", load)

    def collect(self) -> tuple[list[tuple[TierKey, bool]], dict[str, TierLoadReport], bool]:
        """Saves finished, loads finished (verified and copied into their blocks and slot), and whether the store
        turned itself off since the last call."""
        with self._lock:
            finished, self._loaded = self._loaded, {}
            saved, self._saved = self._saved, []
        loaded = {}
        for rid, (load, data) in finished.items():
            self._load_rids.discard(rid)
            if rid in self._cancelled:
                self._cancelled.discard(rid)
                continue
            loaded[rid] = self._apply(load, data)
        turned_off = self.disabled and not self._report_disabled
        self._report_disabled = self._report_disabled or turned_off
        return saved, loaded, turned_off

    def wait(self, timeout: float) -> None:
        """Block until the I/O thread finishes a job (or `timeout` seconds): for steps with nothing else to do."""
        with self._done:
            if self._in_flight:
                self._done.wait(timeout)

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._in_flight > 0

    def close(self) -> None:
        """Finish every queued job, then stop the thread (a restarted server finds every file written)."""
        if not self.closed:
            self.closed = True
            self._jobs.put(None)
            self._thread.join()

    # -- main-thread halves ---------------------------------------------------------------------
    def _apply(self, load: TierLoad, data: dict[TierKey, memoryview | None]) -> TierLoadReport:
        """Copy verified payloads into their blocks and slot; a payload that does not fit is rejected."""
        report = TierLoadReport()
        for key, index, _ in load.entries():
            payload = data.get(key)
            if payload is None or not self._copy_in(key, index, payload):
                report.failed.append(key)
                continue
            report.loaded.append(key)
            if key.kind == EntryKind.CHECKPOINT:
                report.checkpoint = CheckpointWrite(key.position, index)
        return report

    def _copy_in(self, key: TierKey, index: int, payload: memoryview) -> bool:
        template = entry_tensors(self.caches, key, index)
        if sum(t.nbytes for _, t in template) != len(payload):
            self._reject(key, "payload does not fit this model's cache rows")
            return False
        rows, offset = [], 0
        for name, row in template:
            n = row.nbytes
            src = torch.frombuffer(payload[offset : offset + n], dtype=torch.uint8) if n else torch.empty(0)
            rows.append((name, src.view(row.dtype).view(row.shape)))
            offset += n
        return copy_in(self.caches, key, index, rows)

    def _reject(self, key: TierKey, why: str) -> None:
        log.warning("disk tier: rejected %s (%s); deleted, will recompute", entry_file_name(key), why)
        with self._lock:
            self.stats.rejected_files += 1
        (self.dir / entry_file_name(key)).unlink(missing_ok=True)

    def _submit(self, kind: str, job: object) -> None:
        with self._lock:
            self._in_flight += 1
        self._jobs.put((kind, job))

    def _turn_off(self, why: str) -> None:
        if not self.disabled:
            log.warning("disk tier off: %s (requests go on without it)", why)
        self.disabled = True

    # -- the I/O thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            kind, item = job
            try:
                if kind == "save":
                    self._write(*item)  # type: ignore[misc]
                elif kind == "drop":
                    (self.dir / entry_file_name(item)).unlink(missing_ok=True)  # type: ignore[arg-type]
                else:
                    self._read(item)  # type: ignore[arg-type]
            except OSError as e:  # a drop that cannot delete: the file stays, its entry is forgotten
                log.warning("disk tier: %s failed: %s", kind, e)
            finally:
                with self._done:
                    self._in_flight -= 1
                    self._done.notify_all()

    def _write(self, key: TierKey, tensors: Rows) -> None:
        ok = False
        if not self.disabled:
            metas = tuple(TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.nbytes)
                          for n, t in tensors)  # fmt: skip
            header = EntryHeader(int(key.kind), key.block_hash, key.position, self.identity, metas)
            try:
                _write_atomic(self.dir / entry_file_name(key), encode(header, [_raw(t) for _, t in tensors]))
                ok = True
                with self._lock:
                    self.stats.files_written += 1
                    self.stats.bytes_written += header.payload_bytes
            except OSError as e:  # full disk, directory gone or read-only: no disk tier from now on
                with self._lock:
                    self.stats.write_errors += 1
                self._turn_off(f"writing {entry_file_name(key)}: {os.strerror(e.errno) if e.errno else e}")
        with self._lock:
            self._saved.append((key, ok))

    def _read(self, load: TierLoad) -> None:
        data: dict[TierKey, memoryview | None] = {}
        for key, _, _ in load.entries():
            path = self.dir / entry_file_name(key)
            try:
                with open(path, "rb") as f:  # into a writable buffer: the tensors copied from it need one
                    raw = bytearray(os.fstat(f.fileno()).st_size)
                    if f.readinto(raw) != len(raw):
                        raise TierFileError("file shrank while read")
                _, payload = decode(raw, self.identity, int(key.kind), key.block_hash, key.position)
                data[key] = payload
                with self._lock:
                    self.stats.files_read += 1
                    self.stats.bytes_read += len(payload)
            except FileNotFoundError:
                data[key] = None
            except (TierFileError, OSError) as e:
                self._reject(key, str(e))
                data[key] = None
        with self._lock:
            self._loaded[load.request_id] = (load, data)


def open_disk_tier(
    cache: CacheConfig, model_dir: Path, dtype: str, quantization: str | None, caches: ModelCaches
) -> DiskTier | None:
    """The runner's disk tier store (None without `cache_dir`); the core decides what it saves and loads."""
    if cache.cache_dir is None or not cache.disk_tier_bytes:
        return None
    identity = model_identity(model_dir, dtype, quantization, cache.block_size, caches)
    return DiskTier(Path(cache.cache_dir), identity, caches)
