"""Tiny checkpoints with a tokenizer for the cluster tests (a hybrid and an SSM-only model), and one local
Ray cluster with Serve for the test modules that deploy apps on it (its start is most of their time)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.conftest import tiny_model_dir

# Serve's proxy health check (10 s, 3 misses) failed on the shared 2-core test machine at load 24: the
# cluster's processes inherit these from the driver's environment (Ray reads them; recap does not).
SLOW_MACHINE_ENV = {"RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cluster-tiny")
    return {a: tiny_model_dir(root, a) for a in ("bamba", "mamba2")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="package")
def serve_url() -> Iterator[str]:
    """A local Ray cluster (loopback, 4 CPUs) running Serve's HTTP proxy, for the tests of this package only
    (stopped after its last test, not held through the rest of the suite); modules deploy and delete apps."""
    ray = pytest.importorskip("ray")
    from ray import serve

    from recap.cluster.deploy import LocalClusterConfig, init_ray

    with pytest.MonkeyPatch.context() as mp:
        for key, value in SLOW_MACHINE_ENV.items():
            mp.setenv(key, value)
        init_ray(None, LocalClusterConfig(num_cpus=4, object_store_bytes=200 << 20))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
