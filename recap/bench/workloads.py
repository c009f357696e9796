"""Request recipes of `recap bench`: seeded, fixed shapes built directly in token ids.

Each recipe is a frozen dataclass of sizes whose `waves(space, answers)` generator yields lists of
requests. A wave is sent after the previous wave has finished; the runner records each finished
request's output ids in `answers` before asking for the next wave, so a multi-turn recipe can append
the model's own answer, token for token, to the next prompt (the prefix a decode-end checkpoint
covers). Content is random ids from the tokenizer's ordinary vocabulary (no special tokens), framed
as ChatML messages whose ends are the segment boundaries (DESIGN §4), as `LLM.chat` would mark them.

Recipes:
  multiturn   sessions x turns; each turn appends the answer and a new user message to the history
  sysprompt   one long system prompt, many different questions, one at a time
  insert      agentic edits: a new segment inserted before a long shared suffix at every step
  repetition  vLLM's prefix_repetition: N prefixes, each reused by many prompts with new suffixes
  throughput  nano-vllm / mini-sglang: random prompts of 100..max_len tokens, as many output tokens
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class BenchRequest:
    rid: str
    session: int  # independent conversation / agent / prefix group
    step: int  # turn (multiturn, insert), question index (sysprompt), order (others); 0-based
    prompt: list[int]
    segments: tuple[int, ...] = ()  # token offsets where messages end (segment boundaries)
    max_tokens: int = 16
    temperature: float = 0.0


@dataclass(frozen=True)
class TokenSpace:
    """Token ids a recipe may use: content ids without specials, and ChatML framing."""

    content_ids: tuple[int, ...]
    headers: Mapping[str, tuple[int, ...]]
    footer: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int | None = None) -> TokenSpace:
        size = len(tokenizer) if vocab_size is None else min(len(tokenizer), vocab_size)
        special = set(getattr(tokenizer, "all_special_ids", ()))
        special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        headers = {r: tuple(tokenizer.encode(f"<|im_start|>{r}\n", add_special_tokens=False)) for r in ROLES}
        footer = tuple(tokenizer.encode("<|im_end|>\n", add_special_tokens=False))
        content = tuple(i for i in range(size) if i not in special)
        if not content:
            raise ValueError("the tokenizer has no ordinary token ids")
        return cls(content, headers, footer)

    def content(self, rng: random.Random, n: int) -> list[int]:
        return rng.choices(self.content_ids, k=n)

    def message(self, role: str, content: list[int]) -> list[int]:
        return [*self.headers[role], *content, *self.footer]

    def generation_prompt(self) -> list[int]:
        return list(self.headers["assistant"])


class _Chat:
    """A growing token sequence whose message ends are recorded as segment boundaries."""

    def __init__(self, space: TokenSpace) -> None:
        self.space = space
        self.ids: list[int] = []
        self.bounds: list[int] = []

    def add(self, role: str, content: list[int]) -> _Chat:
        self.ids = self.ids + self.space.message(role, content)  # never extend a list a request holds
        self.bounds.append(len(self.ids))
        return self

    def add_answer(self, answer: list[int]) -> None:
        """The assistant's generated ids follow the generation prompt already in `ids`."""
        self.ids = [*self.ids, *answer, *self.space.footer]
        self.bounds.append(len(self.ids))

    def prompt(self) -> tuple[list[int], tuple[int, ...]]:
        """Prompt ids (messages + generation prompt) and the boundaries inside it."""
        ids = self.ids + self.space.generation_prompt()
        return ids, tuple(b for b in self.bounds if b < len(ids))


def _jitter(rng: random.Random, n: int, spread: float = 0.25) -> int:
    """n +- spread*n, at least 1 (lengths that do not all fall on the same block offsets)."""
    d = int(n * spread)
    return max(1, rng.randint(n - d, n + d))


@dataclass(frozen=True)
class Recipe:
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    toy: ClassVar[dict[str, int]] = {}
    seed: int = 0

    def num_requests(self) -> int:
        raise NotImplementedError

    def waves(self, space: TokenSpace, answers: Mapping[str, list[int]]) -> Iterator[list[BenchRequest]]:
        raise NotImplementedError


