"""An attention layer's input preparation: per-head q/k RMS norms, RoPE, and the output gate's sigmoid.

`QKRope.prepare_qk` runs them through the module ops below (the reference: the norm modules, RotaryEmbedding's
cos_sin and apply, torch.sigmoid) or, where a backend handed the layer one fused kernel (`set_rope_kernel`: the
kernel set's `rope_qk`, kernels/triton/rope_qk.py's signature), through that kernel in one launch. The fused
kernel serves the plain and zero-centred per-head norms and the plain RoPE module; any other part keeps the
module ops. Given the step's cache write (`kv`, metadata.KVWrite), the fused kernel also stores the prepared k
and v in the paged cache, and `prepare_qk` says so: the layer then tells its attention op (`kv_written`) not to
write them again. The module ops never write (the attention op does, as before).
"""

from __future__ import annotations

import torch

from recap.kernels.kernel_set import Kernel
from recap.kernels.metadata import KVWrite
from recap.model.layers.norm import OffsetRMSNorm, RMSNorm
from recap.model.layers.rotary import RotaryEmbedding

HeadNorms = tuple[RMSNorm, RMSNorm]  # (q's, k's), each over one head's dims


def _fusable_norms(norms: HeadNorms, dtype: torch.dtype) -> bool:
    """Whether the fused kernel computes these norms as their modules do: both plain, or both zero-centred, of
    one eps, with weights of a head's width; a plain norm's weight in x's dtype (or x fp32: the product then
    stays fp32 in both)."""
    qn, kn = norms
    if type(qn) is not type(kn) or type(qn) not in (RMSNorm, OffsetRMSNorm) or qn.eps != kn.eps:
        return False
    if qn.weight.shape != kn.weight.shape:
        return False
    return type(qn) is OffsetRMSNorm or dtype == torch.float32 or qn.weight.dtype == kn.weight.dtype == dtype


class QKRope:
    """The attention layers' q/k preparation (a mixin beside nn.Module; the layer sets `rotary`)."""

    rotary: RotaryEmbedding | None
    rope_kernel: Kernel | None = None

    def set_rope_kernel(self, kernel: Kernel | None) -> None:
        """`kernel` for this layer's q/k preparation from now on (None: the module ops)."""
        self.rope_kernel = kernel

    def prepare_qk(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, norms: HeadNorms | None = None,
        gate: torch.Tensor | None = None, kv: KVWrite | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:  # fmt: skip
        """q [T, Hq, Dh] and k [T, Hkv, Dh] at `positions` [T] normed per head by `norms` (when given) and rotated
        (when the layer has RoPE); sigmoid(gate) [T, Hq x Dh] for a gate [T, Hq, Dh] (None without); and whether
        the prepared k and kv.v are already in kv's caches (the fused kernel with a cache of q's dtype stores them;
        otherwise the attention op writes them)."""
        if self._fused(q, norms):
            assert self.rope_kernel is not None
            inv_freq = None if self.rotary is None else self.rotary.inv_freq
            weights = None if norms is None else (norms[0].weight, norms[1].weight)
            eps = 0.0 if norms is None else norms[0].eps
            offset = norms is not None and type(norms[0]) is OffsetRMSNorm
            write = kv if kv is not None and kv.k_cache.dtype == kv.v_cache.dtype == kv.v.dtype == q.dtype else None
            out = self.rope_kernel(q, k, positions, inv_freq, weights=weights, eps=eps, offset=offset, gate=gate,
                                   kv_write=write)  # fmt: skip
            return *out, write is not None
        if norms is not None:
            q, k = norms[0](q), norms[1](k)
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(positions, q.dtype)
            q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        return q, k, None if gate is None else torch.sigmoid(gate.reshape(gate.shape[0], -1)), False

    def _fused(self, q: torch.Tensor, norms: HeadNorms | None) -> bool:
        """Whether the fused kernel runs: one is set, there is something to compute, and each part is one it
        computes (the plain RotaryEmbedding, per-head norms `_fusable_norms` accepts)."""
        if self.rope_kernel is None or (self.rotary is None and norms is None):
            return False
        if self.rotary is not None and type(self.rotary) is not RotaryEmbedding:
            return False
        return norms is None or _fusable_norms(norms, q.dtype)
