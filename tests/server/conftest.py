"""A real server (uvicorn on a free loopback port, in a thread) over a tiny Bamba-style checkpoint."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from recap.config import CacheConfig, SchedulerConfig
from recap.engine.async_engine import AsyncEngine
from recap.engine.config import EngineConfig
from recap.engine.llm_engine import LLMEngine
from recap.http.limits import ServerLimits
from recap.server.app import build_app
from recap.server.options import ServerOptions

MODEL_NAME = "tiny-bamba"
MAX_MODEL_LEN = 1024
TEST_LIMITS = ServerLimits(enable_debug=True)  # tests read /debug/integrity


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, app: Any, **config: Any) -> None:
        """`config`: more uvicorn.Config arguments (e.g. `http=` for recap.http.timeouts)."""
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        cfg = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5, **config)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def tiny_bamba_dir(root: Path) -> Path:
    """A tiny random Bamba (attention + Mamba2) with the default model's tokenizer and chat template."""
    from recap.model import default_model
    from recap.model.testing import make_tiny_checkpoint
    from tests.tiny_tokenizer import save_tiny_tokenizer

    path = make_tiny_checkpoint("bamba", root / "bamba", vocab_size=default_model.VOCAB_SIZE)
    save_tiny_tokenizer(path, default_model.SEED)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_bamba_dir(tmp_path_factory.mktemp("server-model"))


def engine_config(model: Path, **cache: Any) -> EngineConfig:
    return EngineConfig(
        model=str(model), served_model_name=MODEL_NAME, check_integrity=True,
        cache=CacheConfig(**cache),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=MAX_MODEL_LEN),
    )


@pytest.fixture(scope="session")
def server(tiny_model: Path) -> Iterator[ServerThread]:
    srv = ServerThread(build_app(AsyncEngine(LLMEngine(engine_config(tiny_model))), limits=TEST_LIMITS))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hermes_client(tiny_model: Path) -> Iterator[openai.OpenAI]:
    """A server whose tool_choice auto reads Hermes-style calls (--tool-call-parser hermes)."""
    engine = AsyncEngine(LLMEngine(engine_config(tiny_model)))
    srv = ServerThread(build_app(engine, options=ServerOptions(tool_call_parser="hermes")))
    srv.start()
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    srv.stop()


@pytest.fixture()
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture()
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def wait_idle(http: httpx.Client, timeout: float = 20.0) -> dict[str, Any]:
    """Poll /debug/integrity until nothing runs, waits or awaits its last output; returns the last report."""
    deadline = time.monotonic() + timeout
    while True:
        report = http.get("/debug/integrity").json()
        if report["num_running"] == report["num_waiting"] == report["pools"]["num_unfinished_outputs"] == 0:
            return report
        if time.monotonic() > deadline:
            raise AssertionError(f"requests still running after {timeout}s: {report}")
        time.sleep(0.05)


def metric(http: httpx.Client, name: str) -> float:
    """The value of one sample of /metrics (the model_name label is the only one)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)
