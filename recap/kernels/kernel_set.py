"""The kernel set: the ops a model's layers call, chosen per step by the runner (DESIGN invariant 10).

Every backend (the torch reference kernels with their CPU fast paths, the Triton kernels for GPUs) provides
the same functions with the same signatures and metadata contract (chunk ends, destination slots, positions
written, PAD_SLOT_ID rows skipped), so layers call `batch.kernels.<op>(...)` and hold no device branches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any

import torch

from recap.kernels.conv1d import causal_conv1d, causal_conv1d_update
from recap.kernels.gdn import gated_delta_rule, gdn_gates
from recap.kernels.indexed_mla import paged_dsa_select, paged_sparse_mla_attention
from recap.kernels.kda import kda
from recap.kernels.mla import paged_mla_attention
from recap.kernels.mlstm import mlstm_scan
from recap.kernels.paged_attention import paged_attention
from recap.kernels.qsa import paged_qsa_attention
from recap.kernels.rel_bias_attention import paged_rel_bias_attention
from recap.kernels.rglru import rglru_scan
from recap.kernels.selective_scan import selective_scan, selective_state_update
from recap.kernels.ssd import ssd
from recap.kernels.ssd_decode import ssd_state_update
from recap.kernels.wkv import wkv_scan

Kernel = Callable[..., Any]


@dataclass(frozen=True)
class KernelSet:
    """One implementation of every swappable op; each field has the signature of the torch op of that name."""

    name: str
    ssd: Kernel
    ssd_state_update: Kernel
    selective_scan: Kernel
    selective_state_update: Kernel
    causal_conv1d: Kernel
    causal_conv1d_update: Kernel
    gated_delta_rule: Kernel
    gdn_gates: Kernel
    kda: Kernel
    paged_attention: Kernel
    paged_mla_attention: Kernel
    paged_dsa_select: Kernel
    paged_sparse_mla_attention: Kernel
    rglru_scan: Kernel
    paged_qsa_attention: Kernel
    wkv_scan: Kernel
    paged_rel_bias_attention: Kernel
    mlstm_scan: Kernel
    # The norm modules' fused kernel (kernels/triton/rms_norm.py's signature), which a backend hands them
    # (Backend.prepare); None: their own torch ops (the reference; on a CPU, with the native fp32 norm).
    rms_norm: Kernel | None = None
    # The residual add and the norm that reads it in one kernel (kernels/triton/add_rms_norm.py's signature),
    # handed to the residual norms likewise (their `add_forward`); None: the add, then the norm.
    add_rms_norm: Kernel | None = None
    # The attention layers' q/k preparation (per-head norms, RoPE, the gate's sigmoid) in one kernel
    # (kernels/triton/rope_qk.py's signature), handed over like `rms_norm`; None: their module ops (layers/qk_rope.py).
    rope_qk: Kernel | None = None
    # The MoE modules' fused routed experts (kernels/triton/fused_moe.py's signature), handed to them likewise;
    # None: their per-expert loop (the reference, which reads the host: no CUDA graph holds it).
    moe_experts: Kernel | None = None

    @classmethod
    def op_names(cls) -> tuple[str, ...]:
        """The ops every kernel set provides (the optional ones, whose default is None, are not among them)."""
        return tuple(f.name for f in fields(cls) if f.name != "name" and f.default is MISSING)


TORCH_KERNELS = KernelSet(
    name="torch",
    ssd=ssd,
    ssd_state_update=ssd_state_update,
    selective_scan=selective_scan,
    selective_state_update=selective_state_update,
    causal_conv1d=causal_conv1d,
    causal_conv1d_update=causal_conv1d_update,
    gated_delta_rule=gated_delta_rule,
    gdn_gates=gdn_gates,
    kda=kda,
    paged_attention=paged_attention,
    paged_mla_attention=paged_mla_attention,
    paged_dsa_select=paged_dsa_select,
    paged_sparse_mla_attention=paged_sparse_mla_attention,
    rglru_scan=rglru_scan,
    paged_qsa_attention=paged_qsa_attention,
    wkv_scan=wkv_scan,
    paged_rel_bias_attention=paged_rel_bias_attention,
    mlstm_scan=mlstm_scan,
)


class KernelsUnavailableError(ValueError):
    """The kernel set asked for cannot run here (no triton, or Triton kernels on a CPU without its interpreter)."""


def kernel_set(name: str, device: torch.device) -> KernelSet:
    """The kernels for `device`: "auto" (Triton on a GPU, torch's elsewhere), "torch" or "triton"."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TORCH_KERNELS
    if name != "triton":
        raise ValueError(f"kernels must be 'auto', 'torch' or 'triton', got {name!r}")
    try:
        from recap.kernels.triton.kernel_set import TRITON_KERNELS
    except ImportError as e:
        raise KernelsUnavailableError(f"the Triton kernels need the triton package ({e}); pip install triton") from e
    return TRITON_KERNELS
