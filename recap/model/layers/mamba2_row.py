"""A Mamba2 mixer's batch-1 decode between in_proj and out_proj as one torch.compile'd function.

On a plain decode step of one row, `mamba2_decode` still dispatches ~45 tiny ATen ops per layer (conv window,
dt, decay, state update, D skip, gated norm), ~1,100 per step of a 24-layer model. `mamba2_row` is the same
arithmetic for one row, written as one function of plain tensors so that inductor fuses it into a few loops;
`mamba2_row_ref` (the same function, not compiled) is its reference, and `mamba2_decode` (with its general
reference `Mamba2Mixer.forward_ref`) stays the path of every other step.

Glossary as in layers/mamba2.py: H heads of P channels, G groups of N-wide B and C, I = H * P, C_dim the conv
channels (I + 2 G N), K the conv width.

Opt-in with the one-row linear (layers/rowvec.py: `load_model(..., compile_decode=True)`), compiled once per
process with dynamic shapes (30-50 s on 2 shared cores, most of compile_decode's load time; the on-disk cache
did not shorten it in a second process). Only fp32 mixers with the default gate order (`gated_rmsnorm`), a
silu conv and no in_proj multipliers take it (`row_supported`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from recap.model.layers.mamba2 import Mamba2Mixer

logger = logging.getLogger(__name__)


def mamba2_row_ref(
    proj: torch.Tensor,  # (1, I + C_dim + H): in_proj's output [z | xBC | dt]
    conv_slot: torch.Tensor,  # (C_dim, K - 1): this row's conv window, updated in place
    ssm_slot: torch.Tensor,  # (G, H / G, P, N): this row's SSM state, updated in place
    conv_w: torch.Tensor,  # (C_dim, K)
    conv_b: torch.Tensor | None,  # (C_dim,)
    dt_bias: torch.Tensor,  # (H,)
    a_log: torch.Tensor,  # (H,)
    d_skip: torch.Tensor,  # (H,)
    norm_w: torch.Tensor,  # (I,)
    eps: torch.Tensor,  # () the norm's epsilon
    dt_min: torch.Tensor,  # () time_step_limit (0-d tensors: a compiled function would specialize on floats)
    dt_max: torch.Tensor,
) -> torch.Tensor:
    """(1, I): gated_rmsnorm(y, z) of one decode row, ready for out_proj; conv_slot and ssm_slot advanced."""
    g, hg, p, n = ssm_slot.shape
    h, i = g * hg, g * hg * p
    z, xbc, dt = proj[0].split([i, conv_slot.shape[0], h])
    window = torch.cat((conv_slot, xbc[:, None]), dim=1)  # (C_dim, K)
    conv_slot.copy_(window[:, 1:])
    xbc = (window * conv_w).sum(-1)
    if conv_b is not None:
        xbc = xbc + conv_b
    xbc = F.silu(xbc)
    x, b, c = xbc.split([i, g * n, g * n])
    d = torch.minimum(torch.maximum(F.softplus(dt + dt_bias), dt_min), dt_max)  # (H,)
    decay = torch.exp(d * -torch.exp(a_log)).view(g, hg, 1, 1)
    x = x.view(h, p)
    dx = (x * d[:, None]).view(g, hg, p, 1)
    state = ssm_slot * decay + dx * b.view(g, 1, 1, n)  # h = exp(dt A) h + (dt x) B^T
    ssm_slot.copy_(state)
    y = (state * c.view(g, 1, 1, n)).sum(-1).view(h, p) + x * d_skip[:, None]  # y = h C + D x
    gated = (y * F.silu(z).view(h, p)).view(g, i // g)  # groupnorm(y * silu(z)) * weight
    gated = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + eps)
    return (gated.view(1, i) * norm_w).contiguous()


_COMPILED: list[Callable[..., torch.Tensor] | None] = []  # [fn] once built and checked, [None] if it failed


def build_compiled(args: tuple) -> bool:  # type: ignore[type-arg]
    """Compile mamba2_row on real arguments (once per process: so that the check is the compile the steps
    reuse) and check it against the reference on copies of the states; False if it cannot be built."""
    if _COMPILED:
        return _COMPILED[0] is not None
    fn = torch.compile(mamba2_row_ref, dynamic=True, fullgraph=True)
    ref_args, fast_args = list(args), list(args)
    ref_args[1:3] = [a.clone() for a in args[1:3]]
    fast_args[1:3] = [a.clone() for a in args[1:3]]
    try:
        with torch.inference_mode():
            ref, fast = mamba2_row_ref(*ref_args), fn(*fast_args)
    except Exception as e:  # noqa: BLE001 (inductor raises many kinds: no compiler, no headers, ...)
        logger.warning("torch.compile could not build mamba2_row; batch-1 steps stay eager: %s", e)
        _COMPILED.append(None)
        return False
    ok = torch.allclose(fast, ref, rtol=1e-4, atol=1e-5) and torch.allclose(fast_args[2], ref_args[2], atol=1e-5)
    if not ok:
        logger.warning("the compiled mamba2_row disagrees with its reference; batch-1 steps stay eager")
    _COMPILED.append(fn if ok else None)
    return ok


def mamba2_row(*args: object) -> torch.Tensor:
    """mamba2_row_ref, compiled (same arguments; agrees with it and with mamba2_decode to fp32 rounding).
    Callers build it first (build_compiled, through Mamba2Mixer.set_compiled_row)."""
    fn = _COMPILED[0] if _COMPILED else None
    assert fn is not None, "mamba2_row is not built here (build_compiled returned False or was not called)"
    return fn(*args)


def row_supported(mixer: Mamba2Mixer) -> bool:
    """Whether mamba2_row covers this mixer's options (else mamba2_decode runs its steps)."""
    c, conv = mixer.cfg, mixer.conv1d
    return (
        c.gate_norm == "gated_rmsnorm"
        and mixer.in_proj_scale is None
        and conv.activation == "silu"
        and conv.post_activation is None
        and mixer.in_proj.weight.dtype == torch.float32
    )


