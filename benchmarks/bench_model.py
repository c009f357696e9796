"""recap vs transformers on the same ~130M random-weight checkpoints: prefill tokens/s and decode ms/step.

    .venv/bin/python benchmarks/bench_model.py --threads 2 [--backends onednn] [--out bench_out/bench_model.json]

Checkpoints (seeded, built once into --cache-dir with transformers' own classes):
- mamba2-130m: Mamba2 (d_model 768, 24 layers, 24 heads x 64, state 128, vocab 50280, tied), 129M params
- hybrid-130m: Bamba-style (d_model 768, 10 layers: attention at 3 and 7, MLP 2048, vocab 32000), ~130M
- nemotron-h-150m: Nemotron-H-shaped (d_model 768, 18 layers "M-M-M*-M-M-M*-M-M-": 8 Mamba2 (24 heads x 64,
  8 groups, state 128), 8 relu2 MLPs (4096), 2 attention without RoPE (12 heads, 4 KV), vocab 32000), ~144M
- granite-h-150m: Granite-4.0-H-shaped (d_model 768, 12 layers, attention (NoPE) at 5 and 11, every layer a
  MoE of 16 experts x 128 (top 4) plus a shared MLP (1024), muP multipliers, tied, vocab 32000), ~150M
- qwen3_5-150m: Qwen3.5-shaped (d_model 768, 12 layers: Gated DeltaNet x 3 then gated attention, GDN 8 key
  heads x 64 / 16 value heads x 64, attention 8 x 128 (kv 2, rotary 1/4), MLP 2048, vocab 32000), ~143M
- lfm2-150m: LFM2 (d_model 768, 12 layers: attention at 2, 5, 8, 11, short convs K=3, MLP 3072, vocab 65536)
- kimi-linear-150m: Kimi-Linear (d_model 768, 8 layers: MLA at 3 and 7, KDA 6 heads x 128, dense MLP 2048 then
  MoE 8 experts top-2 x 512 + 1 shared, vocab 32000)
The bytes of one state slot (a checkpoint) and the KV bytes per token of each model are printed beside them.
The machine's limits (oneDNN GEMM peak, 1-row mat-vec bandwidth) are measured in every round on the same clock,
and each figure of a dense model is printed as a share of them (see fraction_of_limit).
Measures (medians, fp32, batch 1 unless said): prefill of one 2048-token prompt; decode ms/step at
batch 1 and 8 after a 128-token prompt; transformers decode = (generate(N + 1) - generate(1)) / N;
recap's prefill again with a checkpoint written at every 16-token block boundary (128 states), to read the
cost of checkpoint emission against the plain prefill of the same round.
recap runs with each linear backend of --backends ("torch" = plain F.linear, "onednn" = oneDNN on a packed
weight). Engines alternate within each round so that load drift on a shared machine hits them alike; the
load average before and after is printed and saved (other processes on the cores distort every figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from recap.backends import Backend, CpuBackend, TorchBackend
from recap.kernels.linear_rows import linear_rows_available
from recap.kernels.metadata import SeqSpec
from recap.model.cache import ModelCaches
from recap.model.layers.linear import Linear
from recap.model.loader import load_model
from recap.model.models import CausalLM
from recap.model.testing import forward_step

BLOCK = 16
PREFILL_LEN = 2048
# --clock cpu: this thread's CPU time instead of wall time. At 1 torch thread every op runs on the calling thread,
# so CPU time excludes the time other processes hold the cores (a loaded shared machine), not the work itself.
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
_now = CLOCKS["wall"]
PROMPT_LEN = 128


def machine_limits() -> dict[str, float]:
    """The machine's limits now, on the benchmark's clock (1 thread): oneDNN fp32 GEMM peak (GFLOP/s, a
    2048 x 768 x 3072 product) and 1-row mat-vec bandwidth (GB/s, a 512 MiB weight read once); best of 5."""
    x, w, v = torch.randn(2048, 768), torch.randn(3072, 768), torch.randn(1, 4096)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
    big = torch.ops.mkldnn._reorder_linear_weight(torch.randn(32768, 4096), 8)

    def best(x: torch.Tensor, wp: torch.Tensor) -> float:
        torch.ops.mkldnn._linear_pointwise(x, wp, None, "none", [], "")
        ts = []
        for _ in range(5):
            t = _now()
            torch.ops.mkldnn._linear_pointwise(x, wp, None, "none", [], "")
            ts.append(_now() - t)
        return min(ts)

    return {"gemm_gflops": 2 * x.shape[0] * w.numel() / best(x, packed) / 1e9,
            "matvec_gbs": 32768 * 4096 * 4 / best(v, big) / 1e9}  # fmt: skip


def linear_stats(model: CausalLM) -> dict[str, float] | None:
    """Weights of the linear layers: those a prefill token multiplies (all but the head, which runs for the
    last token only) and those a decode step reads (the head too). None for MoE models (active experts vary)."""
    if any(type(m).__name__ in ("SparseMoE", "StackedExperts", "ExpertList") for m in model.modules()):
        return None
    head = model.head()
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, Linear) and m is not head)
    return {"prefill_params": body, "decode_bytes": 4 * (body + head.weight.numel())}


def fraction_of_limit(row: dict[str, Any], stats: dict[str, float], lim: dict[str, float]) -> dict[str, float]:
    """Share of the machine limit each figure reaches: prefill FLOP/s (2 x params per token) over GEMM peak;
    decode: the time to read the weights once at the mat-vec bandwidth (batch 8: or to multiply 8 rows at GEMM
    peak, if longer) over the measured step."""
    read_s = stats["decode_bytes"] / (lim["matvec_gbs"] * 1e9)
    b8_s = max(read_s, 8 * 2 * stats["decode_bytes"] / 4 / (lim["gemm_gflops"] * 1e9))
    return {"prefill_of_limit": 2 * stats["prefill_params"] * row["prefill_tok_s"] / (lim["gemm_gflops"] * 1e9),
            "decode_b1_of_limit": read_s / (row["decode_ms_b1"] / 1e3),
            "decode_b8_of_limit": b8_s / (row["decode_ms_b8"] / 1e3)}  # fmt: skip


def build_checkpoint(name: str, folder: Path) -> Path:
    if (folder / "model.safetensors").is_file():
        return folder
    import transformers as tf

    if name in FAMILY_CHECKPOINTS:
        cls, cfg = FAMILY_CHECKPOINTS[name]()
    elif name == "lfm2-150m":
        cfg = tf.Lfm2Config(
            vocab_size=65536, hidden_size=768, intermediate_size=4608, num_hidden_layers=12, num_attention_heads=12,
            num_key_value_heads=4, full_attn_idxs=[2, 5, 8, 11], conv_L_cache=3, initializer_range=0.02,
            block_multiple_of=256,
        )  # fmt: skip
        cls = tf.Lfm2ForCausalLM
    elif name == "kimi-linear-150m":
        cfg = tf.KimiLinearConfig(
            vocab_size=32000, hidden_size=768, num_hidden_layers=8, intermediate_size=2048,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, mlp_layer_types=["dense"] + ["sparse"] * 7,
            num_attention_heads=6, num_key_value_heads=6, kv_lora_rank=256, q_lora_rank=None, qk_rope_head_dim=64,
            qk_nope_head_dim=128, v_head_dim=128, linear_num_heads=6, linear_head_dim=128, linear_conv_kernel_dim=4,
            num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, n_shared_experts=1,
            initializer_range=0.02, pad_token_id=0,
        )  # fmt: skip
        cls = tf.KimiLinearForCausalLM
    elif name == "mamba2-130m":
        cfg = tf.Mamba2Config(
            vocab_size=50280, hidden_size=768, num_hidden_layers=24, num_heads=24, head_dim=64, expand=2,
            state_size=128, n_groups=1, chunk_size=256, tie_word_embeddings=True, initializer_range=0.02,
        )  # fmt: skip
        cls = tf.Mamba2ForCausalLM
    elif name == "qwen3_5-150m":
        cfg = tf.Qwen3_5TextConfig(
            vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3, num_attention_heads=8,
            num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
            linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, tie_word_embeddings=False,
            initializer_range=0.02,
        )  # fmt: skip
        cls = tf.Qwen3_5ForCausalLM
    else:
        cfg = tf.BambaConfig(
            vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=10,
            attn_layer_indices=[3, 7], num_attention_heads=12, num_key_value_heads=4, mamba_n_heads=24,
            mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_chunk_size=256, initializer_range=0.02,
        )  # fmt: skip
        cls = tf.BambaForCausalLM
    torch.manual_seed(0)
    cls(cfg).eval().save_pretrained(str(folder))
    return folder


def _nemotron_h_150m() -> tuple[Any, Any]:
    import transformers as tf

    cfg = tf.NemotronHConfig(
        vocab_size=32000, hidden_size=768, hybrid_override_pattern="M-M-M*-M-M-M*-M-M-", intermediate_size=4096,
        mamba_num_heads=24, mamba_head_dim=64, n_groups=8, ssm_state_size=128, chunk_size=256,
        num_attention_heads=12, num_key_value_heads=4, head_dim=64, initializer_range=0.02,
    )  # fmt: skip
    return tf.NemotronHForCausalLM, cfg


def _granite_h_150m() -> tuple[Any, Any]:
    import transformers as tf

    cfg = tf.GraniteMoeHybridConfig(
        vocab_size=32000, hidden_size=768, num_hidden_layers=12,
        layer_types=["mamba"] * 5 + ["attention"] + ["mamba"] * 5 + ["attention"], num_attention_heads=12,
        num_key_value_heads=4, num_local_experts=16, num_experts_per_tok=4, intermediate_size=128,
        shared_intermediate_size=1024, mamba_n_heads=24, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
        mamba_chunk_size=256, position_embedding_type="nope", embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.0078125, logits_scaling=6.0, tie_word_embeddings=True, initializer_range=0.02,
    )  # fmt: skip
    return tf.GraniteMoeHybridForCausalLM, cfg


FAMILY_CHECKPOINTS = {"nemotron-h-150m": _nemotron_h_150m, "granite-h-150m": _granite_h_150m}


def _ids(vocab: int, batch: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


class RecapEngine:
    """recap with one linear backend, on the CPU backend (native decode kernels, decode graphs) where the native
    kernels build, as the engine runs by default; decode state is prepared once per batch size."""

    def __init__(self, model: CausalLM, backend: str) -> None:
        self.model = model
        self.backend: Backend = CpuBackend(backend) if linear_rows_available() else TorchBackend(backend)
        self.name = f"recap[{backend}]"

    def _model(self) -> CausalLM:
        """The model, prepared for this engine's backend (again when another engine prepared it since)."""
        if not self.backend.serves(self.model):
            self.backend.prepare(self.model)
        return self.model

    def prefill(self, every_block: bool = False) -> float:
        """Seconds for one PREFILL_LEN-token prompt (+ its last-token logits); with `every_block`, the state is
        also checkpointed at every block boundary inside it (one slot each)."""
        model = self._model()
        ids = _ids(model.config.vocab_size, 1, PREFILL_LEN)[0].tolist()
        blocks = list(range(1, 1 + PREFILL_LEN // BLOCK))
        cps = [(p, 1 + i) for i, p in enumerate(range(BLOCK, PREFILL_LEN + 1, BLOCK))] if every_block else []
        caches = ModelCaches.allocate(model.config, len(blocks) + 1, BLOCK, 2 + len(cps), model.dtype)
        spec = SeqSpec(ids, 0, blocks, state_slot=len(cps) + 1, checkpoints=cps)
        t = _now()
        hidden, batch = forward_step(model, caches, [spec], self.backend)
        model.compute_logits(hidden[batch.logits_indices]).argmax(-1)
        return _now() - t

    def decode(self, batch: int, steps: int) -> float:
        """Median seconds per decode step of `batch` rows after a PROMPT_LEN prefill each."""
        model = self._model()
        per_seq = (PROMPT_LEN + steps + 2) // BLOCK + 1
        caches = ModelCaches.allocate(model.config, 1 + batch * per_seq, BLOCK, batch + 1, model.dtype)
        prompts = _ids(model.config.vocab_size, batch, PROMPT_LEN)
        tables = [list(range(1 + r * per_seq, 1 + (r + 1) * per_seq)) for r in range(batch)]
        specs = [SeqSpec(prompts[r].tolist(), 0, tables[r], state_slot=r + 1) for r in range(batch)]
        hidden, fb = forward_step(model, caches, specs, self.backend)
        nxt = model.compute_logits(hidden[fb.logits_indices]).argmax(-1).tolist()
        times = []
        for step in range(steps):
            specs = [SeqSpec([nxt[r]], PROMPT_LEN + step, tables[r], state_slot=r + 1) for r in range(batch)]
            t = _now()
            hidden, fb = forward_step(model, caches, specs, self.backend)
            nxt = model.compute_logits(hidden[fb.logits_indices]).argmax(-1).tolist()
            times.append(_now() - t)
        return statistics.median(times[1:])


class HFEngine:
    """transformers on the same checkpoint: forward for prefill, generate() for decode."""

    name = "transformers"

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(path).eval()

    def prefill(self) -> float:
        ids = _ids(self.hf.config.vocab_size, 1, PREFILL_LEN)
        t = _now()
        with torch.no_grad():
            self.hf(ids, logits_to_keep=1).logits.argmax(-1)
        return _now() - t

    def _generate(self, ids: torch.Tensor, n: int) -> float:
        t = _now()
        with torch.no_grad():
            self.hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                pad_token_id=0,
            )  # fmt: skip
        return _now() - t

    def decode(self, batch: int, steps: int) -> float:
        """Seconds per step: (generate(steps + 1) - generate(1)) / steps."""
        ids = _ids(self.hf.config.vocab_size, batch, PROMPT_LEN)
        return (self._generate(ids, steps + 1) - self._generate(ids, 1)) / steps


def bench_one(name: str, path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every metric is measured in rounds that alternate the engines, so load drift hits them alike."""
    lm = load_model(path)
    params = sum(p.numel() for p in lm.model.parameters())
    cfg = lm.config
    slot_bytes, kv_bytes = cfg.state_bytes_per_slot(torch.float32), cfg.kv_bytes_per_token(torch.float32)
    print(
        f"{name}: one checkpoint (state slot) {slot_bytes} B = KV of {slot_bytes / max(kv_bytes, 1):.1f} tokens "
        f"({kv_bytes} B/token, fp32)",
        flush=True,
    )
    engines: list[Any] = [RecapEngine(lm.model, b) for b in args.backends]
    if not args.skip_hf:
        engines.append(HFEngine(path))
    samples: dict[tuple[str, str], list[float]] = {}
    for e in engines:  # warm-up
        e.prefill()
    limits: list[dict[str, float]] = []
    for _ in range(args.reps):
        limits.append(machine_limits())
        for e in engines:
            samples.setdefault((e.name, "prefill"), []).append(e.prefill())
            if isinstance(e, RecapEngine) and lm.config.has_ssm:
                samples.setdefault((e.name, "prefill_ckpt"), []).append(e.prefill(every_block=True))
            for b in (1, 8):
                steps = args.hf_steps if isinstance(e, HFEngine) else args.steps
                samples.setdefault((e.name, f"b{b}"), []).append(e.decode(b, steps))
    lim = {k: statistics.median(x[k] for x in limits) for k in limits[0]}
    stats = linear_stats(lm.model)
    rows = []
    for e in engines:
        med = {k: statistics.median(samples[(e.name, k)]) for k in ("prefill", "b1", "b8")}
        rows.append({
            "model": name, "engine": e.name, "params_M": round(params / 1e6, 1),
            "checkpoint_bytes": slot_bytes, "kv_bytes_per_token": kv_bytes,
            "prefill_tok_s": PREFILL_LEN / med["prefill"],
            "decode_ms_b1": 1e3 * med["b1"], "decode_ms_b8": 1e3 * med["b8"],
        })  # fmt: skip
        rows[-1]["limits"] = lim
        if stats is not None:
            rows[-1].update(fraction_of_limit(rows[-1], stats, lim))
        ckpt = samples.get((e.name, "prefill_ckpt"))
        if ckpt:  # paired by round: each round's every-block prefill over the same round's plain prefill
            ratios = [c / p for c, p in zip(ckpt, samples[(e.name, "prefill")])]
            rows[-1]["prefill_ckpt_tok_s"] = PREFILL_LEN / statistics.median(ckpt)
            rows[-1]["ckpt_every_block_overhead"] = statistics.median(ratios) - 1.0
        print(rows[-1], flush=True)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'model':<18} {'engine':<15} {'prefill tok/s':>13} {'dec ms b1':>10} {'dec ms b8':>10} {'dec tok/s b8':>12}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        tps8 = 8e3 / r["decode_ms_b8"]
        print(
            f"{r['model']:<18} {r['engine']:<15} {r['prefill_tok_s']:>13.1f} {r['decode_ms_b1']:>10.1f} "
            f"{r['decode_ms_b8']:>10.1f} {tps8:>9.1f}"
        )
    by_model: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_model.setdefault(r["model"], {})[r["engine"]] = r
    for r in rows:
        if "prefill_of_limit" in r:
            lim = r["limits"]
            shares = (f"prefill {100 * r['prefill_of_limit']:.0f}%, decode b1 {100 * r['decode_b1_of_limit']:.0f}%, "
                      f"b8 {100 * r['decode_b8_of_limit']:.0f}%")  # fmt: skip
            print(f"{r['model']} {r['engine']}: of the machine limit (GEMM {lim['gemm_gflops']:.0f} GFLOP/s, mat-vec "
                  f"{lim['matvec_gbs']:.1f} GB/s, medians of the rounds): {shares}")  # fmt: skip
    for r in rows:
        if "ckpt_every_block_overhead" in r:
            print(f"{r['model']} {r['engine']}: prefill with a checkpoint at every block "
                  f"{r['prefill_ckpt_tok_s']:.1f} tok/s, overhead {100 * r['ckpt_every_block_overhead']:+.1f}% "
                  f"(median of per-round ratios)")  # fmt: skip
    for model, engines in by_model.items():
        hf = engines.get("transformers")
        if hf is None:
            continue
        for engine, r in engines.items():
            if engine != "transformers":
                print(
                    f"{model} {engine}: prefill x{r['prefill_tok_s'] / hf['prefill_tok_s']:.2f}, "
                    f"decode b1 x{hf['decode_ms_b1'] / r['decode_ms_b1']:.2f}, "
                    f"decode b8 x{hf['decode_ms_b8'] / r['decode_ms_b8']:.2f} vs transformers"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", nargs="+", default=["mamba2-130m", "hybrid-130m"],
                    choices=["mamba2-130m", "hybrid-130m", "qwen3_5-150m", "lfm2-150m", "kimi-linear-150m",
                             *FAMILY_CHECKPOINTS])  # fmt: skip
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "recap" / "bench-models")
    ap.add_argument("--reps", type=int, default=3, help="rounds per metric (medians are reported)")
    ap.add_argument("--steps", type=int, default=12, help="recap decode steps per measurement")
    ap.add_argument("--hf-steps", type=int, default=6, help="transformers decode steps per measurement")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--backends", nargs="+", default=["torch", "onednn"], help="recap linear backends to run")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="cpu: thread CPU time (needs --threads 1)")
    ap.add_argument("--out", type=Path, default=Path("bench_out") / "bench_model.json")
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu measures the calling thread only: use --threads 1")
    global _now
    _now = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    load = [os.getloadavg()[0]]
    rows = []
    for name in args.models:
        rows += bench_one(name, build_checkpoint(name, args.cache_dir / name), args)
    load.append(os.getloadavg()[0])
    print(
        f"\ntorch {torch.__version__}, {args.threads} threads, fp32, {args.clock} clock, "
        f"1-min load {load[0]:.2f} -> {load[1]:.2f}"
    )
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"threads": args.threads, "clock": args.clock, "torch": torch.__version__, "load_avg_1min": load,
            "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(meta, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
