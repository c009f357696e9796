"""`recap serve --replicas N` flags: parsed, validated before any cluster starts."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from recap import cli


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_replica_flags_parse() -> None:
    args = cli.build_parser().parse_args(["serve", "m", "--replicas", "3", "--ray-address", "auto", "--routing",
                                          "round_robin", "--cpus-per-replica", "0.5", "--queued-request-tokens", "64"])
    assert (args.replicas, args.ray_address, args.routing, args.cpus_per_replica, args.queued_request_tokens) == (
        3, "auto", "round_robin", 0.5, 64)
    plain = cli.build_parser().parse_args(["serve"])
    assert plain.replicas is None and plain.ray_address is None and plain.routing == "checkpoint"
    assert plain.prefill_replicas is None and plain.decode_replicas is None
    pd = cli.build_parser().parse_args(["serve", "m", "--prefill-replicas", "2", "--decode-replicas", "3"])
    assert (pd.prefill_replicas, pd.decode_replicas, pd.replicas) == (2, 3, None)


@pytest.mark.parametrize(("extra", "message"), [
    (["--replicas", "0"], "replicas must be >= 1"),
    (["--replicas", "2", "--cpus-per-replica", "0"], "cpus_per_replica must be positive"),
    (["--replicas", "2", "--role", "prefill"], "--role prefill/decode is not supported"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--role", "decode"], "--role prefill/decode is not"),
    (["--prefill-replicas", "2"], "--prefill-replicas and --decode-replicas go together"),
    (["--decode-replicas", "2"], "--prefill-replicas and --decode-replicas go together"),
    (["--replicas", "2", "--prefill-replicas", "1", "--decode-replicas", "1"], "not both"),
    (["--prefill-replicas", "0", "--decode-replicas", "1"], "prefill and decode replicas must be >= 1"),
])
def test_bad_replica_flags_exit_2(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "some/model", *extra]) == 2
    assert message in capsys.readouterr().err


def test_bad_routing_policy_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--replicas", "2", "--routing", "random"])
    assert "--routing" in capsys.readouterr().err


@pytest.mark.slow
def test_recap_serve_replicas_end_to_end(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """`recap serve MODEL --replicas 2` starts a local Ray cluster, serves the OpenAI API, stops on SIGINT."""
    port = _free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "recap.cli", "serve", str(tiny_models["bamba"]), "--port",
                                 str(port), "--replicas", "2", "--num-threads", "1", "--served-model-name", "m",
                                 "--enable-debug-endpoints"],
                                stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        # /health answers once the ingress is up, which can be before the second replica is: wait for both.
        while len(httpx.get(f"{url}/debug/integrity", timeout=60).json()["replicas"]) < 2:
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["m"]
        replicas = set()
        for i in range(4):
            raw = client.completions.with_raw_response.create(model="m", prompt=f"Session {i} says hello",
                                                              max_tokens=3, temperature=0.0)
            assert raw.parse().usage.completion_tokens == 3
            replicas.add(raw.headers["x-recap-replica"])
        assert len(replicas) == 2  # new sessions spread over both replicas
        report = httpx.get(f"{url}/debug/integrity", timeout=60).json()  # on: --enable-debug-endpoints
        assert report["ok"] and sorted(report["replicas"]) == sorted(replicas), report
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    assert rc in (0, -signal.SIGINT, 130), log_path.read_text()[-3000:]
