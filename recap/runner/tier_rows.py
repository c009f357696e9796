"""Which cache rows a lower-tier entry holds, and the two copies every tier store makes: a snapshot of an
entry's rows out of the read pools, and rows copied back into a destination block or slot."""

from __future__ import annotations

import torch

from recap.core.output import TierSave
from recap.core.tier_index import EntryKind, TierKey
from recap.model.cache import ModelCaches

Rows = list[tuple[str, torch.Tensor]]


def entry_tensors(caches: ModelCaches, key: TierKey, index: int) -> Rows:
    """The cache rows an entry holds, by name, in file order: KV block `index` of every full-attention layer,
    window block `index` of every sliding-window layer, or state slot `index` of every recurrent layer (views,
    not copies)."""
    if key.kind == EntryKind.KV:
        return [(f"kv.{i}.{n}", t[index]) for i in sorted(caches.kv) for n, t in caches.kv[i].tensors.items()]
    if key.kind == EntryKind.WINDOW:
        window = caches.window
        return [(f"window.{i}.{n}", t[index]) for i in sorted(window) for n, t in window[i].tensors.items()]
    return [(f"state.{name}", t[index]) for name, t in caches.named_state_tensors()]


def snapshot(caches: ModelCaches, save: TierSave, pin: bool) -> Rows | None:
    """Host copies of the rows a save takes from the read pools (pinned memory when `pin`: a GPU's cache), or
    None when a checkpoint's slot no longer holds the position its key names (provenance)."""
    key = save.key
    if key.kind == EntryKind.CHECKPOINT and int(caches.slot_positions[save.source]) != key.position:
        return None
    rows = []
    for name, t in entry_tensors(caches, key, save.source):
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        host.copy_(t.detach())  # blocking: the step that follows may overwrite the row
        rows.append((name, host))
    return rows


@torch.inference_mode()
def copy_in(caches: ModelCaches, key: TierKey, index: int, rows: Rows) -> bool:
    """Copy an entry's rows into block or slot `index`; False (nothing copied) when they do not fit its rows."""
    dest = entry_tensors(caches, key, index)
    if [(n, t.shape, t.dtype) for n, t in dest] != [(n, t.shape, t.dtype) for n, t in rows]:
        return False
    for (_, d), (_, src) in zip(dest, rows):
        d.copy_(src)
    if key.kind == EntryKind.CHECKPOINT:
        caches.slot_positions[index] = key.position
    return True
