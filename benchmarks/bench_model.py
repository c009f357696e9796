"""recap vs transformers on the same ~130M random-weight checkpoints: prefill tokens/s and decode ms/step.

    .venv/bin/python benchmarks/bench_model.py --threads 2 [--backends onednn] [--out bench_out/bench_model.json]

Checkpoints (seeded, built once into --cache-dir with transformers' own classes):
- mamba2-130m: Mamba2 (d_model 768, 24 layers, 24 heads x 64, state 128, vocab 50280, tied), 129M params
- hybrid-130m: Bamba-style (d_model 768, 10 layers: attention at 3 and 7, MLP 2048, vocab 32000), ~130M
- lfm2-150m: LFM2 (d_model 768, 12 layers: attention at 2, 5, 8, 11, short convs K=3, MLP 3072, vocab 65536)
- kimi-linear-150m: Kimi-Linear (d_model 768, 8 layers: MLA at 3 and 7, KDA 6 heads x 128, dense MLP 2048 then
  MoE 8 experts top-2 x 512 + 1 shared, vocab 32000)
The bytes of one state slot (a checkpoint) and the KV bytes per token of each model are printed beside them.
Measures (medians, fp32, batch 1 unless said): prefill of one 2048-token prompt; decode ms/step at
batch 1 and 8 after a 128-token prompt; transformers decode = (generate(N + 1) - generate(1)) / N.
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

from recap.kernels.metadata import SeqSpec
from recap.model.cache import ModelCaches
from recap.model.loader import load_model
from recap.model.models import CausalLM
from recap.model.testing import forward_step

BLOCK = 16
PREFILL_LEN = 2048
PROMPT_LEN = 128


def build_checkpoint(name: str, folder: Path) -> Path:
    if (folder / "model.safetensors").is_file():
        return folder
    import transformers as tf

    if name == "lfm2-150m":
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


def _ids(vocab: int, batch: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


class RecapEngine:
    """recap with one linear backend; decode state is prepared once per batch size."""

    def __init__(self, model: CausalLM, backend: str) -> None:
        self.model, self.backend = model, backend
        self.name = f"recap[{backend}]"

    def prefill(self) -> float:
        """Seconds for one PREFILL_LEN-token prompt (+ its last-token logits)."""
        self.model.set_linear_backend(self.backend)
        model = self.model
        ids = _ids(model.config.vocab_size, 1, PREFILL_LEN)[0].tolist()
        blocks = list(range(1, 1 + PREFILL_LEN // BLOCK))
        caches = ModelCaches.allocate(model.config, len(blocks) + 1, BLOCK, 2, model.dtype)
        t = time.perf_counter()
        hidden, batch = forward_step(model, caches, [SeqSpec(ids, 0, blocks, state_slot=1)])
        model.compute_logits(hidden[batch.logits_indices]).argmax(-1)
        return time.perf_counter() - t

    def decode(self, batch: int, steps: int) -> float:
        """Median seconds per decode step of `batch` rows after a PROMPT_LEN prefill each."""
        self.model.set_linear_backend(self.backend)
        model = self.model
        per_seq = (PROMPT_LEN + steps + 2) // BLOCK + 1
        caches = ModelCaches.allocate(model.config, 1 + batch * per_seq, BLOCK, batch + 1, model.dtype)
        prompts = _ids(model.config.vocab_size, batch, PROMPT_LEN)
        tables = [list(range(1 + r * per_seq, 1 + (r + 1) * per_seq)) for r in range(batch)]
        specs = [SeqSpec(prompts[r].tolist(), 0, tables[r], state_slot=r + 1) for r in range(batch)]
        hidden, fb = forward_step(model, caches, specs)
        nxt = model.compute_logits(hidden[fb.logits_indices]).argmax(-1).tolist()
        times = []
        for step in range(steps):
            specs = [SeqSpec([nxt[r]], PROMPT_LEN + step, tables[r], state_slot=r + 1) for r in range(batch)]
            t = time.perf_counter()
            hidden, fb = forward_step(model, caches, specs)
            nxt = model.compute_logits(hidden[fb.logits_indices]).argmax(-1).tolist()
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])


class HFEngine:
    """transformers on the same checkpoint: forward for prefill, generate() for decode."""

    name = "transformers"

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(path).eval()

    def prefill(self) -> float:
        ids = _ids(self.hf.config.vocab_size, 1, PREFILL_LEN)
        t = time.perf_counter()
        with torch.no_grad():
            self.hf(ids, logits_to_keep=1).logits.argmax(-1)
        return time.perf_counter() - t

    def _generate(self, ids: torch.Tensor, n: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            self.hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                pad_token_id=0,
            )  # fmt: skip
        return time.perf_counter() - t

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
    print(f"{name}: one checkpoint (state slot) {slot_bytes} B = KV of {slot_bytes / max(kv_bytes, 1):.1f} tokens "
          f"({kv_bytes} B/token, fp32)", flush=True)
    engines: list[Any] = [RecapEngine(lm.model, b) for b in args.backends]
    if not args.skip_hf:
        engines.append(HFEngine(path))
    samples: dict[tuple[str, str], list[float]] = {}
    for e in engines:  # warm-up
        e.prefill()
    for _ in range(args.reps):
        for e in engines:
            samples.setdefault((e.name, "prefill"), []).append(e.prefill())
            for b in (1, 8):
                steps = args.hf_steps if isinstance(e, HFEngine) else args.steps
                samples.setdefault((e.name, f"b{b}"), []).append(e.decode(b, steps))
    rows = []
    for e in engines:
        med = {k: statistics.median(samples[(e.name, k)]) for k in ("prefill", "b1", "b8")}
        rows.append({
            "model": name, "engine": e.name, "params_M": round(params / 1e6, 1),
            "checkpoint_bytes": slot_bytes, "kv_bytes_per_token": kv_bytes,
            "prefill_tok_s": PREFILL_LEN / med["prefill"],
            "decode_ms_b1": 1e3 * med["b1"], "decode_ms_b8": 1e3 * med["b8"],
        })  # fmt: skip
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
    ap.add_argument("--models", nargs="+", default=["mamba2-130m", "hybrid-130m"])
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "recap" / "bench-models")
    ap.add_argument("--reps", type=int, default=3, help="rounds per metric (medians are reported)")
    ap.add_argument("--steps", type=int, default=12, help="recap decode steps per measurement")
    ap.add_argument("--hf-steps", type=int, default=6, help="transformers decode steps per measurement")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--backends", nargs="+", default=["torch", "onednn"], help="recap linear backends to run")
    ap.add_argument("--out", type=Path, default=Path("bench_out") / "bench_model.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = [os.getloadavg()[0]]
    rows = []
    for name in args.models:
        rows += bench_one(name, build_checkpoint(name, args.cache_dir / name), args)
    load.append(os.getloadavg()[0])
    print(f"\ntorch {torch.__version__}, {args.threads} threads, fp32, 1-min load {load[0]:.2f} -> {load[1]:.2f}")
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"threads": args.threads, "torch": torch.__version__, "load_avg_1min": load, "rows": rows}
    args.out.write_text(json.dumps(meta, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