@dataclass(frozen=True)
class MultiTurn(Recipe):
    """Turn t of every session is one wave; turn t+1 appends turn t's answer and a new user message."""

    name: ClassVar[str] = "multiturn"
    summary: ClassVar[str] = "sessions x turns, each turn appending the answer and a new user message"
    toy: ClassVar[dict[str, int]] = {
        "sessions": 2,
        "turns": 3,
        "history_tokens": 96,
        "turn_tokens": 24,
        "output_tokens": 4,
    }
    sessions: int = 8
    turns: int = 6
    history_tokens: int = 2048  # the first message of each session (earlier context)
    turn_tokens: int = 100  # new user tokens per turn (+-25%)
    output_tokens: int = 16

    def num_requests(self) -> int:
        return self.sessions * self.turns

    def waves(self, space: TokenSpace, answers: Mapping[str, list[int]]) -> Iterator[list[BenchRequest]]:
        rng = random.Random(self.seed)
        chats = [_Chat(space).add("system", space.content(rng, self.history_tokens)) for _ in range(self.sessions)]
        for turn in range(self.turns):
            wave = []
            for s, chat in enumerate(chats):
                if turn:  # a session the runner skipped (a baseline run on a subset) has no answer
                    chat.add_answer(answers.get(f"s{s}-t{turn - 1}", []))
                chat.add("user", space.content(rng, _jitter(rng, self.turn_tokens)))
                ids, bounds = chat.prompt()
                chat.ids = ids  # the generation prompt stays: the answer follows it
                wave.append(BenchRequest(f"s{s}-t{turn}", s, turn, ids, bounds, self.output_tokens))
            yield wave


@dataclass(frozen=True)
class SysPrompt(Recipe):
    """One system prompt shared by `questions` requests, each its own wave (sent one at a time)."""

    name: ClassVar[str] = "sysprompt"
    summary: ClassVar[str] = "one long system prompt, many different questions"
    toy: ClassVar[dict[str, int]] = {"system_tokens": 96, "questions": 4, "question_tokens": 16, "output_tokens": 4}
    system_tokens: int = 1536
    questions: int = 12
    question_tokens: int = 64  # +-25%
    output_tokens: int = 16

    def num_requests(self) -> int:
        return self.questions

    def system_prompt_len(self, space: TokenSpace) -> int:
        return len(space.message("system", [0] * self.system_tokens))

    def waves(self, space: TokenSpace, answers: Mapping[str, list[int]]) -> Iterator[list[BenchRequest]]:
        rng = random.Random(self.seed)
        system = space.content(rng, self.system_tokens)
        for q in range(self.questions):
            chat = (
                _Chat(space).add("system", system).add("user", space.content(rng, _jitter(rng, self.question_tokens)))
            )
            ids, bounds = chat.prompt()
            yield [BenchRequest(f"q{q}", q, q, ids, bounds, self.output_tokens)]


@dataclass(frozen=True)
class Insert(Recipe):
    """Agentic edits (vLLM issue 43587's shape): step k of a session sends
    system prefix + inserted segments 1..k + the same long instruction suffix, so step k shares
    prefix + segments 1..k-1 with step k-1 and diverges where segment k is inserted."""

    name: ClassVar[str] = "insert"
    summary: ClassVar[str] = "agentic edits: a new segment inserted before a long shared suffix"
    toy: ClassVar[dict[str, int]] = {
        "sessions": 2,
        "steps": 3,
        "prefix_tokens": 48,
        "insert_tokens": 24,
        "suffix_tokens": 64,
        "output_tokens": 4,
    }
    sessions: int = 4
    steps: int = 6
    prefix_tokens: int = 512  # system prompt
    insert_tokens: int = 192  # each inserted segment (a tool result), +-25%
    suffix_tokens: int = 1024  # the shared instruction after the insertion point
    output_tokens: int = 8

    def num_requests(self) -> int:
        return self.sessions * self.steps

    def waves(self, space: TokenSpace, answers: Mapping[str, list[int]]) -> Iterator[list[BenchRequest]]:
        rng = random.Random(self.seed)
        heads = [_Chat(space).add("system", space.content(rng, self.prefix_tokens)) for _ in range(self.sessions)]
        suffixes = [space.message("user", space.content(rng, self.suffix_tokens)) for _ in range(self.sessions)]
        for step in range(self.steps):
            wave = []
            for s, head in enumerate(heads):
                head.add("tool", space.content(rng, _jitter(rng, self.insert_tokens)))
                ids = head.ids + suffixes[s] + space.generation_prompt()
                bounds = (*head.bounds, len(head.ids) + len(suffixes[s]))
                wave.append(BenchRequest(f"s{s}-k{step}", s, step, ids, bounds, self.output_tokens))
            yield wave


