"""benchmarks/peers_spec.py: llama-speculative-simple's per-pass debug lines counted as recap counts verify steps."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _module() -> ModuleType:  # benchmarks/ is scripts, not a package
    spec = importlib.util.spec_from_file_location("peers_spec", ROOT / "benchmarks" / "peers_spec.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["peers_spec"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


# Passes as the tool logs them (-v): a plain decode, a full acceptance of 3, a miss (state restored, then the
# verifier's token verified again as a 1-token "draft"), a partial acceptance of 2 of 8 and its re-verify.
LOG = """0.00.1 D accepted 0/0 draft tokens, the last target token is: (5)
0.00.2 D accepted 3/3 draft tokens, the last target token is: (7)
0.00.3 D partial acceptance: 0 < 8, restoring checkpoint
0.00.4 D accepted 1/1 draft tokens, the last target token is: (530)
0.00.5 D partial acceptance: 2 < 8, restoring checkpoint
0.00.6 D accepted 3/3 draft tokens, the last target token is: (263)
0.00.7 I decoded   11 tokens in    0.100 seconds, speed:  110.000 t/s
"""


def test_parse_passes_counts_fresh_verify_steps_and_rollbacks() -> None:
    passes, verify, accepted, rollbacks = _module().parse_passes(LOG)
    assert (passes, verify, accepted, rollbacks) == (6, 3, 5, 2)
    run = _module().LlamaRun(110.0, 11, "", passes, verify, accepted, rollbacks)
    assert abs(run.mean_accepted_length - (1 + 5 / 3)) < 1e-9
    assert _module().LlamaRun(100.0, 10, "").mean_accepted_length == 1.0


def test_same_prefix() -> None:
    same = _module().same_prefix
    assert same("The United States\n\n", "The United States has been")
    assert not same("The United States", "The United Kingdom")
    assert not same("", "anything")
