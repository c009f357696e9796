"""native.build_libraries: several csrc libraries built at once into the cache, each compiled once; a failed
one is raised again by its own load_library call. And the CPU backend's list names real csrc libraries."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from recap.backends.cpu import NATIVE_LIBRARIES
from recap.kernels import native


def _compiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the sources compiled from here on (calls of the compiler with -o)."""
    seen: list[str] = []
    run = subprocess.run

    def counting(cmd: list[str], *args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
        if "-o" in cmd:
            seen.append(Path(cmd[-2]).stem)
        return run(cmd, *args, **kwargs)  # type: ignore[call-overload, no-any-return]

    monkeypatch.setattr(native.subprocess, "run", counting)
    return seen


def test_build_libraries_builds_each_once_and_leaves_failures_to_the_load(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    src, cache = tmp_path / "src", tmp_path / "cache"
    src.mkdir()
    cache.mkdir()
    tag = f"t{abs(hash(str(tmp_path))) % 10**9}"  # names no other test has put in load_library's cache
    good = [f"{tag}_a", f"{tag}_b"]
    for i, name in enumerate(good):
        (src / f"{name}.c").write_text(f"int {name}_f(void) {{ return {i + 7}; }}\n")
    broken = f"{tag}_broken"
    (src / f"{broken}.c").write_text("int f(void) { return nope; }\n")
    monkeypatch.setattr(native, "CSRC", src)
    monkeypatch.setattr(native, "_cache_dir", lambda: cache)
    compiled = _compiles(monkeypatch)

    native.build_libraries([*good, broken])  # the failure is not raised here
    assert sorted(compiled) == sorted([*good, broken])
    assert sorted(p.name.split("-")[0] for p in cache.glob("*.so")) == good
    assert not list(cache.glob("*.tmp"))
    for i, name in enumerate(good):  # loaded from load_library's cache: no second compile
        assert getattr(native.load_library(name), f"{name}_f")() == i + 7
    assert len(compiled) == 3
    with pytest.raises(native.NativeUnavailableError, match="nope"):
        native.load_library(broken)
    assert compiled.count(broken) == 2  # a failure is not cached


def test_cpu_backend_libraries_are_csrc_sources() -> None:
    assert all((native.CSRC / f"{name}.c").is_file() for name in NATIVE_LIBRARIES)
    loaders = {name: False for name in NATIVE_LIBRARIES}
    for path in (native.CSRC.parent).glob("*.py"):
        text = path.read_text()
        for name in loaders:
            loaders[name] |= f'load_library("{name}"' in text
    assert all(loaders.values()), loaders  # each is one a kernel module loads
