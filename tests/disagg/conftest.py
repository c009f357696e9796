"""`recap serve --role ...` and `recap proxy` as real processes on loopback ports, over a tiny Bamba model."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from recap.disagg.engine import DisaggLLMEngine
from recap.disagg.trust import derive_api_key, parse_secret
from recap.engine.config import EngineConfig
from recap.http.wire import KV_API_KEY_HEADER
from tests.server.conftest import engine_config, tiny_bamba_dir

MODEL_NAME = "tiny-bamba"
SERVE_FLAGS = ("--served-model-name", MODEL_NAME, "--max-model-len", "1024", "--max-num-seqs", "16",
               "--max-num-batched-tokens", "256", "--num-threads", "1", "--check-integrity", "--log-level", "warning",
               "--enable-debug-endpoints")
START_TIMEOUT_S = 240.0  # a loaded 2-core CI box took over 90 s to start one (ray workers beside it)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Instance:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not start:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


def launch(name: str, argv: list[str], logs: Path) -> Instance:
    port = free_port()
    log = logs / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "recap.cli", *argv, "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT)
    return Instance(name, proc, port, log)


@dataclass
class Cluster:
    single: Instance  # role both: the reference
    prefill: Instance
    decode: Instance
    proxy: Instance
    slow_prefill: Instance  # --kv-send-delay: for the failure test (killed there)
    slow_proxy: Instance  # slow_prefill + decode
    trust: list[str]  # the deployment's secret flags, for instances a test adds
    kv_prefill: str  # the prefill instance's transfer address (a decode instance's --kv-peer)

    @property
    def kv_api_key(self) -> str:
        """What the proxy sends prefill instances with do_remote_decode (derived from the secret file)."""
        return derive_api_key(parse_secret(Path(self.trust[1]).read_text()))

    @property
    def kv_headers(self) -> dict[str, str]:
        return {KV_API_KEY_HEADER: self.kv_api_key}


@pytest.fixture(scope="session")
def disagg_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_bamba_dir(tmp_path_factory.mktemp("disagg-model"))


@pytest.fixture(scope="module")
def config(disagg_model: Path) -> EngineConfig:
    """In-process engines over the disaggregation model (tests without HTTP)."""
    return engine_config(disagg_model)


@pytest.fixture()
def engines(config: EngineConfig) -> Iterator[list[DisaggLLMEngine]]:
    """Disaggregated engines a test makes (recap.disagg.engine), closed after it."""
    made: list[DisaggLLMEngine] = []
    yield made
    for e in made:
        e.close()


@pytest.fixture(scope="session")
def cluster(disagg_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("disagg-logs")
    model = str(disagg_model)
    serve = ["serve", model, *SERVE_FLAGS]
    trust = ["--kv-secret-file", str(logs / "kv.secret")]  # created by the first instance that starts
    kv_prefill, kv_slow = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    single = launch("single", serve, logs)
    prefill = launch("prefill", [*serve, "--role", "prefill", *trust, "--kv-port", kv_prefill.rsplit(":", 1)[1]],
                     logs)
    decode = launch("decode", [*serve, "--role", "decode", "--kv-transfer-timeout", "20", *trust,
                               "--kv-peer", kv_prefill, "--kv-peer", kv_slow], logs)
    slow = launch("slow-prefill", [*serve, "--role", "prefill", "--kv-send-delay", "5", *trust,
                                   "--kv-port", kv_slow.rsplit(":", 1)[1]], logs)
    instances = [single, prefill, decode, slow]
    try:
        quiet = ["--log-level", "warning"]
        proxy = launch("proxy", ["proxy", "--prefill", prefill.url, "--decode", decode.url, *trust, *quiet], logs)
        instances.append(proxy)
        slow_proxy = launch("slow-proxy", ["proxy", "--prefill", slow.url, "--decode", decode.url, *trust, *quiet],
                            logs)
        instances.append(slow_proxy)
        deadline = time.monotonic() + START_TIMEOUT_S
        for inst in instances:
            inst.wait_ready(deadline)
        yield Cluster(single, prefill, decode, proxy, slow, slow_proxy, trust, kv_prefill)
    finally:
        for inst in instances:
            inst.stop()


def metric(url: str, name: str) -> float:
    """The value of one sample of an instance's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise KeyError(name)


def wait_idle(url: str, timeout: float = 30.0, held: bool = True) -> dict:
    """Poll /debug/integrity until nothing runs, waits or is held; returns the last report."""
    deadline = time.monotonic() + timeout
    while True:
        report = httpx.get(f"{url}/debug/integrity", timeout=30).json()
        pools = report["pools"]
        busy = report["num_running"] + report["num_waiting"] + pools["num_unfinished_outputs"]
        if held:
            busy += pools["kv_blocks_in_use"] + pools["state_slots_in_use"]
        if busy == 0:
            return report
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} still busy after {timeout}s: {report}")
        time.sleep(0.05)
