"""Shared state across replicas: one protocol (``SharedState``), in-process, through Redis, or
(``kvroute serve --workers N`` without Redis) through the supervisor's relay."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry

from extproc.config import Config
from extproc.state.base import LocalRouteTable, LocalState, PodLoad, RouteTable, SharedState


def make_state(config: Config, metrics: CollectorRegistry | None = None) -> SharedState:
    """Redis-shared state when ``redis.url`` is set, relayed state in a worker of ``--workers N``
    without Redis (its metrics registered on ``metrics``), else local."""
    from extproc.state.relay import RELAY_ENV

    relay = os.environ.get(RELAY_ENV)
    if not config.redis.enabled and not relay:
        return LocalState()
    from extproc.state.replicated import ReplicatedState, StateCollector

    state: ReplicatedState
    if config.redis.enabled:
        from extproc.state.redis_state import RedisState

        state = RedisState(config.redis)
    else:
        from extproc.state.relay import RelayState

        assert relay is not None
        state = RelayState(config.redis, relay)
    if metrics is not None:
        metrics.register(StateCollector(state))
    return state


__all__ = ["LocalRouteTable", "LocalState", "PodLoad", "RouteTable", "SharedState", "make_state"]
