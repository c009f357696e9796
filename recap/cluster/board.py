"""The live request routers of this process, by Serve app name.

Serve builds a deployment's request router inside each deployment handle; the ingress in the same
process reads it here (by app and deployment name) to list the replicas it may address one by one
(debug calls). Kept in its own module: Serve pickles the router class by value, and it must not carry
this table with it.
"""

from __future__ import annotations

from typing import Any

ROUTERS: dict[tuple[str, str], Any] = {}


def register(app_name: str, deployment: str, router: Any) -> None:
    ROUTERS[(app_name, deployment)] = router


def replicas_of(app_name: str, deployment: str) -> list[str]:
    """Ids of the replicas of that deployment the router in this process currently knows (empty: none yet)."""
    router = ROUTERS.get((app_name, deployment))
    return [] if router is None else sorted(rid.unique_id for rid in router.curr_replicas)
