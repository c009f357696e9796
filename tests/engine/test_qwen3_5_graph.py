"""Qwen3.5's decode graph (GDN steps, gated attention with partial RoPE, zero-centred norms) at the engine: greedy
tokens with the CPU backend's graphs equal the module path's with torch's kernels (enforce_eager), with prefix
caching on and off (DESIGN invariant 1), logprobs within test_equivalence's tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest

from recap.backends.decode_graph import DecodeGraph
from recap.kernels.decode_ops import decode_ops_available
from tests.engine.conftest import tiny_model_dir
from tests.engine.test_equivalence import assert_same, make_llm
from tests.engine.workloads import SCRIPTS

pytestmark = pytest.mark.skipif(not decode_ops_available(), reason="no C compiler for native kernels")


def test_graph_decode_equals_the_module_path_cached_or_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_model_dir(tmp_path, "qwen3_5")
    replays: list[int] = []
    real = DecodeGraph.run
    monkeypatch.setattr(DecodeGraph, "run", lambda self, b, c: (replays.append(b.num_seqs), real(self, b, c))[1])
    scripts = ("multiturn", "concurrent_mix")
    want = {s: SCRIPTS[s](make_llm(path, caching=False, enforce_eager=True)) for s in scripts}
    assert not replays, "enforce_eager runs the module path"
    for caching in (False, True):
        for s in scripts:
            got = SCRIPTS[s](make_llm(path, caching=caching))
            assert_same(got, want[s], f"graphs, caching {caching}, {s}")
            if caching and s == "multiturn":
                assert [o.num_cached_tokens for o in got] == [0, 48, 64]  # test_equivalence's recap hits
    assert len(replays) > 20 and max(replays) > 1, f"graph replays by rows: {replays}"
