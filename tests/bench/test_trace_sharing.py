"""benchmarks/trace_sharing.py: sharing classes and tail reuse distances on a hand-made Mooncake trace."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():  # benchmarks/ is scripts, not a package
    spec = importlib.util.spec_from_file_location("trace_sharing", ROOT / "benchmarks" / "trace_sharing.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_classes_and_tail_uses(tmp_path: Path) -> None:
    rows = [  # 1400 tokens: two full 512-token blocks and a partial one
        {"timestamp": 0, "input_length": 1400, "output_length": 1, "hash_ids": [1, 2, 3]},  # A
        {"timestamp": 1, "input_length": 1400, "output_length": 1, "hash_ids": [1, 2, 4]},  # B: A's end
        {"timestamp": 2, "input_length": 900, "output_length": 1, "hash_ids": [1, 5]},  # C: first split at 1
        {"timestamp": 3, "input_length": 1400, "output_length": 1, "hash_ids": [1, 2, 6]},  # D: B's end
        {"timestamp": 4, "input_length": 900, "output_length": 1, "hash_ids": [1, 7]},  # E: split at 1 again
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = _module().analyse(str(path), 16)
    classes = {c: v["requests"] for c, v in out["classes"].items()}
    assert classes == {"source end": 2, "new divergence": 1, "known branch": 1}
    assert out["unlimited_hit_rate"] == (1024 + 512 + 1024 + 512) / (3 * 1400 + 2 * 900)
    # Tails: A's last full block (key 2), first used by B one request later, again by D two after B;
    # C's (key 1), first used by E two requests later. B's and D's tails are the key they used.
    assert out["tails"] == 2 and out["tails_ever_used"] == 2
    assert out["first_use_distance_requests"] == {"p25": 1, "p50": 2, "p75": 2, "p90": 2}
    assert out["gap_between_uses_requests"] == {"p25": 2, "p50": 2, "p75": 2, "p90": 2}