def mixer_row_args(mixer: Mamba2Mixer, proj: torch.Tensor, conv_slot: torch.Tensor, ssm_slot: torch.Tensor) -> tuple:
    """mamba2_row's arguments for this mixer's parameters (see mamba2_row_ref for the shapes)."""
    w, b = mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias
    return (proj, conv_slot, ssm_slot, w, b, mixer.dt_bias, mixer.A_log, mixer.D, mixer.norm.weight,
            *mixer.row_constants)  # fmt: skip


def row_constants(mixer: Mamba2Mixer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The norm's eps and the time-step limits as 0-d fp32 tensors (mamba2_row's last three arguments)."""
    lo, hi = mixer.cfg.time_step_limit
    return torch.tensor(mixer.norm.eps), torch.tensor(float(lo)), torch.tensor(float(hi))


def sample_args(mixer: Mamba2Mixer) -> tuple:  # type: ignore[type-arg]
    """Arguments of this mixer's shapes with random proj and states (to build and check the compiled function)."""
    c = mixer.cfg
    g = torch.Generator().manual_seed(0)
    conv = torch.randn(c.conv_dim, c.d_conv - 1, generator=g)  # cache tensors: allocated outside inference mode
    ssm = torch.randn(c.n_groups, c.num_heads // c.n_groups, c.head_dim, c.d_state, generator=g)
    with torch.inference_mode():  # as the step's in_proj output (a guard of the compiled function)
        proj = torch.randn(1, c.in_proj_dim, generator=g)
    return mixer_row_args(mixer, proj, conv, ssm)


def mixer_row(mixer: Mamba2Mixer, proj: torch.Tensor, conv_slot: torch.Tensor, ssm_slot: torch.Tensor) -> torch.Tensor:
    """mamba2_row with this mixer's parameters."""
    return mamba2_row(*mixer_row_args(mixer, proj, conv_slot, ssm_slot))
