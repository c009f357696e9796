"""A seeded multi-turn conversation trace in Mooncake's format (hash ids per 512-token block).

A held-out trace for the replay (the shared Mooncake trace is the one the policy was tuned on).
Conversations arrive as a Poisson process; each picks one of `num_system_prompts` shared system prompts
(Zipf-weighted, so a few are popular and many are rare) and sends a geometric number of turns separated
by exponential think times. Turn t's prompt is the system prompt, every earlier user message and answer,
and a new user message; its output length is the answer the next turn carries. So the next turn extends
the whole previous prompt, which Mooncake's hashing shows up to the previous prompt's last full block:
the partial last block has its own id, as in kvcache-ai/Mooncake's traces.

Block ids: a prompt is a list of content pieces (piece id, length); block j's key is the id of block j-1
and the pieces covering block j's tokens (with their offsets), interned in first-seen order. Equal keys
give equal ids, so equal prefixes have equal ids and a prefix diverges at the first block whose content
differs, a partial block included.

Usage: python -m recap.bench.conversations --out FILE [--seed 0 --conversations 2000 ...]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from recap.bench.trace import MOONCAKE_BLOCK_TOKENS

Piece = tuple[int, int]  # (piece id, tokens)


@dataclass(frozen=True)
class ConversationTraceConfig:
    seed: int = 0
    conversations: int = 2000
    system_prompts: int = 3000
    zipf_s: float = 0.7  # popularity of system prompt i is 1 / (i + 1) ** zipf_s
    system_tokens: tuple[int, int] = (400, 6000)  # uniform range
    mean_turns: float = 1.7  # geometric, at least one turn
    max_turns: int = 16
    user_tokens: tuple[int, int] = (200, 10000)  # log-uniform range (short questions, pasted documents)
    output_tokens: tuple[int, int] = (40, 900)  # uniform range
    conversations_per_s: float = 1.5  # Poisson arrivals of new conversations
    mean_think_s: float = 90.0  # exponential pause between a turn's answer and the next turn

    def __post_init__(self) -> None:
        if self.conversations < 1 or self.system_prompts < 1 or self.max_turns < 1:
            raise ValueError("conversations, system_prompts and max_turns must be positive")
        if self.mean_turns < 1 or self.conversations_per_s <= 0 or self.mean_think_s < 0:
            raise ValueError("mean_turns must be >= 1, conversations_per_s > 0, mean_think_s >= 0")
        for name in ("system_tokens", "user_tokens", "output_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}: need 1 <= low <= high, got {(lo, hi)}")


class BlockIds:
    """Interns (parent id, block content) keys into consecutive ids (see the module docstring)."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def __call__(self, pieces: Sequence[Piece], num_tokens: int) -> list[int]:
        """The hash ids of a prompt made of `pieces` (exactly `num_tokens` tokens)."""
        out: list[int] = []
        parent, block, filled = -1, [], 0
        for piece_id, length in pieces:
            offset = 0
            while offset < length:
                take = min(length - offset, MOONCAKE_BLOCK_TOKENS - filled)
                block.append((piece_id, offset, take))
                offset, filled = offset + take, filled + take
                if filled == MOONCAKE_BLOCK_TOKENS:
                    parent = self._intern(parent, block)
                    out.append(parent)
                    block, filled = [], 0
        if block:
            out.append(self._intern(parent, block))
        assert len(out) == -(-num_tokens // MOONCAKE_BLOCK_TOKENS)
        return out

    def _intern(self, parent: int, block: list[tuple[int, int, int]]) -> int:
        return self._ids.setdefault((parent, tuple(block)), len(self._ids))


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(lo * (hi / lo) ** rng.random()))


def generate(cfg: ConversationTraceConfig) -> list[dict]:
    """The trace's rows (Mooncake fields), sorted by timestamp."""
    rng = random.Random(cfg.seed)
    system = [rng.randint(*cfg.system_tokens) for _ in range(cfg.system_prompts)]
    weights = [1.0 / (i + 1) ** cfg.zipf_s for i in range(cfg.system_prompts)]
    ids, next_piece = BlockIds(), cfg.system_prompts  # piece ids 0..S-1 are the system prompts
    rows: list[tuple[float, int, dict]] = []
    start = 0.0
    for conv in range(cfg.conversations):
        start += rng.expovariate(cfg.conversations_per_s)
        s = rng.choices(range(cfg.system_prompts), weights)[0]
        pieces: list[Piece] = [(s, system[s])]
        turns = min(cfg.max_turns, 1 + int(rng.expovariate(1.0) * (cfg.mean_turns - 1)))
        t = start
        for _ in range(turns):
            pieces.append((next_piece, _log_uniform(rng, *cfg.user_tokens)))
            output = rng.randint(*cfg.output_tokens)
            n = sum(length for _, length in pieces)
            row = {"timestamp": int(t * 1000), "input_length": n, "output_length": output, "hash_ids": ids(pieces, n)}
            rows.append((t, conv, row))
            pieces.append((next_piece + 1, output))  # the answer, carried by the next turn
            next_piece += 2
            t += rng.expovariate(1.0 / cfg.mean_think_s) if cfg.mean_think_s else 0.0
    rows.sort(key=lambda r: (r[0], r[1]))
    return [row for _, _, row in rows]


def unlimited_hit_rate(rows: Sequence[dict]) -> float:
    """Tokens of the longest prefix of whole blocks an earlier request had, below each prompt's last token."""
    seen: set[int] = set()
    hit = total = 0
    for row in rows:
        ids, n = row["hash_ids"], row["input_length"]
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        hit += min(k * MOONCAKE_BLOCK_TOKENS, (n - 1) // 16 * 16)  # never the last token (16-token grid)
        total += n
        seen.update(ids)
    return hit / total if total else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m recap.bench.conversations",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True)
    for f in fields(ConversationTraceConfig):
        default = f.default
        if isinstance(default, tuple):
            p.add_argument(f"--{f.name.replace('_', '-')}", type=int, nargs=2, default=list(default))
        else:
            p.add_argument(f"--{f.name.replace('_', '-')}", type=type(default), default=default)
    args = p.parse_args(argv)
    values = {f.name: getattr(args, f.name) for f in fields(ConversationTraceConfig)}
    try:
        cfg = ConversationTraceConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
    except ValueError as e:
        p.exit(2, f"error: {e}\n")
    rows = generate(cfg)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokens = sum(r["input_length"] for r in rows)
    print(
        f"{args.out}: {len(rows)} requests, {tokens:,} prompt tokens, "
        f"unlimited bound {100 * unlimited_hit_rate(rows):.1f}% (512-token blocks)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
