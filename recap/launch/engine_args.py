"""`recap serve` flags (vLLM's names where the concept is the same) -> EngineConfig."""

from __future__ import annotations

import argparse
from pathlib import Path

from recap.config import CHECKPOINT_POLICIES, CacheConfig, SchedulerConfig, SpeculativeConfig
from recap.engine.config import DTYPES, KERNEL_SETS, EngineConfig
from recap.engine.vllm_compat import MAMBA_CACHE_MODES, checkpoint_policy_for, resolve_dtype
from recap.model.head_format import HEAD_QUANTIZATIONS
from recap.model.quant import QUANTIZATIONS
from recap.units import positive_bytes


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _speculative_config(text: str) -> SpeculativeConfig | None:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


SPECULATIVE_HELP = ('speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
                    '"prompt_lookup_min": 1, "prompt_lookup_max": 4}\', or a draft model with the same tokenizer: '
                    '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\', or the checkpoint\'s '
                    'MTP head: \'{"method": "mtp", "num_speculative_tokens": 2}\' (docs/speculative.md)')


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Model and cache flags shared by `serve` (and usable by other subcommands)."""
    sched, cache = SchedulerConfig(), CacheConfig()
    p.add_argument("--tokenizer", help="tokenizer folder or hub id (default: the model's)")
    p.add_argument("--served-model-name", help="the model name clients send (default: MODEL)")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="auto: float32 on a CPU (recap's CPU kernels run the model in float32 whatever the checkpoint "
                        "stores), bfloat16 on a GPU")
    p.add_argument("--device", default="auto",
                   help="auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--kernels", choices=KERNEL_SETS, default="auto",
                   help="the layers' kernels: auto (triton on a GPU, torch's on a CPU), torch, triton")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on a GPU: the share of its memory recap may hold; the KV and state pools take what the "
                        "weights leave (--kv-cache-bytes / --state-cache-bytes fix them instead)")
    _add_quantization_args(p)
    p.add_argument("--enforce-eager", action="store_true",
                   help="torch's kernels only: batch-1 decode does not take recap's native kernels "
                        "(recap/kernels/linear_rows.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=_positive, default=None,
                   help="context length (default: the model config's max_position_embeddings, else "
                        f"{sched.max_model_len})")
    p.add_argument("--max-n", type=_positive, default=16, help="the most samples (n) one request may ask for")
    p.add_argument("--generation-config", default="auto",
                   help="default sampling settings: auto (the model's generation_config.json), vllm (none), or a "
                        "folder holding a generation_config.json")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one (default: the tokenizer's)")
    p.add_argument("--max-num-seqs", type=_positive, default=sched.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=_positive, default=sched.max_num_batched_tokens)
    p.add_argument("--async-scheduling", action="store_true",
                   help="schedule the next step while the current one runs (docs/gpu.md, async scheduling)")
    p.add_argument("--block-size", type=_positive, default=cache.block_size)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--checkpoint-policy",
        choices=CHECKPOINT_POLICIES,
        default=None,
        help=f"where the recurrent state is checkpointed (docs/design.md; default {cache.checkpoint_policy})",
    )
    p.add_argument("--mamba-cache-mode", choices=MAMBA_CACHE_MODES, default=None,
                   help="vLLM's name for the checkpoint policy of the same name")
    p.add_argument(
        "--checkpoint-interval", type=_positive, default=None, help="recap policy: also checkpoint every N blocks"
    )
    _add_memory_args(p)
    p.add_argument("--speculative-config", type=_speculative_config, default=None,
                   help=SPECULATIVE_HELP)
    p.add_argument("--num-threads", type=_positive, default=None, help="torch intra-op threads")
    p.add_argument(
        "--check-integrity",
        action="store_true",
        help="check the cache core's accounting after every step (slow; for debugging)",
    )


def _add_quantization_args(p: argparse.ArgumentParser) -> None:
    """The weights' precision: --quantization, the head's, and the int4 fits' importance matrix."""
    p.add_argument("--quantization", "-q", choices=QUANTIZATIONS, default=None,
                   help="int8: per-channel int8 weights; int4: 4-bit, symmetric groups of 32; int4_k: 4-bit in Q4_K's "
                   "super-blocks: int4's size and decode speed, a little less perplexity, ~5-9%% slower prefill")
    p.add_argument("--head-quantization", choices=HEAD_QUANTIZATIONS, default="auto",
                   help="the output head's precision under --quantization (llama-quantize's --output-tensor-type): "
                        "auto (int8), int8, or same (as the other linear weights)")
    p.add_argument("--quantization-imatrix", default=None, metavar="FILE",
                   help="an importance matrix (`recap imatrix`): the int4 / int4_k fits weigh each weight's error "
                        "by its input channel's mean squared activation (llama-quantize's --imatrix)")


