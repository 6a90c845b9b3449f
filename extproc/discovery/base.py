"""The provider interface, the errors providers raise and the factory that picks one from the config."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from extproc.config import EndpointConfig
from extproc.errors import KVRouteError

Publish = Callable[[str, Sequence[EndpointConfig]], object]
"""``publish(pool, endpoints)``: the pool's endpoints are now exactly these (ready or draining)."""


class DiscoveryError(KVRouteError):
    """Discovery cannot start: the message says what is missing (a file, a permission, the API server)."""


class Provider(Protocol):
    name: str

    async def start(self, publish: Publish) -> None:
        """Publish the first endpoint sets, then keep them current in the background. Raises
        DiscoveryError when discovery cannot work at all (no such file, RBAC forbids the watch)."""
        ...

    async def aclose(self) -> None:
        """Stop watching; the last published sets stay in effect."""
        ...

    def stats(self) -> dict[str, float]:
        """Counters and gauges for /metrics (kvroute_discovery{provider,stat})."""
        ...
