"""recap's packages import each other one way only (docs/architecture.md): the cache core at the bottom, then
kernels, models, backends, the runner, the engine; over the engine the HTTP toolkit, the OpenAI app and the P/D
code, Ray over those, and the launch package (with the CLI) alone over all (recap/launch/__init__.py). Every
import counts, the lazy ones inside functions too, so an edge cannot hide in a function body."""

from __future__ import annotations

import ast
from pathlib import Path

import recap

SERVING = ("http", "server", "disagg", "cluster", "launch", "cli")
ALLOWED = {
    "http": set(),
    "server": {"http"},
    "disagg": {"http"},
    "cluster": {"http", "disagg"},
    "launch": {"http", "server", "disagg", "cluster"},
    "cli": {"launch", "disagg"},
}
# Plain data shared by every layer (configs, sampling settings, units): any package may import them.
SHARED = {"config", "units", "sampling_params", "structured_output", "grammar_bounds"}
# Every package and the packages it may import (besides SHARED); a package not listed fails the test.
LAYERS: dict[str, set[str]] = {
    "core": set(),
    "kernels": {"core"},
    "model": {"kernels", "process"},
    "backends": {"kernels", "model", "process"},
    "runner": {"backends", "core", "kernels", "model"},
    "process": set(),
    "engine": {"core", "kernels", "model", "process", "runner"},
    "bench": {"backends", "core", "engine", "model"},
    **{pkg: {"core", "engine", "model", "process"} | deps for pkg, deps in ALLOWED.items()},
    "__init__": {"engine"},
    "cli": ALLOWED["cli"] | {"__init__"},
    **{data: set() for data in SHARED},
}
ROOT = Path(recap.__file__).parent


def _package(path: Path) -> str:
    """The top package under recap/ a file belongs to (a module directly under recap/: its name)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return parts[0]


def _imported(node: ast.AST) -> list[str]:
    """The recap packages an import statement names."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
        names = [node.module] if node.module != "recap" else [f"recap.{a.name}" for a in node.names]
    else:
        return []
    return [n.split(".")[1] for n in names if n.startswith("recap.")]


def edges() -> set[tuple[str, str, str]]:
    """(importer package, imported package, file) for every import from one recap package into another."""
    out = set()
    for path in sorted(ROOT.rglob("*.py")):
        src = _package(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for dst in _imported(node):
                if dst != src:
                    out.add((src, dst, str(path.relative_to(ROOT.parent))))
    return out


def test_edges_between_serving_packages_go_one_way() -> None:
    bad = sorted((f, src, dst) for src, dst, f in edges()
                 if src in SERVING and dst in SERVING and dst not in ALLOWED[src])
    assert not bad, "imports against the package order (recap/launch/__init__.py):\n" + "\n".join(
        f"{f}: recap.{src} imports recap.{dst}" for f, src, dst in bad)


def test_nothing_below_serving_imports_it() -> None:
    """The engine, the cache core, the models and the kernels know nothing of HTTP (bench drives servers)."""
    bad = sorted((f, src, dst) for src, dst, f in edges() if src not in (*SERVING, "bench") and dst in SERVING)
    assert not bad, "\n".join(f"{f}: recap.{src} imports recap.{dst}" for f, src, dst in bad)


def test_every_package_imports_only_below_it() -> None:
    """The whole house as one table (LAYERS): the core imports no torch-side package, the model no backend,
    the engine no server, and a new package must be placed in the table."""
    root = {"LLM", "SamplingParams"}  # `from recap import LLM`: the package root
    found = {(src, "__init__" if dst in root else dst, f) for src, dst, f in edges()}
    bad = sorted((f, src, dst) for src, dst, f in found
                 if src not in LAYERS or (dst not in SHARED and dst not in LAYERS[src]))
    unplaced = sorted({dst for _, dst, _ in found} - set(LAYERS))
    assert not unplaced, f"packages missing from LAYERS: {unplaced}"
    assert not bad, "\n".join(f"{f}: recap.{src} imports recap.{dst}" for f, src, dst in bad)


def test_the_layers_form_no_cycle() -> None:
    seen: dict[str, int] = {}

    def depth(pkg: str, path: tuple[str, ...] = ()) -> int:
        assert pkg not in path, f"cycle: {' -> '.join((*path, pkg))}"
        if pkg not in seen:
            seen[pkg] = 1 + max((depth(d, (*path, pkg)) for d in LAYERS[pkg]), default=0)
        return seen[pkg]

    for pkg in LAYERS:
        depth(pkg)


def test_the_walk_sees_the_known_edges() -> None:
    """The parser finds real edges (a walk that found nothing would pass the tests above)."""
    found = {(src, dst) for src, dst, _ in edges()}
    assert {("server", "http"), ("disagg", "http"), ("cluster", "disagg"), ("launch", "server"),
            ("launch", "cluster"), ("cli", "launch")} <= found
