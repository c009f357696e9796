"""RMS norms, computed in fp32 and cast back (the HF order of operations, for close agreement).

A backend may hand the norms one fused kernel (`set_norm_kernel`: the kernel set's `rms_norm`, e.g. the Triton
one of kernels/triton/rms_norm.py); each module's torch ops below are that kernel's reference. The residual
norms also take the residual add that feeds them (`add_forward`), through the kernel set's `add_rms_norm` where
a backend hands it over (`set_add_norm_kernel`), else as the add and then the norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from recap.kernels.kernel_set import Kernel
from recap.kernels.rms_norm import rms_norm_available, rms_norm_rows, use_rms_norm_rows
from recap.model.capture import DecodeCapture, GraphUnsupportedError, f32_contiguous
from recap.model.layers.linear import empty_param


def _inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim (keepdim), from one reduction pass (no x^2 temporary)."""
    ms = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1])
    return ms.add_(eps).rsqrt_()


def _f32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32; an fp32 x as it is (a no-op `.float()` still costs a dispatch, which decode steps feel)."""
    return x if x.dtype == torch.float32 else x.float()


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32 (no weight); a new tensor."""
    x = _f32(x)
    return x * _inv_rms(x, eps)


class FusedNorm(nn.Module):
    """A norm that a backend may run through one fused kernel (the kernel set's `rms_norm` signature)."""

    weight: torch.Tensor
    norm_kernel: Kernel | None = None

    def set_norm_kernel(self, kernel: Kernel | None) -> None:
        """`kernel` for this norm from now on (None: the module's torch ops)."""
        self.norm_kernel = kernel

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether the fused kernel runs x: one is set and the weight fits x (`_weight_fits`)."""
        return self.norm_kernel is not None and self._weight_fits(x)

    def _weight_fits(self, x: torch.Tensor) -> bool:
        """Whether a fused kernel gives the torch ops' result dtype on x: the weight is x's dtype (or x is fp32:
        the torch ops then keep fp32 too)."""
        return x.dtype == self.weight.dtype or x.dtype == torch.float32


class RMSNorm(FusedNorm):
    """weight * x / rms(x)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_param(dim, dtype=dtype)
        self.native = False  # fp32 rows through kernels/rms_norm.py (any count: batch-invariant); set_native
        self.add_norm_kernel: Kernel | None = None

    def set_native(self, on: bool) -> None:
        self.native = on and rms_norm_available()

    def set_add_norm_kernel(self, kernel: Kernel | None) -> None:
        """`kernel` (the kernel set's `add_rms_norm` signature) for `add_forward` from now on (None: the add, then
        this norm's forward)."""
        self.add_norm_kernel = kernel

    def add_forward(self, h: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h + out), h + out): a residual add and this norm of its result (out None: no add). The add is
        the unfused one's (h's dtype when out is too); the fused kernel runs it where the dtypes let it."""
        if out is None:
            return self(h), h
        kernel = self.add_norm_kernel
        if kernel is not None and out.dtype == h.dtype and out.shape == h.shape and self._weight_fits(h):
            return kernel(out, h, self.weight, self.eps, **self._weight_variant())
        h = h + out
        return self(h), h

    def _weight_variant(self) -> dict[str, bool]:
        """How `forward` takes the weight, in the fused kernels' words."""
        return {"weight_in_dtype": True}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused(x):
            assert self.norm_kernel is not None
            return self.norm_kernel(x, self.weight, self.eps, weight_in_dtype=True)
        if self.native and use_rms_norm_rows(x, self.weight):
            return rms_norm_rows(x, self.weight, self.eps)
        y = rms_normalize(x, self.eps)
        return y.mul_(self.weight) if x.dtype == torch.float32 else self.weight * y.to(x.dtype)

    def capture_decode(self, builder: DecodeCapture, x: torch.Tensor) -> torch.Tensor:
        """Record this norm on x [rows, D] through its native kernel (model/capture.py)."""
        if type(self) is not RMSNorm or not self.native:
            raise GraphUnsupportedError(f"norm {type(self).__name__} (native: {self.native})")
        return builder.rms_norm(x, f32_contiguous(self.weight, "a norm weight"), self.eps)

    def capture_decode_heads(self, builder: DecodeCapture, x: torch.Tensor) -> torch.Tensor:
        """Record this norm over each head of x [rows, heads * D] (a q/k norm) through its native kernel."""
        if type(self) is not RMSNorm or not self.native:
            raise GraphUnsupportedError(f"q/k norm {type(self).__name__} (native: {self.native})")
        return builder.head_rms_norm(x, f32_contiguous(self.weight, "a norm weight"), self.eps)


