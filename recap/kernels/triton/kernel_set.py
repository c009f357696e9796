"""TRITON_KERNELS: the kernel set of the GPU backend, every op a Triton kernel with its reference's contract, but
the indexed (DSA-style sparse) MLA ops, Qwen4-Exp's QSA attention, Inkling's relative-bias attention, the
RG-LRU scan, RWKV's WKV scan and xLSTM's mLSTM scan: their torch kernels, which run on any device, until Triton
ones exist. The norm modules run one fused Triton kernel each (`rms_norm`), and the residual add that feeds a
residual norm runs in the same launch (`add_rms_norm`); the attention layers' q/k norms,
RoPE and gate one per layer (`rope_qk`), the MoE modules' routed experts two grouped GEMMs over device-sorted
pairs (`moe_experts`)."""

from __future__ import annotations

from recap.kernels.indexed_mla import paged_dsa_select, paged_sparse_mla_attention
from recap.kernels.kernel_set import KernelSet
from recap.kernels.mlstm import mlstm_scan
from recap.kernels.qsa import paged_qsa_attention
from recap.kernels.rel_bias_attention import paged_rel_bias_attention
from recap.kernels.rglru import rglru_scan
from recap.kernels.triton.add_rms_norm import add_rms_norm
from recap.kernels.triton.conv1d import causal_conv1d, causal_conv1d_update
from recap.kernels.triton.fused_moe import fused_moe
from recap.kernels.triton.gdn import gated_delta_rule
from recap.kernels.triton.gdn_gates import gdn_gates
from recap.kernels.triton.kda import kda
from recap.kernels.triton.mla import paged_mla_attention
from recap.kernels.triton.paged_attention import paged_attention
from recap.kernels.triton.rms_norm import rms_norm
from recap.kernels.triton.rope_qk import rope_qk
from recap.kernels.triton.selective_scan import selective_scan, selective_state_update
from recap.kernels.triton.ssd import ssd
from recap.kernels.triton.ssd_decode import ssd_state_update
from recap.kernels.wkv import wkv_scan

TRITON_KERNELS = KernelSet(
    name="triton",
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
    rms_norm=rms_norm,
    add_rms_norm=add_rms_norm,
    rope_qk=rope_qk,
    moe_experts=fused_moe,
)
