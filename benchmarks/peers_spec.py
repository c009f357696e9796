"""llama.cpp's speculative decoding for benchmarks/bench_speculative_peers.py: plain greedy decode
(llama-completion), n-gram lookup and draft-model speculation (llama-speculative-simple), one sequence each, on
a GGUF conversion of the same model; their printed timings and draft counts parsed.

The tools are llama.cpp's examples, which the peers build (benchmarks/peers_llama.py) leaves out
(LLAMA_BUILD_EXAMPLES=OFF): build them with that option on, or compile them against the built shared libraries
(docs/speculative.md, "Against llama.cpp"). `lib` is where those libraries are (LD_LIBRARY_PATH), or None.

Why llama-speculative-simple for the n-gram row and not llama-lookup: on a recurrent/hybrid model (NemotronH) a
partial `llama_memory_seq_rm` fails unless the context keeps per-token state snapshots (`n_rs_seq`, which
llama.cpp sets only for MTP/EAGLE3/DFlash drafting). llama-lookup ignores that failure and decodes on from a
state holding the rejected drafts (its output differs from plain greedy within a few tokens), while
llama-speculative-simple then saves the sequence state before each verify pass and, on a partial acceptance,
restores it and verifies the accepted tokens again. `--spec-type ngram-cache` is llama-lookup's algorithm (the
n-gram cache over n = 1..4, as recap's prompt_lookup_min/max = 1/4) inside that loop; it drafts at most 8 tokens.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LlamaSpecTools:
    bin: Path  # holds llama-completion and llama-speculative-simple
    lib: Path | None  # the shared libraries they load (LD_LIBRARY_PATH), or None

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.lib is not None:
            env["LD_LIBRARY_PATH"] = str(self.lib)
        return env


@dataclass(frozen=True)
class LlamaRun:
    """One generation: decode tok/s as the tool prints it, its text after the prompt, and the verify passes."""

    tok_s: float
    tokens: int
    text: str
    passes: int = 0  # target forward passes after the prompt (verify passes and re-verifies after a rollback)
    verify_steps: int = 0  # passes that verified fresh drafts
    accepted: int = 0  # drafts accepted at those passes
    rollbacks: int = 0  # partial acceptances: state restored, the accepted tokens verified again

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step as recap counts them: 1 + accepted / verify steps (1 without drafts)."""
        return 1.0 + self.accepted / self.verify_steps if self.verify_steps else 1.0


def _common(gguf: Path, prompt: str, tokens: int) -> list[str]:
    """Greedy, 1 thread, EOS banned (recap's benchmark sets ignore_eos: every run makes `tokens` tokens)."""
    return ["-m", str(gguf), "-p", prompt, "-n", str(tokens), "--temp", "0", "-t", "1", "-tb", "1",
            "-c", "2048", "--ignore-eos", "--seed", "0"]  # fmt: skip


def _run(tools: LlamaSpecTools, cmd: list[str], timing: re.Pattern[str],
         tries: int = 3) -> tuple[subprocess.CompletedProcess[str], re.Match[str]]:  # fmt: skip
    """Run a tool until its timing line shows: on this machine a run sometimes exits (status 0) with the end
    of its asynchronous log lost (the last token and the timings), so such a run is repeated."""
    for _ in range(tries):
        res = subprocess.run(cmd, check=True, capture_output=True, text=True, env=tools.env(), stdin=subprocess.DEVNULL)
        m = timing.search(res.stderr)
        if m is not None:
            return res, m
    raise RuntimeError(f"{Path(cmd[0]).name}: no timing line in {tries} runs:\n{res.stderr[-2000:]}")


def plain(tools: LlamaSpecTools, gguf: Path, prompt: str, tokens: int) -> LlamaRun:
    """llama-completion: tok/s from its `eval time` line (the single-token decode passes after the prompt)."""
    cmd = [str(tools.bin / "llama-completion"), *_common(gguf, prompt, tokens), "-no-cnv", "--no-display-prompt"]
    res, m = _run(tools, cmd, re.compile(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs"))
    ms, runs = float(m.group(1)), int(m.group(2))
    return LlamaRun(runs / (ms / 1e3), runs, res.stdout)


def speculative(tools: LlamaSpecTools, gguf: Path, prompt: str, tokens: int, spec: list[str]) -> LlamaRun:
    """llama-speculative-simple with `spec` (e.g. ["--spec-type", "ngram-cache", "--spec-draft-n-max", "15"] or
    ["-md", DRAFT, "--spec-draft-n-max", "4"]); -v for its per-pass debug lines (parse_passes)."""
    cmd = [str(tools.bin / "llama-speculative-simple"), *_common(gguf, prompt, tokens), *spec, "-v"]
    res, m = _run(tools, cmd, re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"))
    n, seconds = int(m.group(1)), float(m.group(2))
    text = res.stdout.split(prompt, 1)[1] if prompt in res.stdout else res.stdout
    passes, verify, accepted, rollbacks = parse_passes(res.stderr)
    return LlamaRun(n / seconds, n, text.strip("\n"), passes, verify, accepted, rollbacks)


_ACCEPTED = re.compile(r"accepted (\d+)/(\d+) draft tokens")
_PARTIAL = re.compile(r"partial acceptance: (\d+) < (\d+)")


def parse_passes(log: str) -> tuple[int, int, int, int]:
    """(passes, verify steps, accepted drafts, rollbacks) from llama-speculative-simple's debug log. A pass ends in
    "accepted a/d" (all d accepted) or "partial acceptance: a < d" (state restored; the next pass verifies the a
    accepted tokens and the verifier's one again, which is no fresh draft)."""
    passes = verify = accepted = rollbacks = 0
    reverify = False
    for line in log.splitlines():
        m = _PARTIAL.search(line)
        if m is not None:
            passes, verify, rollbacks = passes + 1, verify + 1, rollbacks + 1
            accepted += int(m.group(1))
            reverify = True
            continue
        m = _ACCEPTED.search(line)
        if m is None:
            continue
        passes += 1
        if not reverify and int(m.group(2)) > 0:
            verify += 1
            accepted += int(m.group(1))
        reverify = False
    return passes, verify, accepted, rollbacks


def same_prefix(a: str, b: str) -> bool:
    """Whether two generations agree as far as the shorter goes (a speculating tool may run a few tokens past
    --n-predict with its last accepted drafts)."""
    a, b = a.strip(), b.strip()
    n = min(len(a), len(b))
    return n > 0 and a[:n] == b[:n]
