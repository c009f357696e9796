"""4-bit pre-quantized linears (GPTQ, AWQ, compressed-tensors pack-quantized) -> recap's int4 tiles, exactly.

Every format stores codes q in 0..15, a scale s and a zero point z per group of inputs, w = s (q - z)
(prequantized.py has each layout). recap's int4 (kernels/linear_int4.py) keeps per group of 32 (or 64) inputs
an fp16 scale and either w = s (q - 8) or w = s q + m. So the codes and scales carry over as they are: a layer
whose zero points are all 8 is symmetric recap int4, bit for bit; any other is the asymmetric form with
m = -s z (rounded to fp16, |error| <= 2^-11 |s z|). A source group of 64 is recap's g64; 32, and any multiple
of 32 (128, a whole row), recap's g32 with the group's scale repeated over its subgroups. `g_idx` (act-order
checkpoints) maps each input to its group: it works wherever each 32-input block of inputs lies in one group;
a permutation that splits a block is refused (PrequantizedCheckpointError).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from recap.kernels.linear_int4 import TILE, Int4Weight, pack
from recap.model.prequantized import Prequantized, PrequantizedCheckpointError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of an AWQ word holds output 8j + AWQ_ORDER[k]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass
class Int4Codes:
    """A 4-bit layer in one common form: w[o, i] = scales[o, g[i]] * (codes[o, i] - zeros[o, g[i]])."""

    codes: torch.Tensor  # [out, in] int32, 0..15
    scales: torch.Tensor  # [out, groups] fp32
    zeros: torch.Tensor  # [out, groups] int32
    group_of: torch.Tensor  # [in] int64: each input's group

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] fp32 the checkpoint stands for (the reference)."""
        g = self.group_of
        return self.scales[:, g] * (self.codes - self.zeros[:, g]).float()


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> int32 [..., n * 8], nibble k of each word at position 8j + k."""
    return ((words[..., None] >> _SHIFTS) & 15).flatten(-2)


def _group_of(g_idx: torch.Tensor | None, group: int, k: int) -> torch.Tensor:
    if g_idx is not None:
        return g_idx.long()
    return torch.arange(k) // (k if group == -1 else group)


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise PrequantizedCheckpointError(f"{name}: shape {tuple(t.shape)}, expected {shape}")


def int4_codes(fmt: Prequantized, parts: Mapping[str, torch.Tensor], out: int, k: int, name: str) -> Int4Codes:
    """A layer's parts (by suffix) in `fmt`, for a linear of `k` inputs and `out` outputs -> Int4Codes."""
    if fmt.method == "compressed-tensors":
        return _compressed_tensors(fmt, parts, out, k, name)
    if k % 8 or out % 8:
        raise PrequantizedCheckpointError(f"{name}: {fmt.method} packs 8 codes per word; {out} x {k} does not")
    qw, qz, s = parts["qweight"], parts["qzeros"], parts["scales"]
    ng = s.shape[0]
    _check(f"{name}.scales", s, (ng, out))
    _check(f"{name}.qzeros", qz, (ng, out // 8))
    if fmt.method == "gptq":
        _check(f"{name}.qweight", qw, (k // 8, out))
        codes = _nibbles(qw.T.int())  # [out, in]
        zeros = _nibbles(qz.int()).T + fmt.zero_offset
    else:
        _check(f"{name}.qweight", qw, (k, out // 8))
        order = torch.tensor(AWQ_ORDER)
        codes = _nibbles(qw.int()).view(k, out // 8, 8)[..., torch.argsort(order)].reshape(k, out).T
        zeros = _nibbles(qz.int()).view(ng, out // 8, 8)[..., torch.argsort(order)].reshape(ng, out).T
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        _check(f"{name}.g_idx", g_idx, (k,))
    group_of = _group_of(g_idx, fmt.group, k)
    if group_of.min() < 0 or group_of.max() >= ng:
        raise PrequantizedCheckpointError(f"{name}: g_idx points outside its {ng} groups")
    return Int4Codes(codes.contiguous(), s.T.float().contiguous(), zeros.contiguous(), group_of)


def _compressed_tensors(fmt: Prequantized, parts: Mapping[str, torch.Tensor], out: int, k: int,
                        name: str) -> Int4Codes:  # fmt: skip
    packed, s = parts["weight_packed"], parts["weight_scale"]
    _check(f"{name}.weight_packed", packed, (out, -(-k // 8)))
    shape = parts.get("weight_shape")
    if shape is not None and tuple(int(v) for v in shape.flatten()) != (out, k):
        raise PrequantizedCheckpointError(f"{name}.weight_shape {shape.tolist()} for a {out} x {k} linear")
    if s.dim() == 1:
        s = s[:, None]
    ng = s.shape[1]
    _check(f"{name}.weight_scale", s, (out, ng))
    codes = _nibbles(packed.int())[:, :k]
    zp = parts.get("weight_zero_point")
    if zp is None:
        zeros = torch.full((out, ng), 8, dtype=torch.int32)
    elif zp.dtype == torch.int32 and tuple(zp.shape) == (-(-out // 8), ng):  # packed along the outputs
        zeros = _nibbles(zp.T.contiguous()).T[:out].contiguous()
    else:
        _check(f"{name}.weight_zero_point", zp.reshape(out, -1), (out, ng))
        zeros = zp.reshape(out, ng).int() + 8  # stored signed, like the codes
    group_of = _group_of(parts.get("weight_g_idx"), fmt.group, k)
    if group_of.shape != (k,) or group_of.min() < 0 or group_of.max() >= ng:
        raise PrequantizedCheckpointError(f"{name}: weight_g_idx does not map {k} inputs onto {ng} groups")
    return Int4Codes(codes.contiguous(), s.float().contiguous(), zeros, group_of)


def block_groups(group_of: torch.Tensor, g: int) -> torch.Tensor | None:
    """[ceil(in / g)]: the source group of each g-input block of recap's; None where a block spans two groups."""
    k = group_of.shape[0]
    blocks = F.pad(group_of, (0, -k % g), value=-1).view(-1, g)
    first = blocks[:, :1]
    return first[:, 0] if bool(((blocks == first) | (blocks == -1)).all()) else None


def to_int4(c: Int4Codes, group: int, name: str) -> tuple[Int4Weight, float]:
    """Int4Codes from a checkpoint of `group` inputs per scale -> recap's Int4Weight (no bias: the layer adds
    its own) and the largest |error| of a weight it introduces (0.0 where the scales are fp16 and the layer
    symmetric). Groups of 64 where the source's are 64 and its g_idx allows, else 32."""
    out, k = c.codes.shape
    g, src = 64, block_groups(c.group_of, 64) if group == 64 else None
    if src is None:
        g, src = 32, block_groups(c.group_of, 32)
    if src is None:
        raise PrequantizedCheckpointError(f"{name}: its g_idx (act-order) puts inputs of one 32-input block in "
                                          "different groups; recap's int4 cannot hold that layout")  # fmt: skip
    ng, outp = src.shape[0], -(-out // TILE) * TILE
    q = F.pad(c.codes, (0, ng * g - k, 0, outp - out), value=8).view(outp, ng, g).to(torch.uint8)
    s = F.pad(c.scales[:, src], (0, 0, 0, outp - out))
    s16 = s.half()
    if not torch.isfinite(s16).all():
        raise PrequantizedCheckpointError(f"{name}: scales beyond fp16's range")
    zeros = F.pad(c.zeros[:, src], (0, 0, 0, outp - out), value=8)
    err = float((s16.float() - s).abs().mul(15).max())  # a scale's rounding, times up to 15 code steps
    if bool((zeros == 8).all()):
        return Int4Weight(pack(q, s16, None), out, k, g, False, None), err
    m = -(s16.float() * zeros.float())
    m16 = m.half()
    err += float((m16.float() - m).abs().max())
    return Int4Weight(pack(q, s16, m16), out, k, g, True, None), err
