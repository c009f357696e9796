"""Pre-quantized checkpoints: which on-disk format a config.json's `quantization_config` names, and which recap
format it runs in.

Formats read (anything else: UnsupportedQuantizationError naming the method and this list):
- "gptq" (AutoGPTQ / gptqmodel, 4 bits): `qweight` int32 [in/8, out] (8 codes per word along the inputs, code k
  at bits 4k), `qzeros` int32 [groups, out/8] (along the outputs; checkpoint_format "gptq" stores z - 1,
  "gptq_v2" z), `scales` fp16 [groups, out], `g_idx` int32 [in] (each input's group); w = s (q - z).
- "awq" (AutoAWQ, version "gemm", 4 bits): `qweight` int32 [in, out/8] and `qzeros` int32 [groups, out/8], both
  packed along the outputs in AWQ's order (nibble k holds output 8j + [0, 2, 4, 6, 1, 3, 5, 7][k]), `scales`
  fp16 [groups, out]; w = s (q - z).
- "compressed-tensors" (llm-compressor), format "pack-quantized", 4-bit int weights, strategy group / channel:
  `weight_packed` int32 [out, ceil(in/8)] (along the inputs, code k at bits 4k, stored as q + 8),
  `weight_scale` [out, groups], optional `weight_zero_point` (int32 packed along the outputs, or int8 [out,
  groups]), `weight_g_idx`, `weight_shape` [2]; w = s (q - zp).
- "compressed-tensors", format "float-quantized" or "naive-quantized", 8-bit float weights (strategy tensor,
  channel or block): `weight` float8_e4m3fn [out, in], `weight_scale`; w = weight * scale.
- "fp8" (DeepSeek-V3 / Qwen3 FP8 releases): `weight` float8_e4m3fn, `weight_scale_inv` fp32 per
  weight_block_size block (128 x 128); w = weight * scale (despite the name).
- "modelopt", quant_algo "FP8" (NVIDIA's releases, e.g. Nemotron-3 Nano FP8): `weight` float8_e4m3fn,
  `weight_scale` per tensor; w = weight * scale.
Activation scales (`input_scale`, and ModelOpt's `k_scale` / `v_scale` for an FP8 KV cache) are read and
dropped: recap quantizes activations per row (int8) or per group (int4) as it runs, and keeps its KV cache in
the model dtype.

Where they run (`serving_format`): 4-bit formats in recap's int4 (kernels/linear_int4.py) by default, the codes
and scales as they are (prequantized_int4.py); FP8 dequantized to the model dtype and, by default, quantized
again to recap's per-channel int8 (prequantized_fp8.py). A quantization asked for explicitly, or none at all
(`dequantize`), goes through the dequantized weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED = ("gptq (4-bit)", "awq (4-bit, version gemm)", "compressed-tensors pack-quantized (4-bit int)",
             "compressed-tensors float-quantized / naive-quantized (FP8 e4m3)", "fp8 (block-wise)",
             "modelopt (quant_algo FP8)")  # fmt: skip


class UnsupportedQuantizationError(ValueError):
    """A config.json `quantization_config` recap cannot load: its method, bits or options."""


class PrequantizedCheckpointError(ValueError):
    """A pre-quantized checkpoint whose tensors do not fit its format (shapes, missing or extra parts)."""


@dataclass(frozen=True)
class Prequantized:
    """One checkpoint's quantization: what the tensors of each quantized linear are called and mean."""

    method: str  # quant_method: gptq, awq, compressed-tensors, fp8, modelopt
    kind: str  # "int4" (4-bit integer codes) or "fp8" (float8_e4m3fn weights)
    marker: str  # the part whose presence makes a linear quantized
    required: tuple[str, ...]  # parts every quantized linear has, in place of `weight`
    optional: tuple[str, ...] = ()  # parts some checkpoints add (g_idx, a symmetric layer's zero points)
    dropped: tuple[str, ...] = ()  # parts read and ignored (activation scales)
    group: int = 0  # int4: inputs per scale (-1: one per row)
    sym: bool = True  # int4: the config says symmetric (the zero points decide per layer)
    zero_offset: int = 0  # GPTQ v1 stores each zero point minus one
    block: tuple[int, int] | None = None  # fp8: the scales' block [out, in] where they are block-wise

    @property
    def parts(self) -> tuple[str, ...]:
        return self.required + self.optional + self.dropped

    def describe(self) -> str:
        if self.kind == "int4":
            g = "per-channel" if self.group == -1 else f"g{self.group}"
            return f"{self.method} 4-bit {g} {'sym' if self.sym else 'asym'}"
        scale = f"{self.block[0]}x{self.block[1]} blocks" if self.block else "per-tensor/per-channel scales"
        return f"{self.method} FP8 e4m3 ({scale})"


def _refuse(method: str, why: str) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(f"quantization_config {method!r}: {why}; recap loads {', '.join(SUPPORTED)}")


def _int4_group(method: str, group: Any) -> int:
    group = -1 if group in (None, -1) else int(group)
    if group != -1 and (group <= 0 or group % 32):
        raise _refuse(method, f"group size {group} (recap's int4 takes multiples of 32, or -1)")
    return group


def _gptq(cfg: Mapping[str, Any]) -> Prequantized:
    if cfg.get("bits") != 4:
        raise _refuse("gptq", f"{cfg.get('bits')} bits (only 4)")
    fmt = cfg.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("gptq", f"checkpoint_format {fmt!r}")
    return Prequantized("gptq", "int4", "qweight", ("qweight", "qzeros", "scales"), ("g_idx",),
                        group=_int4_group("gptq", cfg.get("group_size", 128)), sym=bool(cfg.get("sym", True)),
                        zero_offset=1 if fmt == "gptq" else 0)  # fmt: skip


