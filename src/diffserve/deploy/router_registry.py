"""The request routers of this process, by deployment: how the ingress reads its handles' view of the
replicas (router.py).

Ray Serve keeps one router per deployment handle, in the process that uses the handle, and ships the
router's module to that process by value (a copy of the module, not an import): the registry is kept
here, in a module imported as usual, so the router registers where the ingress looks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ReplicaView:
    """One running replica as a router sees it: Ray Serve's id, its node, and its last report."""

    replica_id: str
    node_id: str
    stats: dict[str, Any]


class ReplicaLister(Protocol):
    def replicas(self) -> list[ReplicaView]: ...


_routers: dict[str, ReplicaLister] = {}
_lock = threading.Lock()


def register(deployment: str, router: ReplicaLister) -> None:
    """`router` routes this process's calls to `deployment` (the latest one made wins)."""
    with _lock:
        _routers[deployment] = router


def router_for(deployment: str) -> ReplicaLister | None:
    """The router of this process's handle to `deployment` (None before the handle routed anything)."""
    with _lock:
        return _routers.get(deployment)
