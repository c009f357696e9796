"""The HTTP API the replicas serve, as the cluster sees it: built over each replica's engine, read by the
ingress for routing. recap.cluster imports no app: recap.launch.settings.ServerSettings (the OpenAI app) is what
`recap serve --replicas` passes, so that this package depends on the toolkit (recap.http) only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from prometheus_client.registry import Collector
from starlette.types import ASGIApp

from recap.disagg.config import KVTransferConfig
from recap.engine.async_engine import AsyncEngine
from recap.http.limits import ServerLimits


class ReplicaAPI(Protocol):
    """Picklable: it travels to every replica and ingress in their deployment arguments."""

    @property
    def limits(self) -> ServerLimits: ...

    def build(self, engine: AsyncEngine, collectors: Sequence[Collector], transfer: KVTransferConfig,
              replica: str | None = None) -> ASGIApp:
        """The replica's app over `engine` (which the replica owns: the app's lifespan must not stop it).
        `replica`: its Serve replica id, which the ids of its stored responses carry (recap.http.response_ids)."""
        ...

    def prompt_tokens(self, tokenizer: Any, path: str, body: bytes) -> tuple[list[int], str | None]:
        """A request's first prompt as the replicas will tokenize it, and its cache salt; ([], None) when
        the body is unreadable (the replica then answers with the proper 4xx)."""
        ...
