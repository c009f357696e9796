"""What `recap serve` applies to its HTTP app, and the wiring of the OpenAI app over an engine of any role:
one process (recap.launch.serve) or every Ray replica (recap.cluster.api.ReplicaAPI)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from prometheus_client.registry import Collector

from recap.disagg.api import attach_transfer
from recap.disagg.config import KVTransferConfig
from recap.engine.async_engine import AsyncEngine
from recap.http.limits import ServerLimits
from recap.server import routing_prompt
from recap.server.app import build_app
from recap.server.options import ServerOptions
from recap.server.transfer_params import TransferHook


def transfer_hook(transfer: KVTransferConfig) -> TransferHook | None:
    """How the OpenAI app reads kv_transfer_params for this role (None: a single instance refuses it)."""
    return None if transfer.role == "both" else attach_transfer


@dataclass(frozen=True)
class ServerSettings:
    """Limits, --api-key and CORS of the OpenAI app; carried to every replica, where it builds the app."""

    limits: ServerLimits = field(default_factory=ServerLimits)
    api_key: str | None = None
    options: ServerOptions = field(default_factory=ServerOptions)

    def build(self, engine: AsyncEngine, collectors: Sequence[Collector], transfer: KVTransferConfig,
              replica: str | None = None, shutdown_engine: bool = False) -> FastAPI:
        """The OpenAI app over `engine`; by default its lifespan leaves the engine running (a replica owns it)."""
        return build_app(engine, shutdown_engine=shutdown_engine, collectors=collectors, options=self.options,
                         limits=self.limits, api_key=self.api_key, kv_transfer=transfer_hook(transfer),
                         replica=replica)

    def prompt_tokens(self, tokenizer: Any, path: str, body: bytes) -> tuple[list[int], str | None]:
        return routing_prompt.prompt_tokens(tokenizer, path, body)
