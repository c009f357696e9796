"""Per-layer cache tensors: paged K/V for attention layers, conv + SSM state slots for SSM layers.

A *state slot* s is index s of every SSM layer's conv_state and ssm_state (and of `slot_positions`):
one sequence's whole recurrent state. SSM state is kept in fp32 whatever the model dtype.
`slot_positions[s]` is the absolute position (tokens folded in) of the state the kernels last wrote
into slot s; the runner reads it to report checkpoint provenance (DESIGN invariant 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from recap.model.config import ModelConfig

UNWRITTEN = -1  # slot_positions value of a slot no kernel has written


@dataclass
class KVCache:
    k_cache: torch.Tensor  # [NB, block_size, Hkv, Dh]
    v_cache: torch.Tensor


@dataclass
class StateCache:
    conv_state: torch.Tensor  # [S, conv_dim, K-1]
    ssm_state: torch.Tensor  # [S, I, N] (Mamba1) or [S, H, P, N] (Mamba2), fp32


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
        num_window_blocks: int = 0,
    ) -> ModelCaches:
        """Zero-filled caches for `config` (K/V and conv state in `dtype`, SSM state in fp32)."""
        kv: dict[int, KVCache] = {}
        window: dict[int, KVCache] = {}
        if config.attention is not None:
            a = config.attention
            for layers, into, num_blocks in (
                (config.full_attention_layers, kv, num_kv_blocks),
                (config.window_layers, window, num_window_blocks),
            ):
                shape = (num_blocks, block_size, a.num_kv_heads, a.head_dim)
                for i in layers:
                    into[i] = KVCache(
                        torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
                    )
        state: dict[int, StateCache] = {}
        for i in config.ssm_layers:
            conv, ssm = config.ssm_state_shapes(i)
            state[i] = StateCache(
                torch.zeros((num_state_slots, *conv), dtype=dtype, device=device),
                torch.zeros((num_state_slots, *ssm), dtype=torch.float32, device=device),
            )
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
        """Copy slot src into slot dst across every SSM layer (copy-on-write of a checkpoint)."""
        for s in self.state.values():
            s.conv_state[dst_slot].copy_(s.conv_state[src_slot])
            s.ssm_state[dst_slot].copy_(s.ssm_state[src_slot])
        self.slot_positions[dst_slot] = self.slot_positions[src_slot]

    @torch.inference_mode()
    def clear_slot(self, slot: int) -> None:
        """Zero a slot (not needed for correctness: a row without context never reads its slot)."""
        for s in self.state.values():
            s.conv_state[slot].zero_()
            s.ssm_state[slot].zero_()
        self.slot_positions[slot] = UNWRITTEN

    def state_bytes_per_slot(self) -> int:
        return sum(s.conv_state[0].nbytes + s.ssm_state[0].nbytes for s in self.state.values())

    def kv_bytes_per_token(self) -> int:
        return sum((c.k_cache[0, 0].nbytes + c.v_cache[0, 0].nbytes) for c in self.kv.values())

    def window_bytes_per_token(self) -> int:
        return sum((c.k_cache[0, 0].nbytes + c.v_cache[0, 0].nbytes) for c in self.window.values())

    def total_bytes(self) -> int:
        kv = sum(c.k_cache.nbytes + c.v_cache.nbytes for c in [*self.kv.values(), *self.window.values()])
        st = sum(s.conv_state.nbytes + s.ssm_state.nbytes for s in self.state.values())
        return kv + st + self.slot_positions.nbytes
