"""Ship a training run's checkpoints as recap's default models (package data under recap/model/weights/).

    python tools/ship_default_model.py --run /tmp/recap-train

For `main` -> recap/model/weights/default and `draft` -> recap/model/weights/default-draft: config.json,
model.safetensors (bf16 unless --dtype), generation_config.json (a request without max_tokens stops at
DEFAULT_MAX_NEW_TOKENS, as the random default does), the tokenizer files, training.json (step, tokens,
held-out loss, data source) and, in the main folder, corpus_words.txt (the words of the tokenizer's training
text, which tests/model/test_trained_default.py checks generations against). The loss curves go to docs/.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
MODELS = (("main", "default"), ("draft", "default-draft"))
WORD = re.compile(r"[a-z]+")


def corpus_words(texts: list[str], min_count: int = 2) -> list[str]:
    counts = collections.Counter(w for t in texts for w in WORD.findall(t.lower()))
    return sorted(w for w, c in counts.items() if c >= min_count)


def ship_one(src: Path, dest: Path, dtype: torch.dtype, max_new_tokens: int) -> dict:
    from transformers import NemotronHForCausalLM

    model = NemotronHForCausalLM.from_pretrained(str(src / "hf"), dtype=torch.float32).to(dtype)
    model.generation_config.max_new_tokens = max_new_tokens
    model.generation_config.eos_token_id = [0, 3]  # <|endoftext|>, <|im_end|>
    model.generation_config.pad_token_id = 1
    if dest.exists():
        shutil.rmtree(dest)
    model.save_pretrained(str(dest))
    for name in TOKENIZER_FILES:
        shutil.copyfile(src / "hf" / name, dest / name)
    log = json.loads((src / "log.json").read_text())
    info = {
        "steps": log["step"], "tokens": log["tokens"], "train_seconds": round(log["elapsed"]),
        "heldout_loss": log["evals"][-1][1] if log["evals"] else None,
        "params": sum(p.numel() for p in model.parameters()), "dtype": str(dtype).removeprefix("torch."),
    }  # fmt: skip
    return info


def main() -> None:
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    import default_model_data as data

    from recap.model.default_model import DEFAULT_MAX_NEW_TOKENS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", type=Path, default=Path("/tmp/recap-train"), help="train_default_model.py's --out")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "recap" / "train-data")
    ap.add_argument("--dest", type=Path, default=ROOT / "recap" / "model" / "weights")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = ap.parse_args()
    source = data.provenance()
    for run_name, ship_name in MODELS:
        if not (args.run / run_name / "hf").is_dir():
            print(f"{run_name}: no checkpoint under {args.run / run_name}, skipped")
            continue
        dest = args.dest / ship_name
        info = ship_one(args.run / run_name, dest, getattr(torch, args.dtype), DEFAULT_MAX_NEW_TOKENS)
        (dest / "training.json").write_text(json.dumps({**info, "data": source}, indent=1) + "\n")
        shutil.copyfile(args.run / run_name / "loss.png", ROOT / "docs" / f"default_model_loss_{run_name}.png")
        print(f"{run_name} -> {dest}: {info}")
    corpus = data.load_corpus(args.cache, 0)
    (args.dest / "default").mkdir(parents=True, exist_ok=True)
    (args.dest / "default" / "corpus_words.txt").write_text("\n".join(corpus_words(corpus.train)) + "\n")


if __name__ == "__main__":
    main()
