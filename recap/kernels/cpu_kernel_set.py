"""The CPU backend's kernel set: the torch kernel set with the prefill ops that have native C kernels swapped in.

- causal_conv1d: kernels/conv_taps.py (the conv taps of Gated DeltaNet, Mamba2 and LFM2's short conv);
- gated_delta_rule and kda: kernels/gdn_walk.py (the chunk form of the delta rule, per value head);
- ssd: kernels/ssd_walk.py (Mamba2's SSD and Lightning attention's, as a recurrent walk per head).
Each runs its C kernel on a prefill step (any step that is not a decode batch) and the torch op otherwise (decode
batches, dtypes or shapes the kernel does not take), so the torch ops stay the reference and what TorchBackend
runs. backends/cpu.py's CpuBackend, which requires the native libraries, runs this set.
"""

from __future__ import annotations

import dataclasses

from recap.kernels.conv_taps import causal_conv1d_native
from recap.kernels.gdn_walk import gated_delta_rule_native, kda_native
from recap.kernels.kernel_set import TORCH_KERNELS, KernelSet
from recap.kernels.ssd_walk import ssd_native

CPU_KERNELS: KernelSet = dataclasses.replace(
    TORCH_KERNELS, name="cpu", causal_conv1d=causal_conv1d_native, gated_delta_rule=gated_delta_rule_native,
    kda=kda_native, ssd=ssd_native,
)  # fmt: skip
