"""Deterministic request scripts run against an LLM; each returns its outputs in submission order.

A script derives later prompts from earlier outputs (multi-turn), so two engines that answer the
same way see the same prompts; equivalence tests compare their outputs one by one.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from recap import LLM, SamplingParams
from recap.engine.llm_engine import LLMEngine
from recap.engine.outputs import RequestOutput

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)


def rnd(seed: int, n: int, vocab: int = 512) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, vocab) for _ in range(n)]


def drain(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step `engine` until no request is left; each request's last output."""
    outs: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    return outs


def floor_block(n: int) -> int:
    return n // BS * BS


def prompt_end(n: int) -> int:
    """The last block boundary strictly before a prompt's last token (DESIGN §4)."""
    return floor_block(n - 1)


def multiturn(llm: LLM) -> list[RequestOutput]:
    outs, hist = [], rnd(1, 45)
    for turn in range(3):
        o = llm.generate([hist], GREEDY)[0]
        outs.append(o)
        hist = hist + o.outputs[0].token_ids + rnd(10 + turn, 17)
    return outs


def sysprompt_marked(llm: LLM) -> list[RequestOutput]:
    # The prompt end (48) lies in the question, so only the marked boundary (40 -> 32) is shared.
    s = rnd(2, 40)
    return [llm.generate([s + rnd(20 + i, 23)], GREEDY, segment_boundaries=[[40]])[0] for i in range(3)]


def sysprompt_unmarked(llm: LLM) -> list[RequestOutput]:
    s = rnd(3, 40)
    return [llm.generate([s + rnd(30 + i, 23)], GREEDY)[0] for i in range(3)]


def insert(llm: LLM) -> list[RequestOutput]:
    a, c, x = rnd(4, 40), rnd(5, 60), rnd(6, 10)
    first = llm.generate([a + c], GREEDY, segment_boundaries=[[40]])[0]
    return [first, llm.generate([a + x + c], GREEDY)[0]]


def identical(llm: LLM) -> list[RequestOutput]:
    p = rnd(7, 53)
    return llm.generate([p, p, p], GREEDY) + llm.generate([p], GREEDY)


def shifted(llm: LLM) -> list[RequestOutput]:
    t = rnd(8, 120)
    return [llm.generate([q], GREEDY)[0] for q in (t[:80], t[5:85], t[:100], t[5:110])]


def concurrent_mix(llm: LLM) -> list[RequestOutput]:
    s = rnd(9, 40)
    prompts = [s + rnd(40 + i, 7 + 5 * i) for i in range(5)] + [rnd(50, 33)]
    return llm.generate(prompts, GREEDY)


SCRIPTS: dict[str, Callable[[LLM], list[RequestOutput]]] = {
    "multiturn": multiturn,
    "sysprompt_marked": sysprompt_marked,
    "sysprompt_unmarked": sysprompt_unmarked,
    "insert": insert,
    "identical": identical,
    "shifted": shifted,
    "concurrent_mix": concurrent_mix,
}
