"""Smoke tests of `recap bench`: every workload at toy size on a tiny hybrid, JSON shape and sanity.

No timing is asserted: only that the figures exist, are finite and positive where they must be, and
that the cache behaves as the recipe implies (no hits with caching off; recap hits where it shares).
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from recap.bench.cli import build_parser, main
from recap.bench.workloads import RECIPES, SysPrompt, TokenSpace

SUMMARY_KEYS = {
    "requests",
    "prompt_tokens",
    "generated_tokens",
    "cached_tokens",
    "hit_rate",
    "bound_hit_rate",
    "ttft_s",
    "throughput_tok_s",
    "checkpoint_bytes",
    "peak_checkpoint_bytes",
    "per_step",
    "request_results",
}
ENGINE_FLAGS = [
    "--threads",
    "1",
    "--max-model-len",
    "1024",
    "--kv-cache-bytes",
    "64MiB",
    "--state-cache-bytes",
    "64MiB",
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Bamba-style hybrid (attention + Mamba2) with a 512-token version of the default tokenizer."""
    from recap.model.default_model import save_tokenizer
    from recap.model.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("bench") / "bamba", vocab_size=512)
    save_tokenizer(path, vocab_size=512)
    return path


def _run(workload: str, model: Path, out: Path, *extra: str) -> dict[str, Any]:
    rc = main([workload, "--toy", "--model", str(model), "--out", str(out), *ENGINE_FLAGS, *extra])
    assert rc == 0
    return json.loads((out / f"{workload}.json").read_text())


def _check_summary(name: str, s: dict[str, Any]) -> None:
    assert set(s) >= SUMMARY_KEYS, f"{name}: missing {SUMMARY_KEYS - set(s)}"
    assert s["requests"] > 0 and s["prompt_tokens"] > 0 and s["generated_tokens"] > 0
    assert 0.0 <= s["hit_rate"] <= s["bound_hit_rate"] + 1e-9 <= 1.0 + 1e-9
    for k in ("mean", "p50", "p95"):
        assert math.isfinite(s["ttft_s"][k]) and s["ttft_s"][k] > 0
    assert s["throughput_tok_s"] > 0


@pytest.mark.parametrize("workload", ["multiturn", "sysprompt", "insert", "repetition", "throughput"])
def test_workload_toy_in_process(workload: str, tiny_model: Path, tmp_path: Path) -> None:
    plots = [] if workload in ("multiturn", "insert") else ["--no-plots"]
    report = _run(workload, tiny_model, tmp_path, *plots)
    configs = report["configs"]
    assert report["workload"] == workload and report["environment"]["threads"] == 1
    assert {"off", "recap"} <= set(configs)
    for name, s in configs.items():
        _check_summary(name, s)
    assert configs["off"]["hit_rate"] == 0 and configs["off"]["checkpoints_created"] == 0
    engines = [s for s in configs.values() if s["kind"] == "engine"]
    assert len({s["prompt_tokens"] for s in engines}) == 1  # one recipe for all configurations
    if workload in ("multiturn", "sysprompt", "insert"):
        assert configs["recap"]["hit_rate"] > 0
        assert configs["recap"]["checkpoint_bytes"] > 0
        assert configs["hf"]["hit_rate"] == 0 and configs["hf"]["requests"] > 0
        assert configs["recap"]["ttft_vs_off"]["mean"] > 0
    if workload == "repetition":
        assert configs["recap"]["hit_rate"] > 0  # learned branch points: hits from the 3rd prompt of a prefix
    if plots == []:
        assert (tmp_path / f"{workload}_hit_rate.png").stat().st_size > 0
        assert (tmp_path / f"{workload}_ttft.png").stat().st_size > 0
    found = report["highlights"]
    if workload == "multiturn":
        assert found["target"]["ratio"] is not None and "ttft_vs_hf" in found["recap"]
        assert (tmp_path / "multiturn_ttft_per_turn.png").stat().st_size > 0
    if workload == "sysprompt":
        # the segment boundary at the system prompt end is checkpointed by the 1st request
        assert found["recap"]["first_request_hitting_system_prompt"] == 2
        assert found["recap"]["cached_tokens_first3"][1] >= found["block_aligned_system_prompt"]
    if workload == "insert":
        assert found["recap"]["hit_of_shared"] >= 0.9


