"""The host memory a recap process may hold: what the kernel says is available, capped by the cgroup's limit.

MemAvailable (/proc/meminfo) is the kernel's estimate of what can be allocated without swapping (free memory
plus reclaimable page cache). A container's cgroup limit (v2 memory.max, v1 memory.limit_in_bytes) caps the
process whatever the host has free. The memory this process already holds (its RSS) is its own, so the figure
recap plans against is min(MemAvailable + RSS, cgroup limit): measured before or after the weights load, it
stays the same.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MEMINFO = Path("/proc/meminfo")
SELF_STATUS = Path("/proc/self/status")
SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as the largest page-aligned int64 (9223372036854771712); v2 as "max".
UNLIMITED = 1 << 60


class MemoryPlanError(RuntimeError):
    """The weights, pools and runtime do not fit the memory this process may hold: refused at start, before the
    weights load (when their size alone is too much) or before the pools are allocated (runner/memory.py)."""


@dataclass(frozen=True)
class MemoryLimit:
    """The bytes this process may hold in all (weights, pools, the runtime), and where the figure came from."""

    bytes: int
    source: str  # e.g. "MemAvailable 19.8 GiB + this process's RSS 0.4 GiB", "cgroup memory.max 8.0 GiB"

    def __post_init__(self) -> None:
        if self.bytes <= 0:
            raise ValueError(f"a memory limit must be positive, got {self.bytes}")


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _kib_field(path: Path, name: str) -> int | None:
    """A `Name:   123 kB` line of a /proc file, in bytes (None where the file or line is missing)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def mem_available_bytes() -> int:
    """MemAvailable, or free pages where /proc/meminfo has no such line."""
    found = _kib_field(MEMINFO, "MemAvailable")
    return found if found is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def process_rss_bytes() -> int:
    """This process's resident set (VmRSS); 0 where /proc has no status file."""
    return _kib_field(SELF_STATUS, "VmRSS") or 0


def _cgroup_files() -> list[Path]:
    """The limit files of this process's own cgroup (from /proc/self/cgroup), then of the mounted root."""
    files: list[Path] = []
    try:
        lines = SELF_CGROUP.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        rel = rel.lstrip("/")
        if controllers == "":  # v2 unified hierarchy
            files.append(CGROUP_ROOT / rel / "memory.max")
        elif "memory" in controllers.split(","):
            files.append(CGROUP_ROOT / "memory" / rel / "memory.limit_in_bytes")
    files += [CGROUP_ROOT / "memory.max", CGROUP_ROOT / "memory" / "memory.limit_in_bytes"]
    return files


def cgroup_limit() -> tuple[int, str] | None:
    """The smallest cgroup memory limit that applies here, with the file it came from (None: no limit)."""
    best: tuple[int, str] | None = None
    for path in _cgroup_files():
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max" or not text.isdigit() or int(text) >= UNLIMITED:
            continue
        if best is None or int(text) < best[0]:
            best = (int(text), path.name)
    return best


def available_memory_bytes() -> int:
    """What a new allocation may take now: MemAvailable, capped by the cgroup limit (the pools' default share)."""
    avail = mem_available_bytes()
    cg = cgroup_limit()
    return avail if cg is None else min(avail, cg[0])


def process_memory_limit() -> MemoryLimit:
    """The memory this process may hold in all: min(MemAvailable + its RSS, the cgroup limit)."""
    avail, rss = mem_available_bytes(), process_rss_bytes()
    host = MemoryLimit(avail + rss, f"MemAvailable {gib(avail)} + this process's RSS {gib(rss)}")
    cg = cgroup_limit()
    if cg is not None and cg[0] < host.bytes:
        return MemoryLimit(cg[0], f"cgroup {cg[1]} {gib(cg[0])}")
    return host
