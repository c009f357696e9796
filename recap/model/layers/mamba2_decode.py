"""A Mamba2 mixer's decode step in few ops: the fast path of `Mamba2Mixer.forward` on plain decode steps.

A plain decode step (`SSMMetadata.plain_decode`: one token per row, every row continues its own slot, no
padding row) needs none of the general path's row bookkeeping; a row whose token completes a block has its
new conv and SSM states copied to its checkpoint slot afterwards, as the general path does. Profiled at batch 1
(Mamba2 115M, 1 thread), the general path ran ~121 ATen ops per layer, most of them tiny, and their
dispatch cost about as much as reading the layer's weights. This path runs the same arithmetic in ~45:

- conv: one gather of the windows, one `cat` with the new inputs, one scatter of the rolled window and
  one multiply-sum over the taps (the general kernel does a multiply-add per tap and a shifted copy);
- dt, decay and Delta x once for all rows; per row two in-place passes over the slot's state and one
  mat-vec for y (as `ssd_state_update`, without its per-row masks and zero-state handling);
- the D skip fused into one `addcmul_`; slot positions recorded by one `index_copy_`.

With the model's native decode on (`Mamba2Mixer.native_step`, fp32), everything between in_proj and out_proj
is one call of the C kernel of kernels/mamba2_step.py instead, which reads and writes each state once; the
torch code below is then its reference.

Mamba2Config's options are followed as the reference follows them (Falcon-H1's input, in_proj and output
multipliers, every `gate_norm`); a conv activation the conv kernels do not fuse (anything but silu) is not
implemented here, and `decode_supported` sends such a mixer to the reference path.

The arithmetic is the reference's (`Mamba2Mixer.forward` through the general kernels) up to the order of
the conv's tap sum: the two agree to fp32 rounding, and tests/model/test_mamba2_decode.py compares outputs
and every state on random inputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from recap.kernels.metadata import ForwardBatch
from recap.kernels.varlen import copy_decode_checkpoints

if TYPE_CHECKING:
    from recap.model.layers.mamba2 import Mamba2Mixer


def _f32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32; an fp32 x as it is (a no-op `.float()` still costs a dispatch, ~1 us, 17 times a layer)."""
    return x if x.dtype == torch.float32 else x.float()


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def decode_supported(mixer: Mamba2Mixer) -> bool:
    """Whether mamba2_decode implements every option of this mixer's config (else: the reference path)."""
    return mixer.conv1d.activation is not None and mixer.conv1d.post_activation is None


def mamba2_decode(
    mixer: Mamba2Mixer,
    hidden: torch.Tensor,
    batch: ForwardBatch,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slot_positions: torch.Tensor,
) -> torch.Tensor:
    """Mamba2Mixer.forward for a plain decode step (same arguments, outputs and cache updates)."""
    meta = batch.ssm
    assert meta is not None and meta.plain_decode, "mamba2_decode takes plain decode steps only"
    assert ssm_state.dtype == torch.float32 and ssm_state.is_contiguous()
    assert decode_supported(mixer), "mamba2_decode fuses silu only; this mixer takes the reference path"
    c = mixer.cfg
    t, dtype = hidden.shape[0], hidden.dtype
    h, p, g, n = c.num_heads, c.head_dim, c.n_groups, c.d_state
    proj = mixer.in_proj(hidden if c.input_multiplier == 1.0 else hidden * c.input_multiplier)
    if mixer.in_proj_scale is not None:
        proj = proj * mixer.in_proj_scale
    slots = meta.state_indices
    native = mixer.native_step
    if native is not None and proj.dtype == conv_state.dtype == torch.float32 and conv_state.is_contiguous():
        y = native(proj.contiguous(), slots, batch.positions, slot_positions, conv_state, ssm_state)
        _checkpoint(batch, conv_state, ssm_state, slot_positions)
        out = mixer.out_proj(y)
        return out if c.output_multiplier == 1.0 else out * c.output_multiplier
    z, xbc, dt = proj.split([c.d_inner, c.conv_dim, h], dim=-1)

    # conv: window = [the slot's K-1 inputs, the new input]; the slot keeps its last K-1 columns
    window = torch.cat((conv_state.index_select(0, slots), _as(xbc, conv_state.dtype).unsqueeze(-1)), dim=-1)
    conv_state.index_copy_(0, slots, window[:, :, 1:])
    conv = mixer.conv1d
    xbc = (_f32(window) * _f32(conv.weight).squeeze(1)).sum(-1)  # (t, conv_dim)
    if conv.bias is not None:
        xbc += _f32(conv.bias)
    xbc = _f32(_as(F.silu(xbc, inplace=True), dtype))  # rounded to the model dtype, as the conv kernel returns
    x, b, cc = xbc.split([c.d_inner, g * n, g * n], dim=-1)

    # SSD: h = exp(dt A) h + (dt x) B^T in each slot, y = h C + D x
    d = _f32(dt) + _f32(mixer.dt_bias)
    d = F.softplus(d)
    if c.time_step_limit != (0.0, float("inf")):
        d = d.clamp(min=c.time_step_limit[0], max=c.time_step_limit[1])
    decay = torch.exp(d * torch.exp(_f32(mixer.A_log)).neg_()).view(t, g, h // g, 1, 1).unbind(0)
    x = x.reshape(t, h, p)
    dx = (x * d[..., None]).view(t, g, h // g, p, 1).unbind(0)
    bv = b.view(t, g, 1, 1, n).unbind(0)
    cv = cc.reshape(t, g, n, 1).unbind(0)
    y = torch.empty(t, h, p, dtype=torch.float32, device=hidden.device)
    yv = y.view(t, g, (h // g) * p, 1).unbind(0)
    for r, slot in enumerate(meta.state_indices_list):
        state = ssm_state[slot].view(g, h // g, p, n)
        state.mul_(decay[r]).addcmul_(dx[r], bv[r])
        if g == 1:  # one mat-vec (a little faster than a batch-1 bmm)
            torch.mv(state.view(h * p, n), cv[r].view(n), out=yv[r].view(h * p))
        else:
            torch.matmul(state.view(g, (h // g) * p, n), cv[r], out=yv[r])
    y.addcmul_(x, _f32(mixer.D).view(h, 1))
    slot_positions.index_copy_(0, slots, batch.positions + 1)
    _checkpoint(batch, conv_state, ssm_state, slot_positions)
    y = mixer._gate(_as(y, dtype).view(t, c.d_inner), z)
    out = mixer.out_proj(_as(y, dtype))
    return out if c.output_multiplier == 1.0 else out * c.output_multiplier


def _checkpoint(
    batch: ForwardBatch, conv_state: torch.Tensor, ssm_state: torch.Tensor, slot_positions: torch.Tensor
) -> None:
    """Rows whose token completed a block: their new states are checkpoints as well."""
    meta = batch.ssm
    if batch.planned_checkpoints and meta is not None:
        copy_decode_checkpoints(conv_state, meta, None)
        copy_decode_checkpoints(ssm_state, meta, slot_positions)
