"""The `recap` command: flags, size parsing, `generate`, `bench` forwarding, and `recap serve` as the README runs it."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import httpx
import openai
import pytest

from recap import cli
from recap.launch.engine_args import engine_config
from recap.model.default_model import DEFAULT_MAX_NEW_TOKENS
from recap.units import positive_bytes
from tests.server.serve_process import recap_serve


@pytest.mark.parametrize(("text", "value"), [
    ("1024", 1024), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("2gb", 2 * 10**9), ("1.5GiB", 3 * 2**29),
    ("64k", 64_000), ("3 KiB", 3072), ("1e3", 1000), ("7B", 7), ("1Ti", 2**40),
])
def test_positive_bytes(text: str, value: int) -> None:
    assert positive_bytes(text) == value


@pytest.mark.parametrize("text", ["", "MiB", "12XB", "-5MiB", "0", "1.2.3GB", "ten"])
def test_positive_bytes_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        positive_bytes(text)


def _serve_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["serve", *argv])


def test_serve_flags_build_the_engine_config() -> None:
    args = _serve_args("some/model", "--max-model-len", "2048", "--max-num-seqs", "8", "--max-num-batched-tokens",
                       "512", "--block-size", "32", "--no-enable-prefix-caching", "--seed", "3",
                       "--served-model-name", "m", "--dtype", "bfloat16", "--checkpoint-policy", "align",
                       "--kv-cache-bytes", "512MiB", "--state-cache-bytes", "2GB", "--cache-dir", "/tmp/recap-tier",
                       "--cache-disk-bytes", "1GiB", "--cache-host-bytes", "2GiB")
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    cfg = engine_config(args)
    assert cfg.model == "some/model" and cfg.served_model_name == "m" and cfg.dtype == "bfloat16" and cfg.seed == 3
    assert (cfg.scheduler.max_model_len, cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (
        2048, 8, 512)
    c = cfg.cache
    assert (c.block_size, c.enable_prefix_caching, c.checkpoint_policy) == (32, False, "align")
    assert (c.kv_cache_bytes, c.state_cache_bytes) == (512 * 2**20, 2 * 10**9)
    assert (c.cache_dir, c.cache_disk_bytes, c.disk_tier_bytes) == ("/tmp/recap-tier", 2**30, 2**30)
    assert c.cache_host_bytes == 2 * 2**30 and c.tier_names == ("host", "disk")
    default = engine_config(_serve_args())
    assert default.model is None and default.cache.enable_prefix_caching and default.cache.checkpoint_policy == "recap"
    assert default.speculative is None and not default.scheduler.async_scheduling
    assert engine_config(_serve_args("--async-scheduling")).scheduler.async_scheduling
    spec = engine_config(_serve_args("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                                     '"prompt_lookup_min": 2, "prompt_lookup_max": 5}')).speculative
    assert spec is not None and (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min,
                                 spec.prompt_lookup_max) == ("ngram", 3, 2, 5)
    spec = engine_config(_serve_args("--speculative-config", '{"method": "draft_model", "model": "/m/draft", '
                                     '"num_speculative_tokens": 5}')).speculative
    assert spec is not None and (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", "/m/draft", 5)
    spec = engine_config(_serve_args("--speculative-config",
                                     '{"method": "mtp", "num_speculative_tokens": 2}')).speculative
    assert spec is not None and (spec.method, spec.model, spec.num_speculative_tokens) == ("mtp", None, 2)


@pytest.mark.parametrize("argv", [["--kv-cache-bytes", "lots"], ["--checkpoint-policy", "sometimes"],
                                  ["--max-num-seqs", "0"], ["--dtype", "int3"], ["--unknown-flag"],
                                  ["--speculative-config", "{bad"], ["--speculative-config", '{"method": "medusa"}'],
                                  ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
                                  ["--speculative-config", '{"method": "draft_model"}'],
                                  ["--speculative-config", '{"method": "mtp", "model": "/m/draft"}']])
def test_bad_serve_flags_exit_with_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _serve_args(*argv)
    assert e.value.code == 2 and "usage: recap" in capsys.readouterr().err


def test_bench_forwards_or_explains(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("recap.bench.cli")
    fake.main = lambda argv: seen.append(argv) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "recap.bench.cli", fake)
    assert cli.main(["bench", "replay", "--trace", "x"]) == 0 and seen == [["replay", "--trace", "x"]]
    monkeypatch.setitem(sys.modules, "recap.bench.cli", None)  # import fails as if the module were absent
    assert cli.main(["bench"]) == 2
    assert "recap.bench.cli is missing" in capsys.readouterr().err


def test_replicas_without_ray_say_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import fails as in a `make serve` virtualenv
    assert cli.main(["serve", "--replicas", "2"]) == 2
    assert "pip install -e '.[ray]'" in capsys.readouterr().err


def test_generate_prints_the_completion(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from recap import LLM, SamplingParams

    want = LLM(str(tiny_model)).generate("The valve", SamplingParams(temperature=0.0, max_tokens=5))[0]
    assert cli.main(["generate", "--model", str(tiny_model), "The valve", "--max-tokens", "5",
                     "--temperature", "0"]) == 0
    assert capsys.readouterr().out == want.outputs[0].text + "\n"
    assert cli.main(["generate", "--model", str(tiny_model), "Hi", "--chat", "--max-tokens", "3"]) == 0
    assert cli.main(["generate", "--model", str(tiny_model), "Hi", "--max-tokens", "0"]) == 2
    assert "max_tokens must be at least 1" in capsys.readouterr().err


def test_recap_serve_without_model_serves_the_default(tmp_path: Path) -> None:
    """Also the vLLM flags recap serve once refused to start with: --api-key, --dtype auto, --mamba-cache-mode."""
    vllm_flags = ["--api-key", "sesame", "--dtype", "auto", "--mamba-cache-mode", "align"]
    with recap_serve(vllm_flags, tmp_path) as (url, log_path):
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0, timeout=60)
        (model,) = client.models.list().data
        reply = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "Hello!"}],
                                               max_tokens=4, temperature=0.0)
        assert reply.usage.completion_tokens >= 1 and reply.choices[0].message.role == "assistant"
        # the README's curl request, bare (no max_tokens): it stops at the default model's generation-config cap
        (curl,) = _doc_commands("README.md", "curl")
        target, body = curl[curl.index("-s") + 1], json.loads(curl[curl.index("-d") + 1])
        assert target.startswith(README_URL) and "max_tokens" not in body
        bare = httpx.post(target.replace(README_URL, url), json=body, headers={"Authorization": "Bearer sesame"},
                          timeout=60).json()
        assert 1 <= bare["usage"]["completion_tokens"] <= DEFAULT_MAX_NEW_TOKENS, bare
        assert bare["choices"][0]["finish_reason"] == (
            "length" if bare["usage"]["completion_tokens"] == DEFAULT_MAX_NEW_TOKENS else "stop")
        # the README's openai-client snippet, pointed at this server
        (snippet,) = [b for b in _fenced("README.md", "python") if "from openai import OpenAI" in b]
        for old, new in ((f'"{README_URL}/v1"', f'"{url}/v1"'), ('api_key="unused"', 'api_key="sesame"')):
            assert snippet.count(old) == 1, old
            snippet = snippet.replace(old, new)
        exec(compile(snippet, "README.md", "exec"), {})
    text = log_path.read_text()
    assert "request chatcmpl-" in text and "completion_tokens=" in text and "finish=" in text, text
    # the start-up log names the tool-call parser and the memory plan (weights, KV blocks, state slots)
    assert "tool-call parser: none (the chat template teaches no tool-call format" in text, text
    assert re.search(r"memory plan: weights [\d.]+ MiB \([\d,]+ B\)", text), text
    assert re.search(r"KV pool [\d.]+ MiB \([\d,]+ B\) in \d+ blocks of 16 tokens; state pool .* in \d+ slots", text)
    assert f"{{'max_tokens': {DEFAULT_MAX_NEW_TOKENS}}}" in text, text


README_URL = "http://127.0.0.1:8000"  # where the README's examples find `make serve`


def _fenced(doc: str, lang: str) -> list[str]:
    """The `lang` code blocks of a doc (under the repository root), each a string."""
    text = (Path(__file__).resolve().parents[2] / doc).read_text()
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _doc_commands(doc: str, program: str) -> list[list[str]]:
    """The shell commands of a doc's bash blocks that run `program`, split as the shell would."""
    lines = [line for block in _fenced(doc, "bash") for line in block.replace("\\\n", " ").splitlines()]
    return [words for words in (shlex.split(line, comments=True) for line in lines) if words and words[0] == program]


