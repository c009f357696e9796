"""RWKV-4's two token mixers (the state kind "rwkv"), each over its input x and the previous token's x:

    mix(m) = x * m + x_prev * (1 - m)                      (per channel; x_prev: the token shift)
    time mix:    out = output(sigmoid(receptance(mix(m_r))) * WKV(key(mix(m_k)), value(mix(m_v))))
    channel mix: out = sigmoid(receptance(mix(m_r))) * value(relu(key(mix(m_k)))^2)

The token shift is a depthwise causal conv of kernel 2 with taps (1, 0): the conv kernels read and write its
window (the previous input) at every chunk end and checkpoint like any conv state, and 1 * x + 0 * y is exact.
The WKV recurrence runs in kernels/wkv.py, which writes the running slot, every checkpoint and the positions.
"""

from __future__ import annotations

import torch

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.layers.conv import TokenShift
from recap.model.layers.linear import Linear, empty_param
from recap.model.layers.mixer import Mixer
from recap.model.rwkv_config import RwkvConfig


def _mix(x: torch.Tensor, prev: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return x * m + prev * (1 - m)  # transformers' order of operations


class RwkvTimeMix(Mixer):
    """Weights as on disk: `time_decay`, `time_first` [A] (fp32, as transformers keeps them), `time_mix_key`,
    `time_mix_value`, `time_mix_receptance` [1, 1, D], `key`, `value`, `receptance` [A, D], `output` [D, A]."""

    cache_group = "state"

    def __init__(self, hidden_size: int, cfg: RwkvConfig, dtype: torch.dtype, layer: int) -> None:
        super().__init__()
        a = cfg.attention_size
        self.scale = cfg.output_scale(layer)
        self.time_decay = empty_param(a, dtype=torch.float32)
        self.time_first = empty_param(a, dtype=torch.float32)
        self.time_mix_key = empty_param(1, 1, hidden_size, dtype=dtype)
        self.time_mix_value = empty_param(1, 1, hidden_size, dtype=dtype)
        self.time_mix_receptance = empty_param(1, 1, hidden_size, dtype=dtype)
        self.key = Linear(hidden_size, a, False, dtype)
        self.value = Linear(hidden_size, a, False, dtype)
        self.receptance = Linear(hidden_size, a, False, dtype)
        self.output = Linear(a, hidden_size, False, dtype)
        self.shift = TokenShift(hidden_size, dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        """x [T, D] (ln1's output) -> [T, D]; reads and updates this layer's `shift_att` and `wkv` tensors."""
        meta = batch.ssm
        if meta is None:
            raise ValueError("an RWKV layer needs batch.ssm metadata")
        state = self.layer_cache(caches, layer)
        prev = self.shift(x, state["shift_att"], batch)
        k = self.key(_mix(x, prev, self.time_mix_key[0]))
        v = self.value(_mix(x, prev, self.time_mix_value[0]))
        r = torch.sigmoid(self.receptance(_mix(x, prev, self.time_mix_receptance[0])))
        w = -torch.exp(self.time_decay.float())
        wkv = batch.kernels.wkv_scan(k, v, w, self.time_first, state["wkv"], meta, caches.slot_positions)
        out = self.output(r * wkv.to(r.dtype))
        return out if self.scale == 1.0 else out * self.scale


class RwkvChannelMix(Mixer):
    """Weights as on disk: `time_mix_key`, `time_mix_receptance` [1, 1, D], `key` [F, D], `receptance` [D, D],
    `value` [D, F]."""

    cache_group = "state"

    def __init__(self, hidden_size: int, cfg: RwkvConfig, dtype: torch.dtype, layer: int) -> None:
        super().__init__()
        self.scale = cfg.output_scale(layer)
        self.time_mix_key = empty_param(1, 1, hidden_size, dtype=dtype)
        self.time_mix_receptance = empty_param(1, 1, hidden_size, dtype=dtype)
        self.key = Linear(hidden_size, cfg.intermediate_size, False, dtype)
        self.receptance = Linear(hidden_size, hidden_size, False, dtype)
        self.value = Linear(cfg.intermediate_size, hidden_size, False, dtype)
        self.shift = TokenShift(hidden_size, dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, layer: int) -> torch.Tensor:
        """x [T, D] (ln2's output) -> [T, D]; reads and updates this layer's `shift_ffn` tensor."""
        prev = self.shift(x, self.layer_cache(caches, layer)["shift_ffn"], batch)
        key = torch.square(torch.relu(self.key(_mix(x, prev, self.time_mix_key[0]))))
        value = self.value(key)
        if self.scale != 1.0:
            value = value * self.scale
        return torch.sigmoid(self.receptance(_mix(x, prev, self.time_mix_receptance[0]))) * value