@dataclass(frozen=True)
class Repetition(Recipe):
    """vLLM's prefix_repetition dataset: prefixes x prompts each, random suffixes, shuffled (seeded).

    Raw token prompts without segment boundaries, as vLLM's benchmark sends them; sizes are scaled
    down from vLLM's defaults (256/256 tokens, 10 prefixes, 128 output tokens) for a CPU."""

    name: ClassVar[str] = "repetition"
    summary: ClassVar[str] = "vLLM's prefix_repetition: N prefixes, each reused by many prompts"
    toy: ClassVar[dict[str, int]] = {
        "prefixes": 2,
        "prompts_per_prefix": 3,
        "prefix_tokens": 64,
        "suffix_tokens": 16,
        "output_tokens": 4,
    }
    prefixes: int = 4
    prompts_per_prefix: int = 6
    prefix_tokens: int = 512
    suffix_tokens: int = 128
    output_tokens: int = 16

    def num_requests(self) -> int:
        return self.prefixes * self.prompts_per_prefix

    def waves(self, space: TokenSpace, answers: Mapping[str, list[int]]) -> Iterator[list[BenchRequest]]:
        rng = random.Random(self.seed)
        items = []
        for p in range(self.prefixes):
            prefix = space.content(rng, self.prefix_tokens)
            for i in range(self.prompts_per_prefix):
                items.append((p, i, prefix + space.content(rng, self.suffix_tokens)))
        rng.shuffle(items)
        yield [BenchRequest(f"p{p}-{i}", p, n, ids, (), self.output_tokens) for n, (p, i, ids) in enumerate(items)]


@dataclass(frozen=True)
class Throughput(Recipe):
    """nano-vllm's bench.py recipe (also mini-sglang's): `num_seqs` prompts of randint(100, max_len)
    random tokens, each generating randint(100, max_len) tokens, ignore_eos, temperature 0.6, all at
    once. The public recipe is 256 x 1024; scale it down with num_seqs / max_len on a CPU."""

    name: ClassVar[str] = "throughput"
    summary: ClassVar[str] = "nano-vllm's throughput recipe: random prompts and outputs, all at once"
    toy: ClassVar[dict[str, int]] = {"num_seqs": 4, "max_len": 24}
    num_seqs: int = 256
    max_len: int = 1024
    temperature: float = 0.6

    def num_requests(self) -> int:
        return self.num_seqs

    def waves(self, space: TokenSpace, answers: Mapping[str, list[int]]) -> Iterator[list[BenchRequest]]:
        rng = random.Random(self.seed)
        lo = min(100, self.max_len)
        prompts = [space.content(rng, rng.randint(lo, self.max_len)) for _ in range(self.num_seqs)]
        outs = [rng.randint(lo, self.max_len) for _ in range(self.num_seqs)]
        yield [BenchRequest(f"r{i}", i, i, p, (), o, self.temperature) for i, (p, o) in enumerate(zip(prompts, outs))]


RECIPES: dict[str, type[Recipe]] = {r.name: r for r in (MultiTurn, SysPrompt, Insert, Repetition, Throughput)}