def test_ckpt_overhead_toy(tiny_model: Path, tmp_path: Path) -> None:
    rc = main(
        [
            "ckpt-overhead",
            "--model",
            str(tiny_model),
            "--out",
            str(tmp_path),
            "--prompt-tokens",
            "64",
            "--repeats",
            "2",
            *ENGINE_FLAGS,
        ]
    )
    assert rc == 0
    res = json.loads((tmp_path / "ckpt-overhead.json").read_text())
    assert res["checkpoints_per_prefill"] == {"none": 0, "all": 4}  # blocks 16, 32, 48, 64
    assert res["ratio_of_medians"] > 0 and len(res["seconds"]["all"]) == 2


def test_recipes_are_seeded_and_token_exact(tiny_model: Path) -> None:
    from recap.model.loader import load_tokenizer

    space = TokenSpace.from_tokenizer(load_tokenizer(tiny_model))
    for cls in RECIPES.values():
        recipe = cls(**cls.toy)
        a = [r for w in recipe.waves(space, {}) for r in w]
        b = [r for w in recipe.waves(space, {}) for r in w]
        assert a == b and len(a) == recipe.num_requests()
        assert all(0 < s < len(r.prompt) for r in a for s in r.segments)
    # multiturn: turn t+1 starts with turn t's prompt and answer, token for token
    recipe = RECIPES["multiturn"](**RECIPES["multiturn"].toy)
    answers: dict[str, list[int]] = {}
    prompts: dict[str, list[int]] = {}
    for wave in recipe.waves(space, answers):
        for r in wave:
            prompts[r.rid] = r.prompt
            answers[r.rid] = [7, 8, 9]
    assert prompts["s0-t1"][: len(prompts["s0-t0"]) + 3] == prompts["s0-t0"] + [7, 8, 9]
    sysp = SysPrompt(**SysPrompt.toy)
    first = [w[0] for w in sysp.waves(space, {})]
    assert first[0].segments[0] == first[1].segments[0] == sysp.system_prompt_len(space)


def test_replay_is_delegated() -> None:
    from recap.bench.replay import run_replay

    args = build_parser().parse_args(["replay", "--trace", "t.jsonl", "--kv-unbounded", "--state-checkpoints", "4"])
    assert args.func is run_replay


def test_unknown_config_is_an_error(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["multiturn", "--toy", "--configs", "off,bogus", "--model", str(tiny_model), "--out", str(tmp_path)]) == 2
    )
    assert "bogus" in capsys.readouterr().err


class _Server:
    """`recap serve`'s app on a free loopback port, in a daemon thread."""

    def __init__(self, model: Path) -> None:
        import uvicorn

        from recap.config import CacheConfig, SchedulerConfig
        from recap.engine.async_engine import AsyncEngine
        from recap.engine.config import EngineConfig
        from recap.engine.llm_engine import LLMEngine
        from recap.server.app import build_app

        cfg = EngineConfig(
            model=str(model),
            served_model_name="tiny",
            num_threads=1,
            cache=CacheConfig(kv_cache_bytes=64 << 20, state_cache_bytes=64 << 20),
            scheduler=SchedulerConfig(max_model_len=1024),
        )
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(build_app(AsyncEngine(LLMEngine(cfg))), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def test_sysprompt_against_a_server(tiny_model: Path, tmp_path: Path) -> None:
    srv = _Server(tiny_model)
    try:
        report = _run("sysprompt", tiny_model, tmp_path, "--url", f"recap={srv.url}", "--no-plots")
    finally:
        srv.stop()
    s = report["configs"]["recap"]
    _check_summary("recap", s)
    assert s["kind"] == "url" and s["checkpoint_bytes"] > 0
    cached = report["highlights"]["recap"]["cached_tokens_first3"]
    assert cached[0] == 0 and cached[1] >= report["highlights"]["block_aligned_system_prompt"]


def test_tier_configs_give_their_engine_a_lower_tier() -> None:
    from recap.bench.runners import CONFIGS, EngineOptions

    opts = EngineOptions(cache_dir="/tmp/tiers", cache_host_bytes=1 << 20, cache_disk_bytes=1 << 30)
    assert opts.tier_kwargs(CONFIGS["recap-host"]) == {"cache_host_bytes": 1 << 20}
    disk = opts.tier_kwargs(CONFIGS["recap-disk"])
    assert disk == {"cache_dir": "/tmp/tiers/recap-disk", "cache_disk_bytes": 1 << 30}
    assert opts.tier_kwargs(CONFIGS["recap"]) == {}
    with pytest.raises(ValueError, match="--cache-dir"):
        EngineOptions().tier_kwargs(CONFIGS["recap-disk"])
