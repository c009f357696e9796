"""The server side of the peers benchmark: recap serve and llama-server, driven with token-id prompts.

Both servers get the same prompts as token ids (the random checkpoints have no real tokenizer: recap gets a
word-level tokenizer over the model's vocabulary, llama.cpp its built-in one), greedy, one request at a time.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from peers_llama import LlamaCpp, server_cmd

CTX = 4096
SYSTEM = 1500  # shared system prompt tokens
QUESTION = 40  # tokens of each question / each new turn
TURNS = 4


def tokenizer_for(checkpoint: Path, root: Path) -> Path:
    """A word-level tokenizer ("t0" .. "t{V-1}") over the checkpoint's vocabulary, for recap's server."""
    import json

    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    out = root / f"wordlevel-{vocab}"
    if (out / "tokenizer.json").is_file():
        return out
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(str(out))
    return out


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    # ids 10.. (low ids are special tokens in llama.cpp's built-in vocabulary)
    return torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class _Server:
    name = "?"

    def __init__(self, cmd: list[str], port: int) -> None:
        self.cmd, self.port = cmd, port
        self.proc: subprocess.Popen | None = None
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {' '.join(self.cmd)}")
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} did not come up on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def complete(self, ids: list[int], max_tokens: int = 1) -> tuple[float, int]:
        """(seconds until the response, prompt tokens the server computed) for one greedy request."""
        raise NotImplementedError


class RecapServer(_Server):
    name = "recap"

    def __init__(self, checkpoint: Path, tokenizer: Path, threads: int, port: int, quant: str | None = None) -> None:
        cmd = [sys.executable, "-m", "recap.cli", "serve", str(checkpoint), "--tokenizer", str(tokenizer),
               "--served-model-name", "bench", "--port", str(port), "--num-threads", str(threads),
               "--max-model-len", str(CTX), "--log-level", "warning"]  # fmt: skip
        super().__init__(cmd + (["--quantization", quant] if quant else []), port)

    def complete(self, ids: list[int], max_tokens: int = 1) -> tuple[float, int]:
        body: dict[str, Any] = {"model": "bench", "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
        t = time.perf_counter()
        r = self.client.post("/v1/completions", json=body)
        dt = time.perf_counter() - t
        r.raise_for_status()
        usage = r.json()["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return dt, usage["prompt_tokens"] - cached


class LlamaServer(_Server):
    name = "llama.cpp"

    def __init__(self, llama: LlamaCpp, gguf: Path, threads: int, port: int) -> None:
        super().__init__(server_cmd(llama, gguf, threads, port, CTX), port)

    def complete(self, ids: list[int], max_tokens: int = 1) -> tuple[float, int]:
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "cache_prompt": True}
        t = time.perf_counter()
        r = self.client.post("/completion", json=body)
        dt = time.perf_counter() - t
        r.raise_for_status()
        return dt, int(r.json()["timings"]["prompt_n"])


def cold_prefill_tok_s(server: _Server, vocab: int, n: int, seed: int) -> float:
    """n fresh tokens (no cache hit possible), max_tokens 1: n / time to first token."""
    dt, processed = server.complete(_ids(vocab, n, seed))
    return processed / dt


def multiturn_ttft_s(server: _Server, vocab: int, seed: int) -> float:
    """Median TTFT of turns 2..TURNS, each the previous prompt plus QUESTION new tokens (a 1,000-token start)."""
    prompt = _ids(vocab, 1000, seed)
    server.complete(prompt)
    times = []
    for turn in range(1, TURNS):
        prompt = prompt + _ids(vocab, QUESTION, seed + turn)
        times.append(server.complete(prompt)[0])
    return sorted(times)[len(times) // 2]


def shared_prompt_reprocessed(server: _Server, vocab: int, seed: int) -> float:
    """Mean prompt tokens computed for questions 2..4 after one shared SYSTEM-token system prompt."""
    system = _ids(vocab, SYSTEM, seed)
    counts = [server.complete(system + _ids(vocab, QUESTION, seed + 1 + q))[1] for q in range(4)]
    return sum(counts[1:]) / len(counts[1:])
