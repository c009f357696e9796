"""FP8 pre-quantized linears (compressed-tensors float-quantized, DeepSeek/Qwen "fp8", ModelOpt FP8) -> the
dense weight they stand for, w = float(weight) * scale, in fp32.

recap has no FP8 kernel; the loader writes this weight into the layer (in the model dtype), and the layer is then
quantized like any dense one (prequantized.serving_format: int8 per channel by default). The scale is one of:
- per tensor: one value (shape [], [1] or [1, 1]);
- per output channel: [out] or [out, 1];
- per block: [ceil(out / b0), ceil(in / b1)] for the format's block (b0, b1) (128 x 128 in the hub's releases),
  each scale covering a b0 x b1 tile of the weight (the last ones cut at the edges).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from recap.model.prequantized import Prequantized, PrequantizedCheckpointError


def fp8_scale_grid(scale: torch.Tensor, out: int, k: int, block: tuple[int, int] | None, name: str) -> torch.Tensor:
    """The scale of every weight, broadcastable to [out, k] (fp32)."""
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(1, 1)
    if s.numel() == out and (s.dim() == 1 or s.shape[-1] == 1):
        return s.reshape(out, 1)
    b0, b1 = block or (128, 128)
    if s.dim() == 2 and tuple(s.shape) == (-(-out // b0), -(-k // b1)):
        return s.repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :k]
    raise PrequantizedCheckpointError(f"{name}: a scale of shape {tuple(s.shape)} fits no per-tensor, per-channel "
                                      f"or {b0}x{b1}-block layout of a {out} x {k} weight")  # fmt: skip


def dequantize_fp8(fmt: Prequantized, parts: Mapping[str, torch.Tensor], out: int, k: int, name: str) -> torch.Tensor:
    """A layer's parts (by suffix) -> its weight [out, k] fp32."""
    w = parts["weight"]
    if tuple(w.shape) != (out, k):
        raise PrequantizedCheckpointError(f"{name}.weight: shape {tuple(w.shape)}, expected {(out, k)}")
    if w.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):
        raise PrequantizedCheckpointError(f"{name}.weight: {w.dtype}, expected float8_e4m3fn")
    scale_key = "weight_scale_inv" if fmt.method == "fp8" else "weight_scale"
    grid = fp8_scale_grid(parts[scale_key], out, k, fmt.block, f"{name}.{scale_key}")
    zp = parts.get("weight_zero_point")
    shift = 0.0 if zp is None else fp8_scale_grid(zp, out, k, fmt.block, f"{name}.weight_zero_point")
    return (w.float() - shift) * grid
