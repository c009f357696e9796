"""recap.core is integer bookkeeping: importing any of its modules must not import torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import recap.core

CODE = """
import importlib, pkgutil, sys
import recap.core
names = [m.name for m in pkgutil.walk_packages(recap.core.__path__, "recap.core.")]
for name in names:
    importlib.import_module(name)
assert "torch" not in sys.modules, "torch imported by recap.core"
assert "numpy" not in sys.modules, "numpy imported by recap.core"
print(len(names))
"""


def test_core_imports_no_torch() -> None:
    root = Path(recap.core.__file__).parents[2]
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) >= 12  # every module was imported
