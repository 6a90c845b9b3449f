"""Endpoints and pools: static membership from config plus live load (kvroute's own in-flight
counts, and the pod's own gauges once a metrics scraper feeds them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.config import Config, EndpointConfig, Role
from extproc.index.base import EndpointId


@dataclass(slots=True)
class EndpointState:
    address: EndpointId
    role: Role
    cluster: str
    pool: str
    inflight: int = 0
    # Filled by the metrics scraper when configured; None = unknown (scorers then ignore them).
    queue: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    healthy: bool = True

    def serves(self, role: Role) -> bool:
        return self.role == "both" or self.role == role


@dataclass(slots=True)
class Pool:
    name: str
    cluster: str | None
    endpoints: list[EndpointState] = field(default_factory=list)


class Registry:
    """All pools and endpoints; the single owner of in-flight counts."""

    def __init__(self, config: Config) -> None:
        self.pools: dict[str, Pool] = {}
        self.by_address: dict[EndpointId, EndpointState] = {}
        for name, pc in config.pools.items():
            pool = Pool(name=name, cluster=pc.cluster)
            for ec in pc.endpoints:
                st = self._state(ec, name)
                pool.endpoints.append(st)
                self.by_address[st.address] = st
            self.pools[name] = pool

    @staticmethod
    def _state(ec: EndpointConfig, pool: str) -> EndpointState:
        return EndpointState(address=ec.address, role=ec.role, cluster=ec.cluster_name, pool=pool)

    def acquire(self, address: EndpointId) -> None:
        st = self.by_address.get(address)
        if st is not None:
            st.inflight += 1

    def release(self, address: EndpointId) -> None:
        st = self.by_address.get(address)
        if st is not None and st.inflight > 0:
            st.inflight -= 1
