"""Per-layer cache tensors: paged K/V for attention layers, state slots for recurrent layers.

A *state slot* s is index s of every state tensor of every recurrent layer (and of `slot_positions`):
one sequence's whole recurrent state. Each layer's tensors are the ones its kind declares
(`ModelConfig.state_specs`: e.g. conv window + SSM state for Mamba, conv window + matrix state for
Gated DeltaNet); everything here iterates over them without knowing the kind. Recurrent states are
kept in fp32 whatever the model dtype (the specs say so).
`slot_positions[s]` is the absolute position (tokens folded in) of the state the kernels last wrote
into slot s; the runner reads it to report checkpoint provenance (DESIGN invariant 2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from recap.model.model_config import ModelConfig

UNWRITTEN = -1  # slot_positions value of a slot no kernel has written
# Zero-filled tensors of these (shape, dtype)s, or None to leave them to torch.zeros: a backend's placement of
# the pools (recap/backends/huge_pages.py puts them in one mapping on transparent huge pages).
TensorAllocator = Callable[[Sequence[tuple[tuple[int, ...], torch.dtype]]], list[torch.Tensor] | None]


@dataclass
class KVCache:
    """One attention layer's paged tensors by name, each [NB, block_size, *per-token shape], as the layer's
    kind declares (`ModelConfig.kv_specs`): `k` and `v` [Hkv, Dh] for attention, `latent` and `rope` for MLA."""

    tensors: dict[str, torch.Tensor]

    @property
    def k_cache(self) -> torch.Tensor:
        return self.tensors["k"]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.tensors["v"]

    def token_bytes(self) -> int:
        return sum(t[0, 0].nbytes for t in self.tensors.values())

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


@dataclass
class StateCache:
    """One recurrent layer's state tensors by name, each [S, *spec.shape], in the order the layer declares."""

    tensors: dict[str, torch.Tensor]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def slot_bytes(self) -> int:
        return sum(t[0].nbytes for t in self.tensors.values())


@dataclass
class ModelCaches:
    kv: dict[int, KVCache]  # by layer index: full-attention layers (the KV group)
    state: dict[int, StateCache]  # by layer index
    slot_positions: torch.Tensor  # [S] int64
    block_size: int
    num_kv_blocks: int
    num_state_slots: int
    # Sliding-window layers (the window group), by layer index, over their own pool of blocks.
    window: dict[int, KVCache] = field(default_factory=dict)
    num_window_blocks: int = 0

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_kv_blocks: int,
        block_size: int,
        num_state_slots: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        num_window_blocks: int | None = None,
        zeros: TensorAllocator | None = None,
    ) -> ModelCaches:
        """Zero-filled caches for `config` (K/V in `dtype`; each state tensor in its spec's dtype or `dtype`).

        num_window_blocks: the window group's pool (None: as many blocks as the KV pool).
        zeros: the backend's allocator of the pools on `device` (the CPU backend's puts them on transparent huge
        pages where the platform allows: decode steps stream the states and K/V they read); None, or its None:
        torch.zeros."""
        if num_window_blocks is None:
            num_window_blocks = num_kv_blocks if config.window_layers else 0
        kv_specs = [
            (into, i, name, (num_blocks, block_size, *shape), dtype)
            for layers, into, num_blocks in (
                (config.full_attention_layers, "kv", num_kv_blocks),
                (config.window_layers, "window", num_window_blocks),
            )
            for i in layers
            for name, shape in config.kv_specs(i)
        ]  # fmt: skip
        state_specs = [
            ("state", i, spec.name, (num_state_slots, *spec.shape), spec.resolve_dtype(dtype))
            for i in config.ssm_layers
            for spec in config.state_specs(i)
        ]
        specs = kv_specs + state_specs
        tensors = None if zeros is None else zeros([(shape, dt) for _, _, _, shape, dt in specs])
        if tensors is None:
            tensors = [torch.zeros(shape, dtype=dt, device=device) for _, _, _, shape, dt in specs]
        groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {"kv": {}, "window": {}, "state": {}}
        for (group, i, name, _, _), t in zip(specs, tensors):
            groups[group].setdefault(i, {})[name] = t
        kv = {i: KVCache(ts) for i, ts in groups["kv"].items()}
        window = {i: KVCache(ts) for i, ts in groups["window"].items()}
        state = {i: StateCache(ts) for i, ts in groups["state"].items()}
        slots = max(num_state_slots, 0)
        return cls(
            kv=kv,
            state=state,
            slot_positions=torch.full((slots,), UNWRITTEN, dtype=torch.int64, device=device),
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            num_state_slots=num_state_slots,
            window=window,
            num_window_blocks=num_window_blocks,
        )

    @torch.inference_mode()  # also valid when the caches were allocated under inference mode
    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        """Copy slot src into slot dst across every state tensor of every layer (copy-on-write of a checkpoint)."""
        for t in self.state_tensors():
            t[dst_slot].copy_(t[src_slot])
        self.slot_positions[dst_slot] = self.slot_positions[src_slot]

    def copy_checkpoints(self, writes: Iterable[tuple[int, int, int]]) -> None:
        """For each (running slot, position, checkpoint slot): copy the running slot's state, every layer's, to the
        checkpoint slot (a captured decode step's block-completing rows), checking the position it holds."""
        for src, position, dst in writes:
            self.copy_state(src, dst)
            written = int(self.slot_positions[dst])
            assert written == position, f"checkpoint slot {dst} holds position {written}, planned {position}"

    @torch.inference_mode()
    def clear_slot(self, slot: int) -> None:
        """Zero a slot (not needed for correctness: a row without context never reads its slot)."""
        for t in self.state_tensors():
            t[slot].zero_()
        self.slot_positions[slot] = UNWRITTEN

    def state_tensors(self) -> list[torch.Tensor]:
        """Every state tensor of every recurrent layer, layers in order, each layer's in declared order."""
        return [t for i in sorted(self.state) for t in self.state[i].tensors.values()]

    def named_state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(f"{layer}.{name}", tensor) for state_tensors(): the names the disaggregated transfer uses."""
        return [(f"{i}.{n}", t) for i in sorted(self.state) for n, t in self.state[i].tensors.items()]

    def state_bytes_per_slot(self) -> int:
        return sum(s.slot_bytes() for s in self.state.values())

    def kv_bytes_per_token(self) -> int:
        return sum(c.token_bytes() for c in self.kv.values())

    def window_bytes_per_token(self) -> int:
        return sum(c.token_bytes() for c in self.window.values())

    def total_bytes(self) -> int:
        kv = sum(c.nbytes() for c in [*self.kv.values(), *self.window.values()])
        st = sum(t.nbytes for t in self.state_tensors())
        return kv + st + self.slot_positions.nbytes
