"""Request traces for replay: recap's JSONL of token ids, and the JSONL of block hash ids that Mooncake's and
Alibaba Bailian's public traces use.

Definitions
- recap format, one request per line:
  `{"timestamp": ms, "prompt_token_ids": [...], "output_length": n, "segment_boundaries": [...]}`
  (`segment_boundaries` optional: token offsets of segment ends, as the API layer would pass them).
- Mooncake format (kvcache-ai/Mooncake FAST'25 traces), one request per line:
  `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}` where `hash_ids[j]`
  identifies the prefix up to the end of 512-token block j; the last block holds
  `input_length - 512 * (len(hash_ids) - 1)` tokens and has its own id.
- Bailian format (Alibaba's qwen_trace* files, "KVCache in the wild"): the same fields plus `chat_id`,
  `parent_chat_id`, `turn` and `type`, hash ids per 16-token block, timestamps in seconds. Told apart by
  `chat_id` and `parent_chat_id`; `hash_block_tokens` / `time_unit` override either format's defaults (a
  trace hashed in other blocks is an error naming its count, never silently cut).
- expansion: a block id becomes its block's count of deterministic token ids, so that equal ids give equal
  tokens (equal prefixes stay equal) and different ids give different tokens from the block's first
  token on (so prefixes diverge exactly where the ids do). The first `HEADER` tokens spell the id in
  base `vocab_size` (distinct ids can never collide); the rest is a slice of a fixed pseudo-random
  table (xxhash of the index, mod the vocabulary) at an offset drawn from xxhash of the id. Slicing
  a shared table keeps expansion at pointer-copy speed: the full trace is 61M tokens.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import xxhash

MOONCAKE_BLOCK_TOKENS = 512
BAILIAN_BLOCK_TOKENS = 16
HEADER = 3  # tokens that spell the block id in base vocab_size
TIME_UNITS = {"ms": 1.0, "s": 1000.0}  # -> milliseconds


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace. Exactly one of `token_ids` / `hash_ids` is set."""

    index: int  # line order in the file
    timestamp_ms: float
    num_prompt_tokens: int
    output_length: int
    token_ids: tuple[int, ...] | None = None
    hash_ids: tuple[int, ...] | None = None
    segment_boundaries: tuple[int, ...] = ()
    hash_block_tokens: int = MOONCAKE_BLOCK_TOKENS  # the tokens each hash id covers (the last: the rest)

    def __post_init__(self) -> None:
        if (self.token_ids is None) == (self.hash_ids is None):
            raise ValueError("a trace request has either token ids or hash ids")
        if self.num_prompt_tokens < 1:
            raise ValueError(f"request {self.index}: empty prompt")
        if self.output_length < 1:
            raise ValueError(f"request {self.index}: output_length must be >= 1")

    @property
    def arrival_s(self) -> float:
        return self.timestamp_ms / 1000.0


