"""Native kernels: the C sources in recap/kernels/csrc, compiled once per machine and loaded with ctypes.

Why C and ctypes rather than torch.compile or a torch C++ extension: a source of a few hundred lines builds in
about a second with the system C compiler (torch.compile's first build of one kernel took 44-46 s here, a C++
extension including torch's headers tens of seconds), and a ctypes call costs about a microsecond. The library
links libgomp by its soname, so it shares the OpenMP runtime (and thread pool) torch already loaded.

Build: `cc -O3 -march=native -fopenmp -ffp-contract=off -shared -fPIC`. The library is cached under
~/.cache/recap/native (a temporary folder where home is not writable), keyed by the source and csrc's headers,
the compiler's version, the flags and the CPU's feature flags, so a changed machine or source builds anew.
Processes building at once each write their own file and rename it into place.
Where there is no C compiler or the build fails, `NativeUnavailableError` says why; callers keep their torch
paths.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CSRC = Path(__file__).resolve().parent / "csrc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-std=c11", "-shared", "-fPIC")


class NativeUnavailableError(RuntimeError):
    """The native kernels cannot be built or loaded here (no C compiler, a failed build, another platform)."""


def address(t: torch.Tensor) -> ctypes.c_void_p:
    """A tensor's data pointer as a C argument."""
    return ctypes.c_void_p(t.data_ptr())


def _compiler() -> str:
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    raise NativeUnavailableError("no C compiler (cc, gcc or clang) on PATH")


@functools.cache
def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    for base in (Path.home() / ".cache", Path(tempfile.gettempdir())):
        d = base / "recap" / "native"
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK):
            return d
    raise NativeUnavailableError("no writable folder for the native library (home and temp are read-only)")


@functools.cache
def load_library(name: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """csrc/<name>.c built (or found in the cache) and loaded; raises NativeUnavailableError. `extra_flags`
    follow FLAGS (tests build the paths of other instruction sets with e.g. -mno-avx512f)."""
    if platform.system() != "Linux":
        raise NativeUnavailableError(f"native kernels are built for Linux only, not {platform.system()}")
    src = CSRC / f"{name}.c"
    cc = _compiler()
    version = _compiler_version(cc)
    flags = (*FLAGS, *extra_flags)
    headers = [h.read_text() for h in sorted(CSRC.glob("*.h"))]  # the sources include them: a changed one builds anew
    key = hashlib.sha256(b"\0".join(s.encode() for s in (src.read_text(), *headers, version, " ".join(flags),
                                                          _cpu_flags())))  # fmt: skip
    out = _cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if not out.is_file():
        tmp = out.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")  # a builder per process and thread
        try:
            done = subprocess.run([cc, *flags, "-o", str(tmp), str(src), "-lm"], capture_output=True, text=True,
                                  timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            raise NativeUnavailableError(f"building {src.name} failed: {e}") from e
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise NativeUnavailableError(f"building {src.name} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, out)
    try:
        return ctypes.CDLL(str(out))
    except OSError as e:
        raise NativeUnavailableError(f"loading {out} failed: {e}") from e


@functools.cache
def _compiler_version(cc: str) -> str:
    """`cc --version`, asked once per process (each library's cache key holds it)."""
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailableError(f"{cc} --version failed: {e}") from e


def build_libraries(names: Sequence[str]) -> None:
    """`load_library(name)` for each of `names` at once, a compiler per core: on a machine with no cached
    library a start otherwise compiled them one after another (about a second each, several under load) as
    each part turned its kernels on. Each success stays in load_library's cache; a failure is not cached, so
    the library's own load raises it again where its caller decides what to do."""
    def build(name: str) -> None:
        with contextlib.suppress(NativeUnavailableError):
            load_library(name)

    with ThreadPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1))) as pool:
        list(pool.map(build, names))


def raw_function(lib: ctypes.CDLL, name: str, restype: type | None = None) -> ctypes._CFuncPtr:
    """A fresh handle of one library function with no argtypes: calls pass ctypes values as they are, skipping
    the per-argument conversion (~0.1-0.2 us each). For prebuilt argument lists (backends/decode_graph.py)."""
    fn = lib[name]
    fn.restype = restype
    return fn


def loads(library: Callable[[], object]) -> bool:
    """Whether `library()` (a cached loader of one csrc library) builds and loads here: about a second, once
    per machine. The caller says why not, where it should (linear_rows_available does, once)."""
    try:
        library()
    except NativeUnavailableError:
        return False
    return True
