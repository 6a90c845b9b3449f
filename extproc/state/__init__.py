"""Shared state across replicas: one protocol (``SharedState``), in-process or through Redis."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from extproc.config import Config
from extproc.state.base import LocalRouteTable, LocalState, PodLoad, RouteTable, SharedState


def make_state(config: Config, metrics: CollectorRegistry | None = None) -> SharedState:
    """Redis-shared state when ``redis.url`` is set (its metrics registered on ``metrics``), else local."""
    if not config.redis.enabled:
        return LocalState()
    from extproc.state.redis_state import RedisCollector, RedisState

    state = RedisState(config.redis)
    if metrics is not None:
        metrics.register(RedisCollector(state))
    return state


__all__ = ["LocalRouteTable", "LocalState", "PodLoad", "RouteTable", "SharedState", "make_state"]
