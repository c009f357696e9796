"""Train recap's default models on CPU: a ~9M-parameter NemotronH hybrid and a ~2.6M draft, same tokenizer.

    python tools/train_default_model.py --out /tmp/recap-train --draft-minutes 15 --main-minutes 90

Seeded (data order, init, chat samples); plain torch on transformers' NemotronHForCausalLM (random init,
AdamW, warmup then cosine decay over the run's time budget, so a budget always ends at the LR floor).
Each model trains in `OUT/<name>/`: `ckpt.pt` (model + optimizer + progress, for `--resume`), `hf/` (a
transformers folder with the tokenizer, what tools/ship_default_model.py ships), `log.json` and `loss.png`.
Checkpoints every `--ckpt-minutes`. The data (tools/default_model_data.py) is fetched by npm, pip and apt-get
into `--cache`.

NemotronH: transformers, vLLM and llama.cpp all run it, and recap has it (recap/model/families.py); its
blocks are one kind each (Mamba2, attention without RoPE, or a relu2 MLP), so the shape is a pattern string.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from default_model_data import Corpus, load_corpus

SEED = 31
VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BLOCKS = {"M": "mamba", "*": "attention", "-": "mlp"}


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    pattern: str  # one char per layer: M mamba2, * attention, - mlp
    intermediate: int
    seq_len: int
    batch: int
    lr: float


MAIN = Shape("main", 256, "M-M-M*-M-M-", 1024, 256, 4, 2e-3)
DRAFT = Shape("draft", 128, "M-M*-", 512, 256, 4, 3e-3)


def nemotron_config(shape: Shape, vocab: int):
    from transformers import NemotronHConfig

    return NemotronHConfig(
        vocab_size=vocab, hidden_size=shape.hidden, layers_block_type=[BLOCKS[c] for c in shape.pattern],
        intermediate_size=shape.intermediate, num_attention_heads=shape.hidden // 64,
        num_key_value_heads=max(1, shape.hidden // 128), head_dim=64, mamba_num_heads=2 * shape.hidden // 64,
        mamba_head_dim=64, n_groups=1, ssm_state_size=64, chunk_size=64, conv_kernel=4,
        max_position_embeddings=8192, tie_word_embeddings=False, use_mamba_kernels=False,
        bos_token_id=0, eos_token_id=[0, 3], pad_token_id=1, initializer_range=0.02,
    )  # fmt: skip


def train_tokenizer(corpus: Corpus, folder: Path) -> None:
    """Byte-level BPE (VOCAB_SIZE) on the training documents only, saved for transformers' AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(corpus.train, trainer=trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|pad|>",
        unk_token=None, chat_template=CHAT_TEMPLATE, model_max_length=8192,
    ).save_pretrained(str(folder))  # fmt: skip


def token_streams(corpus: Corpus, tok_dir: Path, out: Path) -> tuple[np.ndarray, np.ndarray]:
    """(train, heldout) token ids as uint16, documents joined by <|endoftext|>; cached in `out`."""
    paths = out / "train.npy", out / "heldout.npy"
    if all(p.is_file() for p in paths):
        return np.load(paths[0]), np.load(paths[1])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    chats = [tok.apply_chat_template([{"role": "user", "content": u}, {"role": "assistant", "content": a}],
                                     tokenize=False) for u, a in corpus.chat]  # fmt: skip

    def stream(texts: list[str]) -> np.ndarray:
        ids: list[int] = []
        for t in texts:
            ids.extend(tok(t)["input_ids"] + [tok.eos_token_id])
        return np.asarray(ids, dtype=np.uint16)

    train, heldout = stream(corpus.train + chats), stream(corpus.heldout)
    np.save(paths[0], train)
    np.save(paths[1], heldout)
    return train, heldout


def lr_at(shape: Shape, step: int, frac: float) -> float:
    warm = min(1.0, (step + 1) / 30)
    return shape.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def batch(data: np.ndarray, shape: Shape, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - shape.seq_len, (shape.batch,), generator=gen)
    return torch.stack([torch.from_numpy(data[s : s + shape.seq_len].astype(np.int64)) for s in starts.tolist()])