def test_readme_bench_line_names_a_real_workload_and_flags() -> None:
    from recap.bench.cli import build_parser

    (line,) = [c for c in _doc_commands("README.md", ".venv/bin/recap") if c[1] == "bench"]
    args = build_parser().parse_args(line[2:])
    assert args.toy and args.model is None  # smoke sizes on the embedded default model


def test_disaggregation_doc_commands_fit_together(tmp_path: Path) -> None:
    """docs/disaggregation.md's three commands: real flags, and each names the others' ports."""
    from recap.disagg.config import proxy_kv_api_key, transfer_config

    runs = _doc_commands("docs/disaggregation.md", ".venv/bin/recap")
    prefill, decode, proxy = (cli.build_parser().parse_args(c[1:]) for c in runs)
    assert (prefill.role, decode.role) == ("prefill", "decode")
    assert decode.kv_peer == [f"tcp://127.0.0.1:{prefill.kv_port}"] and prefill.kv_port != 0
    assert prefill.kv_secret_file == decode.kv_secret_file == proxy.kv_secret_file
    assert (proxy.prefill, proxy.decode) == ([f"http://127.0.0.1:{prefill.port}"], [f"http://127.0.0.1:{decode.port}"])
    (curl,) = _doc_commands("docs/disaggregation.md", "curl")
    assert curl[curl.index("-s") + 1].startswith(f"http://127.0.0.1:{proxy.port}/v1/")
    for args in (prefill, decode):  # each starts: the role's checks pass (the secret made under tmp_path here)
        args.kv_secret_file = tmp_path / "kv.secret"
        assert transfer_config(args).role == args.role
    # the proxy holds the credential the prefill instance asks of do_remote_decode (from the same secret)
    proxy.kv_secret_file = tmp_path / "kv.secret"
    assert proxy_kv_api_key(proxy) == transfer_config(prefill).kv_api_key


