"""Packing a step's rows into a ForwardBatch (kernels/metadata.py): token ids, positions, KV paging, state
slots and the SSM chunks (cut by kernels/tiling.py), built on the host and moved to the step's device in one copy.
"""

from __future__ import annotations

import array
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.kernel_set import TORCH_KERNELS, KernelSet
from recap.kernels.metadata import AttentionMetadata, ForwardBatch, SeqSpec, SSMMetadata
from recap.kernels.tiling import RowTokens, chunk_rows

_ARRAY_CODES = {torch.int64: "q", torch.bool: "b"}


def _host(x: list[int] | list[bool] | list[list[int]], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`torch.tensor(x, dtype=dtype)` on the host (moved to the batch's device in one copy at the end), for a list
    or a list of equal-length lists: through array.array and torch.frombuffer, ~3x cheaper than torch.tensor on
    a list, and a step builds ~17 of them (the tensor owns the array)."""
    nested = bool(x) and isinstance(x[0], list)
    flat = array.array(_ARRAY_CODES[dtype], itertools.chain.from_iterable(x) if nested else x)  # type: ignore[arg-type]
    if not flat:  # frombuffer refuses an empty buffer
        return torch.tensor(x, dtype=dtype, device="cpu")
    if nested and any(len(r) != len(x[0]) for r in x):  # type: ignore[arg-type]  # torch.tensor refuses them too
        raise ValueError(f"{len(x)} rows of unequal lengths: a tensor needs equal rows")
    t = torch.frombuffer(flat, dtype=dtype)
    return t.view(len(x), -1) if nested else t


@dataclass(frozen=True)
class _Tokens:
    """The rows' tokens packed in order, and the rows sampled this step."""

    ids: list[int]
    positions: list[int]
    qsl: list[int]  # [B+1] query_start_loc
    logits_indices: list[int]
    sample_rows: list[int]


def _pack_tokens(seqs: Sequence[SeqSpec]) -> _Tokens:
    packed = _Tokens([], [], [0], [], [])
    for row, s in enumerate(seqs):
        n = len(s.token_ids)
        if n == 0:
            raise ValueError(f"row {row} has no tokens")
        packed.ids.extend(int(t) for t in s.token_ids)
        packed.positions.extend(range(s.context_len, s.context_len + n))
        packed.qsl.append(packed.qsl[-1] + n)
        if s.sample and not s.padding:
            packed.logits_indices.append(packed.qsl[-1] - 1)
            packed.sample_rows.append(row)
    return packed


def build_forward_batch(
    seqs: Sequence[SeqSpec],
    *,
    block_size: int,
    chunk_size: int,
    with_attention: bool,
    with_ssm: bool,
    device: torch.device | str | None = None,
    with_window: bool = False,
    kernels: KernelSet | None = None,
) -> ForwardBatch:
    """Pack rows into one ForwardBatch (its tensors on `device`; None: torch's default device). Every row must
    have at least one token."""
    if not seqs:
        raise ValueError("a batch needs at least one row")
    tok = _pack_tokens(seqs)
    attn = _attention_metadata(seqs, [s.block_ids for s in seqs], tok.qsl, block_size) if with_attention else None
    window_attn = None
    if with_window:
        tables = [s.block_ids if s.window_block_ids is None else s.window_block_ids for s in seqs]
        window_attn = _attention_metadata(seqs, tables, tok.qsl, block_size, window=True)
    ssm = _ssm_metadata(seqs, tok.qsl, chunk_size) if with_ssm else None
    batch = ForwardBatch(
        input_ids=_host(tok.ids),
        positions=_host(tok.positions),
        query_start_loc=_host(tok.qsl),
        logits_indices=_host(tok.logits_indices),
        sample_rows=tok.sample_rows,
        attn=attn,
        ssm=ssm,
        num_seqs=len(seqs),
        num_tokens=len(tok.ids),
        planned_checkpoints=[] if ssm is None else ssm.chunks.checkpoints(),
        window_attn=window_attn,
        kernels=TORCH_KERNELS if kernels is None else kernels,
    )
    target = torch.get_default_device() if device is None else torch.device(device)
    return batch if target.type == "cpu" else batch_to_device(batch, target)


def _row_tokens(row: int, s: SeqSpec) -> RowTokens:
    """The row as the tiling sees it, its checkpoints checked (inside its new tokens, real slots)."""
    n = len(s.token_ids)
    cps = dict(s.checkpoints)
    for p, slot in cps.items():
        if not s.context_len < p <= s.context_len + n:
            raise ValueError(f"row {row}: checkpoint at {p} outside ({s.context_len}, {s.context_len + n}]")
        if slot < 0 or s.padding:
            raise ValueError(f"row {row}: checkpoint slot {slot} is a pad id or the row is padding")
    return RowTokens(s.context_len, n, cps)


def _ssm_metadata(seqs: Sequence[SeqSpec], qsl: list[int], chunk_size: int) -> SSMMetadata:
    """The rows' chunks (kernels/tiling.py) and state slots."""
    chunks = chunk_rows([_row_tokens(row, s) for row, s in enumerate(seqs)], chunk_size)
    state_idx = [PAD_SLOT_ID if s.padding else s.state_slot for s in seqs]
    has_init = [s.context_len > 0 and not s.padding for s in seqs]
    is_decode = all(len(s.token_ids) == 1 for s in seqs)
    return SSMMetadata(
        chunk_size=chunk_size,
        state_indices=_host(state_idx),
        has_initial_state=_host(has_init, torch.bool),
        query_start_loc=_host(qsl),
        cu_chunk_seqlens=_host(chunks.cu),
        chunk_seq_idx=_host(chunks.rows),
        last_chunk_indices=_host(chunks.row_last(len(seqs))),
        chunk_dest_slots=_host(chunks.dest_slots),
        chunk_end_positions=_host(chunks.end_positions),
        state_indices_list=state_idx,
        has_initial_state_list=has_init,
        query_start_loc_list=qsl,
        cu_chunk_seqlens_list=chunks.cu,
        chunk_seq_idx_list=chunks.rows,
        chunk_dest_slots_list=chunks.dest_slots,
        chunk_end_positions_list=chunks.end_positions,
        is_decode=is_decode,
        plain_decode=is_decode and all(has_init) and PAD_SLOT_ID not in state_idx,
    )


_PARTS = ("attn", "window_attn", "ssm")  # the ForwardBatch fields that hold metadata dataclasses
# Last in the packed order: its length is the step's sampled rows, not a function of the rows' shape, so the
# tensors before it keep their offsets across steps of one shape (a captured step's inputs: backends/cuda_graph.py).
_VARIABLE = "logits_indices"


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """A metadata dataclass's field names but the packed buffer's (dataclasses.fields costs ~4 us a call, and a
    GPU decode step asks ~10 times)."""
    return tuple(f.name for f in fields(cls) if f.name != "packed")


def _tensor_fields(obj: object) -> list[str]:
    """The metadata tensors of a ForwardBatch or one of its parts (not the buffer they are views of)."""
    return [n for n in _field_names(type(obj)) if isinstance(getattr(obj, n), torch.Tensor)]


def _parts(batch: ForwardBatch) -> list[object]:
    return [batch] + [getattr(batch, p) for p in _PARTS if getattr(batch, p) is not None]


def packed_fields(batch: ForwardBatch) -> list[tuple[object, str]]:
    """(owner, field name) of every metadata tensor of `batch` in the packed order: the batch's fields, then
    attention's, window attention's and the SSM's, logits_indices last."""
    out = [(o, n) for o in _parts(batch) for n in _tensor_fields(o) if (o, n) != (batch, _VARIABLE)]
    return out + [(batch, _VARIABLE)]


def pack_batch(batch: ForwardBatch) -> torch.Tensor:
    """Every metadata tensor of `batch` flattened into one int64 tensor on the batch's device, in packed_fields
    order (bools as 0/1)."""
    flat = [getattr(o, n).reshape(-1) for o, n in packed_fields(batch)]
    return torch.cat([x if x.dtype == torch.int64 else x.to(torch.int64) for x in flat])


def batch_on(batch: ForwardBatch, packed: torch.Tensor) -> ForwardBatch:
    """`batch` with every metadata tensor a view of `packed` (pack_batch's layout; a bool tensor is a copy, the
    one exception), and `packed` recorded as the batch's buffer."""
    views: dict[int, dict[str, torch.Tensor]] = {}  # owner's id -> its fields' views
    layout = [(o, n, getattr(o, n)) for o, n in packed_fields(batch)]
    sizes = [x.numel() for _, _, x in layout]
    for (o, n, x), v in zip(layout, packed[: sum(sizes)].split(sizes)):  # one split: the views in one call
        v = v if x.dim() == 1 else v.view(x.shape)
        views.setdefault(id(o), {})[n] = v.bool() if x.dtype == torch.bool else v
    new = [replace(o, **views.get(id(o), {})) for o in _parts(batch)]  # type: ignore[type-var]
    parts = {p: new[1 + i] for i, p in enumerate(q for q in _PARTS if getattr(batch, q) is not None)}
    return replace(new[0], **parts, packed=packed)


def batch_to_device(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    """The batch with every metadata tensor on `device`, moved in one host-to-device copy (a GPU step would
    otherwise pay one transfer per tensor, ~20 per step); the Python lists stay on the host."""
    flat = pack_batch(batch)
    if device.type == "cuda" and flat.device.type == "cpu":  # a host batch (only host memory can be pinned)
        flat = flat.pin_memory()
    return batch_on(batch, flat.to(device, non_blocking=True))


def _slot_mapping(
    seqs: Sequence[SeqSpec], tables: Sequence[Sequence[int]], block_size: int, window: bool
) -> list[int]:
    """[T] the KV slot of every new token (PAD_SLOT_ID for padding rows)."""
    slot_mapping: list[int] = []
    for row, (s, table) in enumerate(zip(seqs, tables)):
        n = len(s.token_ids)
        if s.padding:
            slot_mapping.extend([PAD_SLOT_ID] * n)
            continue
        need = -(-(s.context_len + n) // block_size)
        if len(table) < need:
            raise ValueError(f"row {row}: {len(table)} blocks for {s.context_len + n} tokens")
        for p in range(s.context_len, s.context_len + n):
            block = int(table[p // block_size])
            if window and block == 0:
                raise ValueError(f"row {row}: position {p} maps to the null block")
            slot_mapping.append(block * block_size + p % block_size)
    return slot_mapping


def _attention_metadata(
    seqs: Sequence[SeqSpec],
    tables: Sequence[Sequence[int]],
    qsl: list[int],
    block_size: int,
    window: bool = False,
) -> AttentionMetadata:
    """Paging of one attention group: slot mapping of the new tokens and padded block tables.

    `window`: the table belongs to the window group, whose leading entries may be the null block 0 (blocks
    out of the window); the new tokens must never map there.
    """
    slot_mapping = _slot_mapping(seqs, tables, block_size, window)
    context_lens = [s.context_len for s in seqs]
    seq_lens = [s.context_len + len(s.token_ids) for s in seqs]
    max_blocks = max(1, max(len(b) for b in tables))
    padded = [list(map(int, b)) + [PAD_SLOT_ID] * (max_blocks - len(b)) for b in tables]
    return AttentionMetadata(
        block_size=block_size,
        slot_mapping=_host(slot_mapping),
        block_tables=_host(padded),
        context_lens=_host(context_lens),
        seq_lens=_host(seq_lens),
        query_start_loc=_host(qsl),
        context_lens_list=context_lens,
        seq_lens_list=seq_lens,
        query_start_loc_list=qsl,
        is_padding=[s.padding for s in seqs],
        is_decode=all(len(s.token_ids) == 1 for s in seqs),
    )