def _awq(cfg: Mapping[str, Any]) -> Prequantized:
    bits, version = cfg.get("bits", cfg.get("w_bit")), str(cfg.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise _refuse("awq", f"{bits} bits, version {version!r} (only 4 bits, gemm)")
    group = _int4_group("awq", cfg.get("group_size", cfg.get("q_group_size", 128)))
    return Prequantized("awq", "int4", "qweight", ("qweight", "qzeros", "scales"), group=group,
                        sym=not cfg.get("zero_point", True))  # fmt: skip


def _compressed_tensors(cfg: Mapping[str, Any]) -> Prequantized:
    fmt = cfg.get("format")
    groups = list((cfg.get("config_groups") or {}).values())
    specs = {repr(g.get("weights")) for g in groups}
    if not groups or len(specs) != 1:
        raise _refuse("compressed-tensors", f"{len(specs)} different weight schemes (recap takes one)")
    w = groups[0].get("weights") or {}
    bits, typ, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    if fmt == "pack-quantized" and bits == 4 and typ == "int" and strategy in ("group", "channel"):
        group = _int4_group("compressed-tensors", w.get("group_size") if strategy == "group" else -1)
        return Prequantized("compressed-tensors", "int4", "weight_packed", ("weight_packed", "weight_scale"),
                            ("weight_zero_point", "weight_g_idx", "weight_shape"), group=group,
                            sym=bool(w.get("symmetric", True)))  # fmt: skip
    if fmt in ("float-quantized", "naive-quantized") and bits == 8 and typ == "float":
        if strategy not in ("tensor", "channel", "block"):
            raise _refuse("compressed-tensors", f"FP8 weights with strategy {strategy!r}")
        bs = w.get("block_structure") or (128, 128)
        block = (int(bs[0]), int(bs[1])) if strategy == "block" else None
        return Prequantized("compressed-tensors", "fp8", "weight_scale", ("weight", "weight_scale"),
                            ("weight_zero_point",), ("input_scale",), block=block)  # fmt: skip
    raise _refuse("compressed-tensors", f"format {fmt!r} with {bits}-bit {typ} weights, strategy {strategy!r}")


def _fp8(cfg: Mapping[str, Any]) -> Prequantized:
    block = cfg.get("weight_block_size")
    if block is not None and len(block) != 2:
        raise _refuse("fp8", f"weight_block_size {block}")
    return Prequantized("fp8", "fp8", "weight_scale_inv", ("weight", "weight_scale_inv"), (), ("input_scale",),
                        block=None if block is None else (int(block[0]), int(block[1])))  # fmt: skip


def _modelopt(cfg: Mapping[str, Any]) -> Prequantized:
    algo = cfg.get("quant_algo") or (cfg.get("quantization") or {}).get("quant_algo")
    if algo != "FP8":
        raise _refuse("modelopt", f"quant_algo {algo!r} (only FP8)")
    return Prequantized("modelopt", "fp8", "weight_scale", ("weight", "weight_scale"), (),
                        ("input_scale", "k_scale", "v_scale"))  # fmt: skip


_METHODS = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors, "fp8": _fp8,
            "modelopt": _modelopt}  # fmt: skip


def prequantized_format(hf: Mapping[str, Any]) -> Prequantized | None:
    """The format a config.json dict declares (None: no quantization_config); UnsupportedQuantizationError for
    one recap does not load."""
    cfg = hf.get("quantization_config")
    if cfg is None and isinstance(hf.get("text_config"), Mapping):
        cfg = hf["text_config"].get("quantization_config")
    if cfg is None:
        return None
    method = str(cfg.get("quant_method", "")).lower()
    if method not in _METHODS:
        raise _refuse(method, "an unknown method")
    return _METHODS[method](cfg)


def serving_format(fmt: Prequantized, quantization: str | None, dequantize: bool, on_cpu: bool) -> str | None:
    """The linear backend a pre-quantized checkpoint runs on: the quantization asked for; None with `dequantize`
    (dense weights in the model dtype) or off the CPU (recap's quantized kernels are CPU ones); otherwise int4
    for 4-bit checkpoints, int8 for FP8 (the nearest of recap's formats: 8 bits, per channel)."""
    if quantization is not None:
        return quantization
    if dequantize or not on_cpu:
        return None
    return "int4" if fmt.kind == "int4" else "int8"


def conversion(fmt: Prequantized, target: str | None, dtype_name: str, layers: int, max_error: float) -> str:
    """How the checkpoint's `layers` quantized linears became the served ones, in words (the load's log line);
    max_error: the largest change of a weight the int4 packing made (its fp16 mins)."""
    if fmt.kind == "int4" and target == "int4":
        g = 64 if fmt.group == 64 else 32  # act-order g_idx may turn 64 into 32 (prequantized_int4.to_int4)
        form = "symmetric" if fmt.sym else "with mins"
        repeat = "" if fmt.group in (32, 64) else f"; each scale repeated over its {g}-input subgroups"
        how = "exact" if max_error == 0 else f"largest weight change {max_error:.1e} (fp16 mins -s z / scales)"
        return f"{fmt.describe()} -> recap int4 g{g} {form}, {how} ({layers} layers, codes as stored{repeat})"
    if target is None:
        return f"{fmt.describe()} -> dequantized to {dtype_name} ({layers} layers)"
    return f"{fmt.describe()} -> dequantized to {dtype_name}, then {target} (requantized; {layers} layers)"