@torch.no_grad()
def heldout_loss(model, data: np.ndarray, shape: Shape, windows: int = 8) -> float:
    model.eval()
    step = max(1, (len(data) - shape.seq_len) // windows)
    xs = torch.stack([torch.from_numpy(data[i * step : i * step + shape.seq_len].astype(np.int64))
                      for i in range(windows)])  # fmt: skip
    loss = model(input_ids=xs, labels=xs, use_cache=False).loss.item()
    model.train()
    return loss


def save(model, opt, state: dict, folder: Path, tok_dir: Path) -> None:
    """ckpt.pt (atomic rename) + hf/ (transformers folder with the tokenizer) + log.json + loss.png."""
    tmp = folder / "ckpt.pt.tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), **state}, tmp)
    os.replace(tmp, folder / "ckpt.pt")
    hf = folder / "hf"
    model.save_pretrained(str(hf))
    for f in tok_dir.iterdir():
        (hf / f.name).write_bytes(f.read_bytes())
    log = {k: state[k] for k in ("step", "elapsed", "tokens", "losses", "evals")}
    (folder / "log.json").write_text(json.dumps(log))
    plot(log, folder / "loss.png", folder.name)


def plot(log: dict, path: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    tok, loss = zip(*log["losses"], strict=True) if log["losses"] else ((), ())
    k = 20
    smooth = [sum(loss[max(0, i - k) : i + 1]) / len(loss[max(0, i - k) : i + 1]) for i in range(len(loss))]
    ax.plot(tok, smooth, label="train (moving mean of 20 steps)")
    if log["evals"]:
        et, el = zip(*log["evals"], strict=True)
        ax.plot(et, el, "o-", label="held-out")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"recap default model '{name}' (NemotronH), CPU, 1 thread")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _resume_state(folder: Path, model, opt, resume: bool) -> dict:
    fresh = {"step": 0, "elapsed": 0.0, "tokens": 0, "losses": [], "evals": [], "rng": None}
    path = folder / "ckpt.pt"
    if not (resume and path.is_file()):
        return fresh
    ck = torch.load(path, weights_only=False)
    model.load_state_dict(ck.pop("model"))
    opt.load_state_dict(ck.pop("opt"))
    return {**fresh, **ck}


def train(shape: Shape, train_ids: np.ndarray, heldout_ids: np.ndarray, tok_dir: Path, out: Path,
          budget_s: float, ckpt_s: float, resume: bool) -> None:  # fmt: skip
    """Train `shape` for `budget_s` seconds of wall time in all (resumed runs count what they already had)."""
    from tqdm import tqdm
    from transformers import NemotronHForCausalLM

    folder = out / shape.name
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    model = NemotronHForCausalLM(nemotron_config(shape, VOCAB_SIZE)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=shape.lr, betas=(0.9, 0.95), weight_decay=0.1)
    state = _resume_state(folder, model, opt, resume)
    gen = torch.Generator().manual_seed(SEED + state["step"])  # a resumed run draws fresh windows
    n = sum(p.numel() for p in model.parameters())
    print(f"{shape.name}: {n / 1e6:.2f}M params, {len(train_ids)} train tokens, resume at step {state['step']}")
    start, last_ckpt = time.monotonic() - state["elapsed"], time.monotonic()
    bar = tqdm(total=int(budget_s), initial=int(state["elapsed"]), unit="s", mininterval=30, desc=shape.name)
    while (elapsed := time.monotonic() - start) < budget_s:
        for g in opt.param_groups:
            g["lr"] = lr_at(shape, state["step"], elapsed / budget_s)
        x = batch(train_ids, shape, gen)
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] += 1
        state["tokens"] += x.numel()
        state["losses"].append((state["tokens"], loss.item()))
        state["elapsed"] = time.monotonic() - start
        bar.update(int(state["elapsed"]) - bar.n)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{state['tokens'] / max(state['elapsed'], 1):.0f}")
        if time.monotonic() - last_ckpt >= ckpt_s:
            state["evals"].append((state["tokens"], heldout_loss(model, heldout_ids, shape)))
            save(model, opt, state, folder, tok_dir)
            last_ckpt = time.monotonic()
    state["evals"].append((state["tokens"], heldout_loss(model, heldout_ids, shape)))
    save(model, opt, state, folder, tok_dir)
    bar.close()
    print(f"{shape.name}: done, {state['step']} steps, {state['tokens']} tokens, held-out {state['evals'][-1][1]:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/recap-train"))
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "recap" / "train-data")
    ap.add_argument("--main-minutes", type=float, default=90.0, help="time budget of the main model")
    ap.add_argument("--draft-minutes", type=float, default=15.0, help="time budget of the draft (trained first)")
    ap.add_argument("--ckpt-minutes", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--resume", action="store_true", help="continue from OUT/<model>/ckpt.pt where present")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    random.seed(SEED)
    args.out.mkdir(parents=True, exist_ok=True)
    tok_dir = args.out / "tokenizer"
    corpus = load_corpus(args.cache, SEED)
    if not (tok_dir / "tokenizer.json").is_file():
        train_tokenizer(corpus, tok_dir)
    train_ids, heldout_ids = token_streams(corpus, tok_dir, args.out)
    (args.out / "heldout.txt").write_text("\n\n".join(corpus.heldout))
    print(f"data: {len(train_ids)} train / {len(heldout_ids)} held-out tokens")
    for shape, minutes in ((DRAFT, args.draft_minutes), (MAIN, args.main_minutes)):
        if minutes > 0:
            train(shape, train_ids, heldout_ids, tok_dir, args.out, minutes * 60, args.ckpt_minutes * 60,
                  args.resume)  # fmt: skip


if __name__ == "__main__":
    main()