class GatedRMSNorm(FusedNorm):
    """Mamba2's norm before out_proj: weight * groupnorm(x * silu(z)), RMS over groups of `group_size`.

    With `norm_before_gate` (Falcon-H1's mamba_norm_before_gate): weight * groupnorm(x) * silu(z).
    """

    def __init__(
        self, dim: int, group_size: int, eps: float, dtype: torch.dtype, norm_before_gate: bool = False
    ) -> None:
        super().__init__()
        if dim % group_size:
            raise ValueError(f"dim {dim} is not a multiple of group_size {group_size}")
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = empty_param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self._fused(x):
            assert self.norm_kernel is not None
            return self.norm_kernel(x, self.weight, self.eps, group=self.group_size, gate=z,
                                    gate_first=not self.norm_before_gate,
                                    weight_in_dtype=not self.norm_before_gate)  # fmt: skip
        if self.norm_before_gate:  # Falcon-H1's order: weight and gate applied in fp32, then cast
            h = x.float().clone()
            groups = h.view(*h.shape[:-1], -1, self.group_size)
            groups.mul_(_inv_rms(groups, self.eps))
            return h.mul_(self.weight).mul_(F.silu(_f32(z))).to(dtype)
        h = F.silu(_f32(z)).mul_(_f32(x))  # a fresh fp32 tensor, normalized in place below
        groups = h.view(*h.shape[:-1], -1, self.group_size)  # (..., g, group_size)
        groups.mul_(_inv_rms(groups, self.eps))
        return h.mul_(self.weight) if dtype == torch.float32 else self.weight * h.to(dtype)


class OffsetRMSNorm(RMSNorm):
    """(1 + weight) * x / rms(x): the zero-centred RMSNorm of Qwen3-Next / Qwen3.5 (weights stored as w - 1).

    The product is taken in fp32 and cast once, as transformers does for these families.
    """

    def _weight_fits(self, x: torch.Tensor) -> bool:
        return True  # the product in fp32 and one cast to x's dtype: any weight dtype

    def _weight_variant(self) -> dict[str, bool]:
        return {"offset": True}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_kernel is not None:  # the product in fp32 and one cast: any weight dtype
            return self.norm_kernel(x, self.weight, self.eps, offset=True)
        return rms_normalize(x, self.eps).mul_(1.0 + self.weight.float()).to(x.dtype)

    def capture_decode(self, builder: DecodeCapture, x: torch.Tensor) -> torch.Tensor:
        """Record this norm on fp32 rows x [rows, D] through the native RMS norm with the weight 1 + w (its torch
        ops' arithmetic but for the order of the sum of squares: equal to fp32 rounding)."""
        return builder.rms_norm(x, self._capture_weight(), self.eps, offset=True)

    def capture_decode_heads(self, builder: DecodeCapture, x: torch.Tensor) -> torch.Tensor:
        """Record this norm over each head of x [rows, heads * D] (a q/k norm)."""
        return builder.head_rms_norm(x, self._capture_weight(), self.eps, offset=True)

    def _capture_weight(self) -> torch.Tensor:
        if type(self) is not OffsetRMSNorm or self.norm_kernel is not None:
            raise GraphUnsupportedError(f"norm {type(self).__name__} with a fused kernel")
        return f32_contiguous(self.weight, "a norm weight")


class HeadGatedRMSNorm(FusedNorm):
    """Gated DeltaNet's output norm: (weight * x / rms(x)) * silu(z), the RMS over each head's `dim` channels.

    Norm before gate (unlike Mamba2's GatedRMSNorm); x and z are [..., heads * dim] or [..., heads, dim].
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype, shape = x.dtype, x.shape
        if self._fused(x):
            assert self.norm_kernel is not None
            return self.norm_kernel(x, self.weight, self.eps, group=self.weight.shape[0], gate=z.reshape(shape),
                                    weight_in_dtype=True)  # fmt: skip
        h = rms_normalize(x.reshape(*shape[:-1], -1, self.weight.shape[0]), self.eps).to(dtype) * self.weight
        return h.float().mul_(F.silu(z.reshape(h.shape).float())).to(dtype).reshape(shape)
