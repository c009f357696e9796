"""Everything needed to build an engine, split by concern and passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass, field

from recap.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from recap.model.head_format import check_head_quantization
from recap.model.quant import QUANTIZATIONS

DTYPES = ("float32", "bfloat16", "float16")
KERNEL_SETS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # local folder or hub id; None: the trained default model (model/trained_default.py)
    tokenizer: str | None = None  # defaults to the model folder
    served_model_name: str | None = None
    dtype: str = "float32"
    quantization: str | None = None  # "int8" (model/quant.py), "int4" or "int4_k" (kernels/linear_int4.py)
    # The output head's precision under a quantization (model/head_format.py): "auto" (int8), "int8", "same".
    head_quantization: str = "auto"
    # An importance matrix file (`recap imatrix`) the int4 / int4_k fits weigh each weight's error by
    # (model/importance.py); None: the plain fit.
    quantization_imatrix: str | None = None
    # Batch-1 decode's fp32 and int8 linears through recap's native kernels (recap/kernels/linear_rows.py,
    # built once per machine in about a second); False: torch's kernels only (vLLM's --enforce-eager).
    native_decode: bool = True
    # Where the model and its pools live: "auto" (CUDA when torch sees a GPU, else the CPU), "cpu", "cuda[:N]".
    device: str = "auto"
    # The kernels the layers call (kernels/kernel_set.py): "auto" (Triton on a GPU, torch's on a CPU), "torch",
    # or "triton" (on a CPU only under Triton's interpreter: the tests' way of running the GPU kernels).
    kernels: str = "auto"
    # On a GPU: the share of its memory the process may hold; the pools take what the weights leave of it.
    gpu_memory_utilization: float = 0.9
    # On the CPU: the bytes the process may hold in all (weights, pools, runtime); None: measured, min(MemAvailable
    # + the process's RSS, the cgroup limit). A plan over it is refused (MemoryPlanError) before loading the
    # weights where the checkpoint's size alone cannot fit, else before allocating the pools.
    memory_limit_bytes: int | None = None
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Run the cache core's integrity check after every step (tests; costs time on big pools).
    check_integrity: bool = False
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's setting
    max_n: int = 16  # the most samples (SamplingParams.n) one request may ask for
    # Default sampling settings: "auto" (the model folder's generation_config.json), "vllm" (none), or a folder.
    generation_config: str = "auto"
    # vLLM's max_model_len=None: the context length the model's config states replaces scheduler.max_model_len.
    derive_max_model_len: bool = False
    chat_template: str | None = None  # replaces the tokenizer's chat template (a Jinja string)
    # Speculative decoding (vLLM's --speculative-config; docs/speculative.md); None: off.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        check_head_quantization(self.head_quantization)  # with no quantization, "int8" is refused at load
        if self.quantization_imatrix is not None and self.quantization not in ("int4", "int4_k"):
            raise ValueError(f"quantization_imatrix weighs the int4 fits: quantization 'int4' or 'int4_k', not "
                             f"{self.quantization!r}")  # fmt: skip
        if self.kernels not in KERNEL_SETS:
            raise ValueError(f"kernels must be one of {KERNEL_SETS}, got {self.kernels!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes <= 0:
            raise ValueError(f"memory_limit_bytes must be positive, got {self.memory_limit_bytes}")
        if self.cache.cache_disk_bytes and self.cache.cache_dir is None:
            raise ValueError("cache_disk_bytes needs cache_dir (the directory of the disk tier)")
        if self.max_n < 1:
            raise ValueError(f"max_n must be at least 1, got {self.max_n}")
        if self.scheduler.async_scheduling and self.speculative is not None:
            raise ValueError("async_scheduling does not combine with speculative decoding: a verify row needs the "
                             "token before it on the host, so no step could be scheduled ahead")
