"""The worker-side half of the KV connector: tensors in and out of ModelCaches.

Prefill side, `gather`: the held request's KV blocks asked for (every attention layer, stacked into one
K and one V tensor of shape (layers, blocks, block_size, kv_heads, head_dim)) and, per state tensor of
every recurrent layer (whatever its kind declares: `ModelCaches.named_state_tensors`, sent as
"state.{layer}.{name}"), the running slot followed by the asked checkpoints' slots (row 0 is the state
after all prompt tokens). Positions sent with states are what the kernels recorded in
`slot_positions`, never what was planned, so provenance travels with the data (DESIGN invariant 2).

A model with sliding-window layers sends, stacked the same way per name ("window.{name}"), the window blocks the
decode side asked for: indices into the held window run (recap.core.window_transfer), each with its chain hash
where the block is full, which the decode side checks against its own before writing anything.

Decode side, `scatter`: writes them into the blocks and slots the scheduler-side half allocated
(`ReceivePlan`) and returns the checkpoint writes to report to the core, which registers only those
that match its plan (same slot, same position, same chain hash).

Wire form: a JSON header (its format version, layers, per-checkpoint position and chain hash, per window block
index and chain hash, and each tensor's name, dtype and shape) followed by one raw frame per tensor. A header of
another format, other layers or blocks other than the ones asked for is refused whole (TransferDataError): the
request fails or prefills locally, nothing is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from recap.core.output import CheckpointWrite
from recap.core.transfer import HeldRequest, ReceivePlan, select_checkpoints
from recap.model.cache import ModelCaches

# 1: KV blocks and states (headers without "format"); 2: adds "window_layers" and "window_blocks".
TRANSFER_FORMAT = 2


class TransferDataError(ValueError):
    """Received data that does not fit this instance's caches or the receive plan."""


