"""TRITON_KERNELS: the kernel set of the GPU backend, every op a Triton kernel with its reference's contract."""

from __future__ import annotations

from recap.kernels.kernel_set import KernelSet
from recap.kernels.triton.conv1d import causal_conv1d_update, causal_conv1d_varlen
from recap.kernels.triton.gdn import gated_delta_rule_varlen
from recap.kernels.triton.kda import kda_varlen
from recap.kernels.triton.mla import paged_mla_attention
from recap.kernels.triton.paged_attention import paged_attention
from recap.kernels.triton.selective_scan import selective_scan_varlen, selective_state_update
from recap.kernels.triton.ssd import ssd_varlen
from recap.kernels.triton.ssd_decode import ssd_state_update

TRITON_KERNELS = KernelSet(
    name="triton",
    ssd_varlen=ssd_varlen,
    ssd_state_update=ssd_state_update,
    selective_scan_varlen=selective_scan_varlen,
    selective_state_update=selective_state_update,
    causal_conv1d_varlen=causal_conv1d_varlen,
    causal_conv1d_update=causal_conv1d_update,
    gated_delta_rule_varlen=gated_delta_rule_varlen,
    kda_varlen=kda_varlen,
    paged_attention=paged_attention,
    paged_mla_attention=paged_mla_attention,
)