class TokenExpander:
    """Turns Mooncake block hash ids into deterministic token ids (see the module docstring)."""

    def __init__(self, vocab_size: int = 32000, table_size: int = 1 << 16, seed: int = 0) -> None:
        if vocab_size < 2:
            raise ValueError("vocab_size must be at least 2")
        self.vocab_size = vocab_size
        self.table_size = table_size
        self.seed = seed
        body = MOONCAKE_BLOCK_TOKENS - HEADER
        self._table = [
            xxhash.xxh64_intdigest(i.to_bytes(8, "little"), seed) % vocab_size for i in range(table_size + body)
        ]

    def block(self, hash_id: int, length: int = MOONCAKE_BLOCK_TOKENS) -> list[int]:
        """The first `length` tokens of block `hash_id` (a block's tokens do not depend on its size)."""
        if not 0 < length <= MOONCAKE_BLOCK_TOKENS:
            raise ValueError(f"block length must be in 1..{MOONCAKE_BLOCK_TOKENS}, got {length}")
        v = self.vocab_size
        if not 0 <= hash_id < v**HEADER:
            raise ValueError(f"hash id {hash_id} outside 0..{v**HEADER - 1}")
        header = [hash_id % v, (hash_id // v) % v, hash_id // (v * v)]
        off = xxhash.xxh64_intdigest(hash_id.to_bytes(8, "little"), self.seed + 1) % self.table_size
        tokens = header + self._table[off : off + MOONCAKE_BLOCK_TOKENS - HEADER]
        return tokens[:length] if length < MOONCAKE_BLOCK_TOKENS else tokens

    def expand(self, hash_ids: Iterable[int], num_tokens: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[int]:
        """Token ids of a prompt of `num_tokens` tokens given as one hash id per `block_tokens`-token block."""
        ids = list(hash_ids)
        check_block_tokens(block_tokens)
        if len(ids) != -(-num_tokens // block_tokens):
            raise ValueError(f"{len(ids)} hash ids do not cover {num_tokens} tokens in {block_tokens}-token blocks")
        out: list[int] = []
        for j, h in enumerate(ids):
            out += self.block(h, min(block_tokens, num_tokens - j * block_tokens))
        return out


def check_block_tokens(n: int) -> None:
    """A block must hold its id's header (distinct ids never collide) and fit the expander's table."""
    if not HEADER < n <= MOONCAKE_BLOCK_TOKENS:
        raise ValueError(f"hash blocks of {n} tokens: recap expands blocks of {HEADER + 1}..{MOONCAKE_BLOCK_TOKENS}")


_DEFAULT_EXPANDER: TokenExpander | None = None


def default_expander() -> TokenExpander:
    global _DEFAULT_EXPANDER
    if _DEFAULT_EXPANDER is None:
        _DEFAULT_EXPANDER = TokenExpander()
    return _DEFAULT_EXPANDER


def prompt_token_ids(req: TraceRequest, expander: TokenExpander | None = None) -> list[int]:
    """The request's prompt as token ids (expanded on demand: keep only running requests' prompts)."""
    if req.token_ids is not None:
        return list(req.token_ids)
    assert req.hash_ids is not None
    return (expander or default_expander()).expand(req.hash_ids, req.num_prompt_tokens, req.hash_block_tokens)


def parse_trace_line(obj: dict, index: int, hash_block_tokens: int | None = None,
                     time_unit: str | None = None) -> TraceRequest:
    """One JSON object of any format -> TraceRequest (raises ValueError naming the problem). `hash_block_tokens`,
    `time_unit` ("ms" or "s"): override the format's own (Mooncake: 512, ms; Bailian: 16, s)."""
    if not isinstance(obj, dict):
        raise ValueError(f"line {index + 1}: expected a JSON object")
    bailian = "chat_id" in obj and "parent_chat_id" in obj
    unit = time_unit or ("s" if bailian else "ms")
    if unit not in TIME_UNITS:
        raise ValueError(f"time unit must be one of {sorted(TIME_UNITS)}, got {unit!r}")
    try:
        ts = float(obj["timestamp"]) * TIME_UNITS[unit]
        out_len = int(obj["output_length"])
    except KeyError as e:
        raise ValueError(f"line {index + 1}: missing field {e.args[0]!r}") from None
    bounds = tuple(int(b) for b in obj.get("segment_boundaries", ()))
    if "prompt_token_ids" in obj:
        toks = tuple(int(t) for t in obj["prompt_token_ids"])
        if "input_length" in obj and int(obj["input_length"]) != len(toks):
            raise ValueError(f"line {index + 1}: input_length disagrees with prompt_token_ids")
        return TraceRequest(index, ts, len(toks), out_len, token_ids=toks, segment_boundaries=bounds)
    if "hash_ids" in obj:
        n = int(obj["input_length"])
        ids = tuple(int(h) for h in obj["hash_ids"])
        block = hash_block_tokens or (BAILIAN_BLOCK_TOKENS if bailian else MOONCAKE_BLOCK_TOKENS)
        check_block_tokens(block)
        if len(ids) != -(-n // block):
            raise ValueError(f"line {index + 1}: {len(ids)} hash ids for input_length {n} in {block}-token blocks "
                             f"(a trace hashed in other blocks: --trace-block-tokens)")
        return TraceRequest(index, ts, n, out_len, hash_ids=ids, segment_boundaries=bounds, hash_block_tokens=block)
    raise ValueError(f"line {index + 1}: neither 'prompt_token_ids' nor 'hash_ids'")


def load_trace(path: str | Path, limit: int | None = None, hash_block_tokens: int | None = None,
               time_unit: str | None = None) -> list[TraceRequest]:
    """Read a trace (the format detected per line; see parse_trace_line for the overrides), ordered by timestamp
    (ties keep file order)."""
    reqs: list[TraceRequest] = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            if limit is not None and len(reqs) >= limit:
                break
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {len(reqs) + 1}: {e}") from None
            reqs.append(parse_trace_line(obj, len(reqs), hash_block_tokens, time_unit))
    reqs.sort(key=lambda r: (r.timestamp_ms, r.index))
    return reqs


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """--trace and the overrides of its format's defaults, for the commands that read one."""
    p.add_argument("--trace", required=True, help="JSONL trace: recap token ids, or Mooncake / Bailian hash ids")
    p.add_argument("--trace-block-tokens", type=int, default=None,
                   help=f"tokens per hash id (default: {MOONCAKE_BLOCK_TOKENS} for Mooncake traces, "
                        f"{BAILIAN_BLOCK_TOKENS} for Bailian ones)")
    p.add_argument("--trace-time-unit", choices=sorted(TIME_UNITS), default=None,
                   help="the timestamps' unit (default: ms for recap and Mooncake traces, s for Bailian ones)")