def _meta(name: str, t: torch.Tensor) -> dict[str, Any]:
    return {"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


def to_frame(t: torch.Tensor) -> memoryview:
    """Raw bytes of a tensor, without a copy when it is contiguous."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


@torch.inference_mode()
def gather(
    caches: ModelCaches, held: HeldRequest, blocks: Sequence[int], positions: Sequence[int],
    window_blocks: Sequence[int] = (),
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The header and tensors for one pull. Raises ValueError for a block index outside the held table (or
    window run)."""
    if any(not 0 <= i < len(held.block_ids) for i in blocks):
        raise ValueError(f"block indices {list(blocks)} outside the held table of {len(held.block_ids)} blocks")
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    kv_layers, ssm_layers = sorted(caches.kv), sorted(caches.state)
    if kv_layers and blocks:
        idx = torch.tensor([held.block_ids[i] for i in blocks], dtype=torch.long)
        for name in caches.kv[kv_layers[0]].tensors:  # k and v (MLA: latent and rope), every layer alike
            stacked = torch.stack([caches.kv[i].tensors[name].index_select(0, idx) for i in kv_layers])
            names.append(name)
            tensors.append(stacked)  # (layers, blocks, block_size, *per-token shape)
    offers = select_checkpoints(held, positions)
    written: list[int] = []
    if ssm_layers:
        slots = torch.tensor([held.state_slot] + [c.slot for c in offers], dtype=torch.long)
        written = caches.slot_positions.index_select(0, slots).tolist()
        for name, t in caches.named_state_tensors():
            names.append(f"state.{name}")
            tensors.append(t.index_select(0, slots))
    window_metas, window_tensors = _gather_window(caches, held, window_blocks)
    names += [n for n, _ in window_tensors]
    tensors += [t for _, t in window_tensors]
    header = {
        "format": TRANSFER_FORMAT,
        "kv_layers": kv_layers,
        "ssm_layers": ssm_layers,
        "num_blocks": len(blocks) if kv_layers else 0,
        "state_position": written[0] if written else None,
        "checkpoints": [{"asked": c.position, "position": p, "hash": f"{c.block_hash:032x}"}
                        for c, p in zip(offers, written[1:])],
        "window_layers": sorted(caches.window),
        "window_blocks": window_metas,
        "tensors": [_meta(n, t) for n, t in zip(names, tensors)],
    }
    return header, tensors


def _gather_window(
    caches: ModelCaches, held: HeldRequest, indices: Sequence[int]
) -> tuple[list[dict[str, Any]], list[tuple[str, torch.Tensor]]]:
    """Per asked window block its index and chain hash (None for the partial last block), and the window
    layers' rows of those blocks by name, (layers, blocks, block_size, *per-token shape)."""
    if not indices:
        return [], []
    layers, hold = sorted(caches.window), held.window
    if hold is None or not layers:
        raise ValueError("this prefill side holds no sliding-window blocks")
    if any(not hold.start <= i < len(hold.block_ids) for i in indices):
        raise ValueError(f"window block indices {list(indices)} outside the held run "
                         f"[{hold.start}, {len(hold.block_ids)})")
    hashes = held.request.block_hashes
    num_full = min(held.num_prompt_tokens // caches.block_size, len(hashes))
    metas = [{"index": i, "hash": f"{hashes[i]:032x}" if i < num_full else None} for i in indices]
    idx = torch.tensor([hold.block_ids[i] for i in indices], dtype=torch.long)
    rows = [(f"window.{name}", torch.stack([caches.window[i].tensors[name].index_select(0, idx) for i in layers]))
            for name in caches.window[layers[0]].tensors]
    return metas, rows


def from_frames(header: dict[str, Any], frames: Sequence[bytes]) -> dict[str, torch.Tensor]:
    """Tensors by name from the raw frames; TransferDataError when sizes disagree with the header."""
    metas = header.get("tensors", [])
    if len(metas) != len(frames):
        raise TransferDataError(f"header lists {len(metas)} tensors, {len(frames)} frames arrived")
    out: dict[str, torch.Tensor] = {}
    for meta, frame in zip(metas, frames):
        dtype = getattr(torch, str(meta["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise TransferDataError(f"unknown dtype {meta['dtype']!r}")
        shape = [int(d) for d in meta["shape"]]
        raw = torch.frombuffer(bytearray(frame), dtype=torch.uint8) if len(frame) else torch.empty(0, dtype=torch.uint8)
        expected = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if raw.numel() != expected:
            raise TransferDataError(f"tensor {meta['name']}: {raw.numel()} bytes for shape {shape} of {dtype}")
        out[str(meta["name"])] = raw.view(dtype).reshape(shape)
    return out


def _expect(t: torch.Tensor | None, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        got = None if t is None else (tuple(t.shape), t.dtype)
        raise TransferDataError(f"tensor {name}: expected {tuple(shape)} {dtype}, got {got}")
    return t


@torch.inference_mode()
def scatter(
    caches: ModelCaches, plan: ReceivePlan, header: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> list[CheckpointWrite]:
    """Write received data where `plan` says; the checkpoint writes to report (hash-checked).

    Raises TransferDataError (and writes nothing) when the data does not fit the plan or the caches.
    """
    kv_layers, ssm_layers = sorted(caches.kv), sorted(caches.state)
    if header.get("format") != TRANSFER_FORMAT:
        raise TransferDataError(f"transfer format {header.get('format')!r}, this side reads {TRANSFER_FORMAT}")
    if (header.get("kv_layers"), header.get("ssm_layers"), header.get("window_layers")) != (
            kv_layers, ssm_layers, sorted(caches.window)):
        raise TransferDataError("the prefill instance runs a model with other layers")
    if ssm_layers and header.get("state_position") != plan.num_prompt_tokens:
        raise TransferDataError(f"state after {header.get('state_position')} tokens sent, "
                                f"{plan.num_prompt_tokens} expected")
    wanted = {c.write.position: c for c in plan.checkpoints}
    received = [(wanted.get(c.get("asked")), c) for c in header.get("checkpoints", [])]
    rows = [plan.state_slot] + [c.write.slot for c, _ in received if c is not None]
    keep = [0] + [1 + j for j, (c, _) in enumerate(received) if c is not None]
    # Validate everything before writing anything.
    writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    if kv_layers and plan.block_ids:
        idx = torch.tensor(plan.block_ids, dtype=torch.long)
        for name, ref in caches.kv[kv_layers[0]].tensors.items():
            t = _expect(tensors.get(name), name, (len(kv_layers), len(plan.block_ids), *ref.shape[1:]), ref.dtype)
            writes += [(caches.kv[i].tensors[name], idx, t[n]) for n, i in enumerate(kv_layers)]
    writes += _window_writes(caches, plan, header, tensors)
    if ssm_layers:
        slots, pick = torch.tensor(rows, dtype=torch.long), torch.tensor(keep, dtype=torch.long)
        expected = {f"state.{name}" for name, _ in caches.named_state_tensors()}
        extra = sorted(n for n in tensors if n.startswith("state.") and n not in expected)
        if extra:
            raise TransferDataError(f"state tensors {extra} have no place in this model's state slot")
        for name, cache in caches.named_state_tensors():
            key = f"state.{name}"
            t = _expect(tensors.get(key), key, (len(received) + 1, *cache.shape[1:]), cache.dtype)
            writes.append((cache, slots, t.index_select(0, pick)))
    for cache, index, values in writes:
        cache.index_copy_(0, index, values)
    reports: list[CheckpointWrite] = []
    if ssm_layers:
        caches.slot_positions[plan.state_slot] = plan.num_prompt_tokens
        for c, meta in received:
            if c is None:
                continue
            caches.slot_positions[c.write.slot] = int(meta["position"])
            if meta.get("hash") == f"{c.block_hash:032x}":  # the prefill side's chain hash must be ours
                reports.append(CheckpointWrite(int(meta["position"]), c.write.slot))
    return reports


def _window_writes(
    caches: ModelCaches, plan: ReceivePlan, header: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(cache, block ids, rows) for the window blocks of the plan; TransferDataError when the header's blocks are
    not the ones asked for, in order, or a block's chain hash is not this side's."""
    received = plan.window
    metas = header.get("window_blocks")
    if not isinstance(metas, list) or not all(isinstance(m, dict) for m in metas):
        raise TransferDataError("the header lists no window blocks")
    if [m.get("index") for m in metas] != list(received.indices):
        raise TransferDataError(f"window blocks {[m.get('index') for m in metas]} sent, {list(received.indices)} asked")
    for meta, ours in zip(metas, received.hashes):
        if meta.get("hash") is not None and ours is not None and meta["hash"] != f"{ours:032x}":
            raise TransferDataError(f"window block {meta['index']} comes from another chain")
    if not received.block_ids:
        return []
    layers = sorted(caches.window)
    idx = torch.tensor(received.block_ids, dtype=torch.long)
    writes = []
    for name, ref in caches.window[layers[0]].tensors.items():
        key = f"window.{name}"
        t = _expect(tensors.get(key), key, (len(layers), len(received.block_ids), *ref.shape[1:]), ref.dtype)
        writes += [(caches.window[i].tensors[name], idx, t[n]) for n, i in enumerate(layers)]
    return writes


def num_bytes(tensors: Sequence[torch.Tensor] | dict[str, torch.Tensor]) -> int:
    values = tensors.values() if isinstance(tensors, dict) else tensors
    return sum(t.numel() * t.element_size() for t in values)
