"""`make serve` installs recap's runtime dependencies only (pyproject's `dependencies`, not the extras): every
module of recap outside the optional extras' packages must import with that set alone. The test simulates the
serving-only virtualenv inside the test one: a subprocess refuses every import whose distribution is outside
the closure of the runtime dependencies (as an absent package would fail), then imports each module. Optional
imports a library guards itself (fastapi's orjson, httpx's zstandard) just take their fallback, as they would."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# recap's packages that belong to an extra: [ray] (Ray Serve replicas) and [triton] (the GPU kernels).
EXTRA_PACKAGES = ("recap.cluster", "recap.kernels.triton")

_IMPORT_WITH_ONLY = """
import importlib, importlib.abc, importlib.metadata as md, pkgutil, sys
from packaging.utils import canonicalize_name

allowed = set(sys.argv[1].split(","))
skip = tuple(sys.argv[2].split(","))
owners = md.packages_distributions()


class OutsideTheServingSet(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        dists = {canonicalize_name(d) for d in owners.get(name.partition(".")[0], ())}
        if dists and not dists & allowed:
            raise ModuleNotFoundError(f"No module named {name!r} (outside the serving set)", name=name)
        return None


sys.meta_path.insert(0, OutsideTheServingSet())
import recap

failed = []
for m in pkgutil.walk_packages(recap.__path__, "recap."):
    if not m.name.startswith(skip):
        try:
            importlib.import_module(m.name)
        except ImportError as e:
            failed.append(f"{m.name}: {e}")
print("\\n".join(failed))
"""


def runtime_closure() -> set[str]:
    """The distributions `pip install -e .` brings: pyproject's dependencies and theirs, extras only as named."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    todo, seen, visited = [Requirement(d) for d in deps], {"recap"}, set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if (name, frozenset(req.extras)) in visited:
            continue
        visited.add((name, frozenset(req.extras)))
        seen.add(name)
        for text in md.requires(req.name) or []:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in req.extras or {""}):
                todo.append(sub)
    return seen


def test_runtime_closure_follows_extras_only_where_named() -> None:
    closure = runtime_closure()
    assert {"torch", "transformers", "fastapi", "uvicorn", "httptools", "pyzmq"} <= closure
    assert not {"ray", "pytest", "lm-eval", "guidellm", "langchain-openai", "openai", "triton"} & closure


def test_every_module_outside_the_extras_imports_with_the_serving_set() -> None:
    out = subprocess.run([sys.executable, "-c", _IMPORT_WITH_ONLY, ",".join(sorted(runtime_closure())),
                          ",".join(EXTRA_PACKAGES)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"needs a package `make serve` does not install:\n{out.stdout}"
