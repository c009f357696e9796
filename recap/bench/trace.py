"""Request traces for replay: recap's JSONL of token ids, and Mooncake's JSONL of block hash ids.

Definitions
- recap format, one request per line:
  `{"timestamp": ms, "prompt_token_ids": [...], "output_length": n, "segment_boundaries": [...]}`
  (`segment_boundaries` optional: token offsets of segment ends, as the API layer would pass them).
- Mooncake format (kvcache-ai/Mooncake FAST'25 traces), one request per line:
  `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}` where `hash_ids[j]`
  identifies the prefix up to the end of 512-token block j; the last block holds
  `input_length - 512 * (len(hash_ids) - 1)` tokens and has its own id.
- expansion: a Mooncake block id becomes 512 deterministic token ids, so that equal ids give equal
  tokens (equal prefixes stay equal) and different ids give different tokens from the block's first
  token on (so prefixes diverge exactly where the ids do). The first `HEADER` tokens spell the id in
  base `vocab_size` (distinct ids can never collide); the rest is a slice of a fixed pseudo-random
  table (xxhash of the index, mod the vocabulary) at an offset drawn from xxhash of the id. Slicing
  a shared table keeps expansion at pointer-copy speed: the full trace is 61M tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import xxhash

MOONCAKE_BLOCK_TOKENS = 512
HEADER = 3  # tokens that spell the block id in base vocab_size


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
        """The first `length` tokens of block `hash_id`."""
        if not 0 < length <= MOONCAKE_BLOCK_TOKENS:
            raise ValueError(f"block length must be in 1..{MOONCAKE_BLOCK_TOKENS}, got {length}")
        v = self.vocab_size
        if not 0 <= hash_id < v**HEADER:
            raise ValueError(f"hash id {hash_id} outside 0..{v**HEADER - 1}")
        header = [hash_id % v, (hash_id // v) % v, hash_id // (v * v)]
        off = xxhash.xxh64_intdigest(hash_id.to_bytes(8, "little"), self.seed + 1) % self.table_size
        tokens = header + self._table[off : off + MOONCAKE_BLOCK_TOKENS - HEADER]
        return tokens[:length] if length < MOONCAKE_BLOCK_TOKENS else tokens

    def expand(self, hash_ids: Iterable[int], num_tokens: int) -> list[int]:
        """Token ids of a prompt of `num_tokens` tokens given as one hash id per 512-token block."""
        ids = list(hash_ids)
        if len(ids) != -(-num_tokens // MOONCAKE_BLOCK_TOKENS):
            raise ValueError(f"{len(ids)} hash ids do not cover {num_tokens} tokens in 512-token blocks")
        out: list[int] = []
        for j, h in enumerate(ids):
            out += self.block(h, min(MOONCAKE_BLOCK_TOKENS, num_tokens - j * MOONCAKE_BLOCK_TOKENS))
        return out


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
    return (expander or default_expander()).expand(req.hash_ids, req.num_prompt_tokens)


def parse_trace_line(obj: dict, index: int) -> TraceRequest:
    """One JSON object of either format -> TraceRequest (raises ValueError naming the problem)."""
    if not isinstance(obj, dict):
        raise ValueError(f"line {index + 1}: expected a JSON object")
    try:
        ts = float(obj["timestamp"])
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
        if len(ids) != -(-n // MOONCAKE_BLOCK_TOKENS):
            raise ValueError(f"line {index + 1}: {len(ids)} hash ids for input_length {n}")
        return TraceRequest(index, ts, n, out_len, hash_ids=ids, segment_boundaries=bounds)
    raise ValueError(f"line {index + 1}: neither 'prompt_token_ids' nor 'hash_ids'")


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a trace (either format, detected per line), ordered by timestamp (ties keep file order)."""
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
            reqs.append(parse_trace_line(obj, len(reqs)))
    reqs.sort(key=lambda r: (r.timestamp_ms, r.index))
    return reqs
