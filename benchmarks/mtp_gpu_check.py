"""Device check of speculative method "mtp" (issue 34): on a GPU, greedy output with each tiny MTP head of
tests/engine/test_speculative_mtp_families.py (Nemotron-H copy head, Nemotron-H and Ling 3.0 random heads) equals
the unspeculated run on the same device, token for token, with prefix caching on and the prompts sent twice (the
second pass hits). Prints one line per case and writes them as JSON; exits 1 if any case differs.

    python3 benchmarks/mtp_gpu_check.py --out mtp_gpu.json                 # on the GPU (Triton and torch kernels)
    python3 benchmarks/mtp_gpu_check.py --device cpu --kernels torch      # here
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tests.engine.test_speculative_mtp_families as families
from tests.engine.test_speculative_draft import make, tokens
from tests.engine.test_speculative_mtp import _prompts, spec


class _Dirs:
    """What the test fixture asks of pytest's tmp_path_factory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def mktemp(self, name: str) -> Path:
        path = self.root / name
        path.mkdir()
        return path


def check(models: dict[str, Path], name: str, device: str, kernels: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    kw: dict[str, object] = {"device": device, "kernels": kernels, "max_num_batched_tokens": 24}
    want = tokens(make(models[families.PAIRS[name]], None, caching=False, **kw), _prompts())
    llm = make(models[name], spec(), **kw)
    first = tokens(llm, _prompts())
    again = llm.generate(_prompts(), families.GREEDY)
    s = llm.engine.scheduler.stats.spec
    return {"name": name, "device": device, "kernels": kernels,
            "equal": first == want and [o.outputs[0].token_ids for o in again] == want,
            "cached_tokens": [o.num_cached_tokens for o in again], "draft_tokens": s.num_draft_tokens,
            "accepted_tokens": s.num_accepted_tokens, "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kernels", nargs="+", default=["triton", "torch"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    models = families.models.__wrapped__(_Dirs(Path(tempfile.mkdtemp())))  # type: ignore[attr-defined]
    rows = []
    for kernels in args.kernels:
        for name in ("copy", "nemotron-mtp", "ling-mtp"):
            rows.append(check(models, name, args.device, kernels))
            print(rows[-1], flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
