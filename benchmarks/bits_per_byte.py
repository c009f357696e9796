"""Bits per byte of a text under causal LMs with different tokenizers (transformers, fp32): comparable where
perplexities in different tokens are not.

    .venv/bin/python benchmarks/bits_per_byte.py --data /tmp/recap-train3/heldout.txt --start 0 --chars 60000 \\
        MODEL [MODEL ...]

Each model reads the same characters in windows of --window tokens, each led by token 0 (`<|endoftext|>` in
recap's default models); the total negative log-likelihood / ln 2 / the text's UTF-8 bytes.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch


def bits_per_byte(model_dir: str, text: str, window: int, bos: int = 0) -> tuple[float, int, float]:
    """(bits per byte, tokens scored, perplexity per token) of `text` under the model in `model_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids), window - 1):
            w = torch.tensor([[bos, *ids[s : s + window - 1]]])
            logp = torch.log_softmax(model(w).logits[0, :-1].float(), -1)
            nll -= logp.gather(1, w[0, 1:, None]).sum().item()
            n += w.shape[1] - 1
    return nll / math.log(2) / len(text.encode()), n, math.exp(nll / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--start", type=int, default=0, help="first character")
    ap.add_argument("--chars", type=int, default=60000)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    text = args.data.read_text(encoding="utf-8")[args.start : args.start + args.chars]
    print(f"{len(text)} characters, {len(text.encode())} bytes from character {args.start}")
    for m in args.models:
        bpb, n, ppl = bits_per_byte(m, text, args.window)
        print(f"{m}: {bpb:.4f} bits/byte ({n} tokens, perplexity {ppl:.2f})")


if __name__ == "__main__":
    main()
