"""Run as a script (its own process): for each serving format, the RSS a loaded and prepared model adds, beside
the bytes recap's plan says its weights hold. Prints one JSON object {format: {"rss": ..., "plan": ...}}.

Each format is loaded twice: once to warm up what the first load allocates for good (oneDNN's and fbgemm's
kernels, the native library), then measured. Freed heap memory is handed back (malloc_trim) before each
reading, so the figure is what live objects hold.
"""

from __future__ import annotations

import ctypes
import gc
import json
import sys

import torch

from recap.backends import prepare
from recap.model.footprint import held_weight_bytes
from recap.model.loader import load_model

FORMATS = {"float32": (torch.float32, None), "bfloat16": (torch.bfloat16, None), "int8": (torch.float32, "int8")}


def _rss_after_trim() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _load(folder: str, fmt: str) -> object:
    dtype, quant = FORMATS[fmt]
    loaded = load_model(folder, dtype=dtype, quantization=quant)
    prepare(loaded)
    return loaded


def main(folder: str, formats: list[str]) -> None:
    torch.set_num_threads(1)
    out = {}
    for fmt in formats:
        warm = _load(folder, fmt)
        del warm
        before = _rss_after_trim()
        loaded = _load(folder, fmt)
        rss = _rss_after_trim() - before
        held = held_weight_bytes(loaded.model)  # type: ignore[attr-defined]
        out[fmt] = {"rss": rss, "plan": held.total, "parameters": held.parameters, "copies": held.linear_copies}
        del loaded
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or list(FORMATS))
