"""Load a checkpoint in this process and report its memory:
`python -m recap.bench.load_probe PATH DTYPE QUANT [HEAD]` (HEAD: head_quantization, model/head_format.py).

Prints one JSON line: the process's peak (VmHWM) and resident (VmRSS) bytes after importing torch and recap
(the baseline), after loading, and after the backend's preparation (the serving layouts), with the bytes the
prepared model holds (footprint.held_weight_bytes). Run it in a fresh subprocess, one load per process: VmHWM
never goes down. Used by benchmarks/load_memory.py and tests/model/test_load_memory.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

STATUS = Path("/proc/self/status")


def proc_status() -> tuple[int, int]:
    """(VmHWM, VmRSS) of this process in bytes."""
    fields = dict(line.split(":", 1) for line in STATUS.read_text().splitlines() if ":" in line)
    return int(fields["VmHWM"].split()[0]) << 10, int(fields["VmRSS"].split()[0]) << 10


def probe(path: str, dtype: str, quantization: str | None, head: str = "auto") -> dict[str, int]:
    import torch

    torch.set_num_threads(1)
    from recap.backends import prepare
    from recap.model.footprint import held_weight_bytes
    from recap.model.loader import load_model

    base_peak, base_rss = proc_status()
    loaded = load_model(path, getattr(torch, dtype), quantization=quantization, head_quantization=head)
    loaded_peak, loaded_rss = proc_status()
    prepare(loaded)
    peak, rss = proc_status()
    return {"baseline_peak": base_peak, "baseline_rss": base_rss, "loaded_peak": loaded_peak,
            "loaded_rss": loaded_rss, "peak": peak, "rss": rss,
            "held": held_weight_bytes(loaded.model).total}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    path, dtype, quant, *head = argv if argv is not None else sys.argv[1:5]
    print(json.dumps(probe(path, dtype, None if quant == "-" else quant, *head)))


if __name__ == "__main__":
    main()
