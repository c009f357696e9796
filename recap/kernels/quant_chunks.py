"""How many rows of a weight are quantized at a time while a model loads.

Quantizing walks a weight a chunk of rows at a time so that its fp32 temporaries stay small beside it. A fixed row
count made them scale with the input width (4096 rows of a 2048-input weight: 32 MiB a temporary) and, freed and
made again per chunk, they lived in glibc's heap once its mmap threshold had risen past their size: a vocab-heavy
load's peak varied by 20 MiB from run to run with where the heap's free pieces fell. Chunks of about CHUNK_BYTES of
fp32 keep every temporary one small piece that the heap reuses.
"""

from __future__ import annotations

CHUNK_BYTES = 1 << 20  # fp32 bytes of one chunk's rows


def chunk_rows(in_features: int, multiple: int) -> int:
    """Rows per chunk of an [out, in_features] weight: about CHUNK_BYTES of fp32, a positive multiple of
    `multiple` (the packed format's row tile)."""
    if in_features <= 0 or multiple <= 0:
        raise ValueError(f"chunk_rows takes positive sizes, got in_features={in_features}, multiple={multiple}")
    return max(1, CHUNK_BYTES // (4 * in_features * multiple)) * multiple