def _add_memory_args(p: argparse.ArgumentParser) -> None:
    """The pools' byte budgets and the memory limit the start-up plan is checked against."""
    p.add_argument("--kv-cache-bytes", type=positive_bytes, default=None, help="KV block pool budget, e.g. 2GiB")
    p.add_argument(
        "--state-cache-bytes",
        type=positive_bytes,
        default=None,
        help="state slot pool budget (running slots + checkpoints), e.g. 512MiB",
    )
    p.add_argument("--cache-dir", default=None,
                   help="the disk tier: evicted checkpoints and KV blocks are saved here and read back on a hit, "
                        "across restarts (docs/tiers.md)")
    p.add_argument("--cache-disk-bytes", type=positive_bytes, default=None,
                   help="the disk tier's budget, e.g. 100GiB (default 16GiB with --cache-dir)")
    p.add_argument("--cache-host-bytes", type=positive_bytes, default=None,
                   help="the host-memory tier's budget, e.g. 64GiB: evicted entries go to host memory first, then "
                        "to the disk tier (docs/tiers.md); on a CPU, counted in the memory plan against --memory-limit")
    p.add_argument("--memory-limit", type=positive_bytes, default=None,
                   help="on a CPU: the memory recap may hold in all, e.g. 12GiB (default: MemAvailable plus what the "
                        "process holds, capped by the cgroup limit); a model, pools and runtime over it are refused "
                        "at start (exit 2)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Raises ValueError naming the flag's field when the values do not fit together."""
    return EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        served_model_name=args.served_model_name,
        dtype=resolve_dtype(args.dtype, args.device),
        quantization=args.quantization,
        head_quantization=args.head_quantization,
        quantization_imatrix=args.quantization_imatrix,
        native_decode=not args.enforce_eager,
        device=args.device,
        kernels=args.kernels,
        gpu_memory_utilization=args.gpu_memory_utilization,
        memory_limit_bytes=args.memory_limit,
        seed=args.seed,
        cache=CacheConfig(
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            checkpoint_policy=checkpoint_policy_for(args.checkpoint_policy, args.mamba_cache_mode),
            checkpoint_interval=args.checkpoint_interval,
            kv_cache_bytes=args.kv_cache_bytes,
            state_cache_bytes=args.state_cache_bytes,
            cache_dir=args.cache_dir,
            cache_disk_bytes=args.cache_disk_bytes,
            cache_host_bytes=args.cache_host_bytes,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len or SchedulerConfig().max_model_len,
            async_scheduling=args.async_scheduling,
        ),
        check_integrity=args.check_integrity,
        num_threads=args.num_threads,
        max_n=args.max_n,
        generation_config=args.generation_config,
        derive_max_model_len=args.max_model_len is None,
        chat_template=read_chat_template(args.chat_template),
        speculative=args.speculative_config,
    )


def read_chat_template(value: str | None) -> str | None:
    """vLLM's --chat-template: a file's contents when `value` names a file, else the template itself."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" not in value:  # neither a file nor a template: most likely a mistyped path
        raise ValueError(f"chat_template: {value!r} is not a file and does not look like a Jinja template")
    return value
