"""The live request routers of this process, by Serve app name.

Serve builds a deployment's request router inside each deployment handle; the ingress in the same
process reads it here to list the replicas it may address one by one (debug calls). Kept in its own
module: Serve pickles the router class by value, and it must not carry this table with it.
"""

from __future__ import annotations

from typing import Any

ROUTERS: dict[str, Any] = {}


def register(app_name: str, router: Any) -> None:
    ROUTERS[app_name] = router


def replicas_of(app_name: str) -> list[str]:
    """Ids of the replicas the router for `app_name` in this process currently knows (empty: none yet)."""
    router = ROUTERS.get(app_name)
    return [] if router is None else sorted(rid.unique_id for rid in router.curr_replicas)