def test_make_serve_passes_flags_and_readme_points_inside_the_repo() -> None:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(["make", "-n", "-o", ".venv/.serve-installed", "serve", "ARGS=--port 8001 /models/x"],
                         cwd=root, capture_output=True, text=True, check=True).stdout
    assert ".venv/bin/recap serve --port 8001 /models/x" in out
    # serving installs torch and the runtime set only, with pip's progress shown; the test extras wait for make test
    serve_set = subprocess.run(["make", "-n", "-B", "serve"], cwd=root, capture_output=True, text=True,
                               check=True).stdout
    assert "torch==2.13.0" in serve_set and "-e ." in serve_set
    assert ".[test]" not in serve_set and " -q" not in serve_set
    test_set = subprocess.run(["make", "-n", "-B", "test"], cwd=root, capture_output=True, text=True,
                              check=True).stdout
    assert "-e '.[test]'" in test_set and "pytest" in test_set
    readme = (root / "README.md").read_text()
    assert "shared/DESIGN.md" not in readme and "docs/design.md" in readme and (root / "docs/design.md").is_file()


def test_readme_names_every_supported_architecture() -> None:
    from recap.model.models import MODEL_CLASSES

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    missing = [name for name in MODEL_CLASSES if f"`{name}`" not in readme]
    assert not missing, f"README.md does not list {missing}"


def test_design_notes_name_every_package() -> None:
    """docs/design.md §5 and docs/architecture.md lay out every package of recap/ (kept in step with the code)."""
    root = Path(__file__).resolve().parents[2]
    packages = sorted(p.parent.name for p in (root / "recap").glob("*/__init__.py"))
    for doc in ("docs/design.md", "docs/architecture.md"):
        text = (root / doc).read_text()
        missing = [name for name in packages if f"\n{name}/ " not in text]
        assert not missing, f"{doc} does not lay out {missing}"
