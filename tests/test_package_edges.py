"""The serving packages import each other one way only (recap/launch/__init__.py): the HTTP toolkit under
the OpenAI app and the P/D code, Ray over those, and the launch package (with the CLI) alone over all.
Every import counts, the lazy ones inside functions too, so an edge cannot hide in a function body."""

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


def test_the_walk_sees_the_known_edges() -> None:
    """The parser finds real edges (a walk that found nothing would pass the tests above)."""
    found = {(src, dst) for src, dst, _ in edges()}
    assert {("server", "http"), ("disagg", "http"), ("cluster", "disagg"), ("launch", "server"),
            ("launch", "cluster"), ("cli", "launch")} <= found
