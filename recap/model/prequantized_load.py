"""The loader's hook for a pre-quantized checkpoint (model/prequantized.py): which linear layers the checkpoint
stores quantized, their parts as they are read, and each layer's weights once its last part is in.

The checkpoint's keys are read first (headers only): a layer is quantized where its format's marker part is
there (`qweight`, `weight_packed`, `weight_scale`, `weight_scale_inv`); its parts then stand in for its
`weight` key. Strict like the loader: a quantized layer lacking a required part, a part of a layer the model
does not have (or that is not a Linear), a duplicate, a 4-bit layer that also has a dense `weight`: errors.
A layer is converted as soon as its parts are in (the parts then freed), so the peak stays one layer:
- 4-bit format, served as int4 on the CPU: the codes and scales packed into recap's int4 tiles
  (prequantized_int4.py), installed once the layer's bias is in (`on_loaded`);
- otherwise: the dequantized weight written into the layer's weight (the model dtype), which the loader's
  `on_loaded` then quantizes like a dense one (int8, int4) or keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import BinaryIO

import torch
from torch import nn

from recap.kernels.linear_int4 import Int4Weight
from recap.model.layers.int4_linear import Int4Linear
from recap.model.layers.linear import Linear
from recap.model.models.base import CausalLM
from recap.model.prequantized import (
    Prequantized,
    PrequantizedCheckpointError,
    UnsupportedQuantizationError,
    conversion,
)
from recap.model.prequantized_fp8 import dequantize_fp8
from recap.model.prequantized_int4 import int4_codes, to_int4
from recap.model.safetensors_file import StoredTensor, read_tensor


class QuantizedLinears:
    """One load's quantized layers: `claim` takes their tensors, `on_loaded` installs the int4 ones."""

    def __init__(self, fmt: Prequantized, model: CausalLM, checkpoint_keys: Iterable[str], target: str | None,
                 on_cpu: bool) -> None:  # fmt: skip
        self.fmt, self.target = fmt, target
        self.exact = fmt.kind == "int4" and target == "int4" and on_cpu  # codes packed as they are
        keys = set(checkpoint_keys)
        modules = dict(model.named_modules())
        self.layers: dict[str, tuple[str, Linear]] = {}  # raw prefix -> (the model's weight key, its Linear)
        self.present: dict[str, set[str]] = {}  # raw prefix -> the parts the checkpoint has for it
        self.skipped: set[str] = set()  # a tied head's quantized copy (the embedding is the head)
        skip = tuple(model.ignored_checkpoint_prefixes)  # a vision tower's layers: the loader skips them
        for raw in sorted(keys):
            prefix, _, part = raw.rpartition(".")
            if part != fmt.marker or raw.startswith(skip):
                continue
            key = model.rename_checkpoint_key(prefix + ".weight")
            if key is None:
                continue  # a weight the family does not use: the loader skips its parts like the weight
            layer = modules.get(key.removesuffix(".weight"))
            if not isinstance(layer, Linear):
                what = "no such layer" if layer is None else f"a {type(layer).__name__}, not a linear layer"
                raise UnsupportedQuantizationError(f"{fmt.method} weights for {prefix!r}: the model has {what}; "
                                                   "recap loads pre-quantized linear layers only")  # fmt: skip
            present = {p for p in fmt.parts if f"{prefix}.{p}" in keys}
            if missing := [p for p in fmt.required if p not in present]:
                raise PrequantizedCheckpointError(f"missing key {prefix}.{missing[0]} ({fmt.method} layer)")
            if fmt.kind == "int4" and f"{prefix}.weight" in keys:
                raise PrequantizedCheckpointError(f"{prefix} has both a dense weight and {fmt.method} codes")
            if layer.shares_weight:
                self.skipped.add(prefix)
            self.layers[prefix], self.present[prefix] = (key, layer), present
        self.parts: dict[str, dict[str, torch.Tensor]] = {}  # parts read so far, per raw prefix
        self.packed: dict[nn.Module, Int4Weight] = {}  # int4 layers waiting for their bias
        self.converted, self.max_error = 0, 0.0

    def claim(self, stored: StoredTensor, f: BinaryIO, shard: str) -> str | None:
        """None: not a quantized layer's tensor (the loader's). Otherwise read it: "" while the layer lacks
        parts, the layer's weight key (for the loader's bookkeeping) once it is converted."""
        prefix, _, part = stored.key.rpartition(".")
        if prefix not in self.layers or part not in self.fmt.parts:
            return None
        got = self.parts.setdefault(prefix, {})
        if part in got:
            raise PrequantizedCheckpointError(f"duplicate key {stored.key!r} in {shard}")
        if prefix in self.skipped or part in self.fmt.dropped:
            got[part] = torch.empty(0)  # counted, not kept
        else:
            got[part] = read_tensor(f, stored, shard)
        if set(got) != self.present[prefix]:
            return ""
        key, layer = self.layers[prefix]
        parts = self.parts.pop(prefix)
        if prefix in self.skipped:
            return ""  # the loader skips a tied head's weight too
        self._convert(prefix, layer, parts)
        return key

    def _convert(self, prefix: str, layer: Linear, parts: dict[str, torch.Tensor]) -> None:
        out, k = layer.out_features, layer.in_features
        if self.fmt.kind == "fp8":
            w = dequantize_fp8(self.fmt, parts, out, k, prefix)
        else:
            codes = int4_codes(self.fmt, parts, out, k, prefix)
            if self.exact and not layer.reads_weight:
                self.packed[layer], err = to_int4(codes, self.fmt.group, prefix)
                self.max_error = max(self.max_error, err)
                self.converted += 1
                return
            w = codes.dequantize()
        with torch.no_grad():
            layer.weight.copy_(w)
        self.converted += 1

    def on_loaded(self, then: Callable[[nn.Module], None] | None) -> Callable[[nn.Module], None]:
        """The loader's `on_loaded`: an int4 layer gets its packed weight (with its bias, now loaded) before
        `then` (which keeps it: the layer is on int4 already)."""

        def done(module: nn.Module) -> None:
            packed = self.packed.pop(module, None)
            if packed is not None:
                assert isinstance(module, Linear)
                bias = module.bias
                packed.bias = None if bias is None else bias.detach().float().contiguous()
                module.adopt(Int4Linear(module.weight, bias, quantized=packed))
            if then is not None:
                then(module)

        return done

    def summary(self, dtype_name: str) -> str:
        """The conversion this load made, in words (model/prequantized.conversion)."""
        return conversion(self.fmt, self.target, dtype_name, self.converted, self.max_error)
