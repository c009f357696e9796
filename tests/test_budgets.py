"""Size budgets over recap/**.py: files <= 400 lines, functions <= 60 lines, bar an allow-list that may only shrink.

tests/budget_allowlist.txt names each file (`path lines`) and function (`path::Qualified.name lines`) over
budget today with its exact size. The test fails for an offender not listed, for a listed one that grew, and
for a listed one that shrank or is now within budget (or gone): the list must then be edited down, so it
never hides growth. `python tests/test_budgets.py` prints the current offenders in the list's format.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWLIST = Path(__file__).with_name("budget_allowlist.txt")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def function_sizes(tree: ast.AST) -> dict[str, int]:
    """Lines of each function and method (decorators excluded), by qualified name; the largest of namesakes."""
    sizes: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    assert child.end_lineno is not None
                    sizes[name] = max(sizes.get(name, 0), child.end_lineno - child.lineno + 1)
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return sizes


def offenders(root: Path = ROOT) -> dict[str, int]:
    """Every file and function of recap/ over budget, keyed as in the allow-list, with its size."""
    out: dict[str, int] = {}
    for path in sorted((root / "recap").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        num_lines = len(text.splitlines())
        if num_lines > MAX_FILE_LINES:
            out[rel] = num_lines
        for name, size in function_sizes(ast.parse(text, rel)).items():
            if size > MAX_FUNCTION_LINES:
                out[f"{rel}::{name}"] = size
    return out


def read_allowlist(path: Path = ALLOWLIST) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, size = line.rsplit(maxsplit=1)
            assert key not in out, f"{key} is listed twice"
            out[key] = int(size)
    return out


def budget_errors(found: dict[str, int], allowed: dict[str, int]) -> list[str]:
    """What is wrong with the tree against the allow-list (empty when they agree exactly)."""
    errors = []
    for key, size in sorted(found.items()):
        if key not in allowed:
            errors.append(f"{key}: {size} lines, over budget and not in the allow-list (split it)")
        elif size > allowed[key]:
            errors.append(f"{key}: grew to {size} lines (allow-list: {allowed[key]}); the list may only shrink")
        elif size < allowed[key]:
            errors.append(f"{key}: shrank to {size} lines: lower its allow-list entry from {allowed[key]}")
    for key in sorted(allowed.keys() - found.keys()):
        errors.append(f"{key}: within budget now (or gone): remove it from the allow-list")
    return errors


def test_recap_keeps_its_size_budgets() -> None:
    errors = budget_errors(offenders(), read_allowlist())
    assert not errors, "\n".join(errors)


def test_the_check_catches_new_grown_shrunk_and_stale_entries(tmp_path: Path) -> None:
    module = tmp_path / "recap" / "m.py"
    module.parent.mkdir()
    body = "\n".join(f"        x{i} = {i}" for i in range(70))
    module.write_text(f"class A:\n    def big(self) -> None:\n{body}\n\n\ndef small() -> None:\n    pass\n")
    found = offenders(tmp_path)
    assert found == {"recap/m.py::A.big": 71}
    assert budget_errors(found, {"recap/m.py::A.big": 71}) == []
    assert "not in the allow-list" in budget_errors(found, {})[0]
    assert "grew" in budget_errors(found, {"recap/m.py::A.big": 70})[0]
    assert "shrank" in budget_errors(found, {"recap/m.py::A.big": 72})[0]
    assert "within budget" in budget_errors(found, {"recap/m.py::A.big": 71, "recap/m.py::small": 61})[0]
    module.write_text("\n" * 401)
    assert offenders(tmp_path) == {"recap/m.py": 401}


if __name__ == "__main__":
    sys.stdout.writelines(f"{key} {size}\n" for key, size in sorted(offenders().items()))
