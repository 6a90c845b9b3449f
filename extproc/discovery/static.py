"""The config's own pools: published once at start, never changed."""

from __future__ import annotations

from extproc.config import Config
from extproc.discovery.base import Publish


class StaticProvider:
    name = "static"

    def __init__(self, config: Config) -> None:
        self._pools = {name: list(pc.endpoints) for name, pc in config.pools.items()}

    async def start(self, publish: Publish) -> None:
        for name, endpoints in self._pools.items():
            publish(name, endpoints)

    async def aclose(self) -> None:
        return None

    def stats(self) -> dict[str, float]:
        return {}
