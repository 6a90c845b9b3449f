"""What the pods themselves say: vLLM /metrics (load) and KV events (the precise cache index).

``LiveView`` owns the background tasks (one metrics poller per pod, one ZMQ subscriber per pod),
copies the latest gauges into each ``EndpointState`` just before a decision, and exports its own
counters to Prometheus when scraped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import zmq.asyncio
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.config import Config, EndpointConfig, parse_address
from extproc.endpoints.metrics import MetricsScraper
from extproc.endpoints.pool import EndpointState
from extproc.index.precise import PreciseIndex
from extproc.kvevents.subscriber import KVEventSubscriber

log = logging.getLogger("kvroute.live")


def _zmq_address(explicit: str | None, ec: EndpointConfig, port: int | None) -> str | None:
    if explicit:
        return explicit
    if port is None:
        return None
    host, _ = parse_address(ec.address)
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class LiveView:
    def __init__(self, config: Config) -> None:
        self.config = config
        self._endpoints = [ec for p in config.pools.values() for ec in p.endpoints]
        kv = config.kv_events
        self.precise: PreciseIndex | None = (
            PreciseIndex(kv.capacity_blocks, speculative_ttl_s=kv.speculative_ttl_s) if kv.enabled else None
        )
        sc = config.scrape
        self.scraper: MetricsScraper | None = (
            MetricsScraper(
                [ec.address for ec in self._endpoints],
                interval_s=sc.interval_s,
                timeout_s=sc.timeout_s,
                stale_after_misses=sc.stale_after_misses,
                max_age_s=sc.max_age_s,
            )
            if sc.enabled
            else None
        )
        self.subscribers: list[KVEventSubscriber] = []
        self._ctx: zmq.asyncio.Context | None = None

    async def start(self) -> None:
        if self.scraper is not None:
            await self.scraper.start()
        if self.precise is None:
            return
        self._ctx = zmq.asyncio.Context()
        kv = self.config.kv_events
        for ec in self._endpoints:
            pub = _zmq_address(ec.kv_events, ec, kv.port)
            if pub is None:
                continue
            sub = KVEventSubscriber(
                ec.address,
                self.precise,
                pub_address=pub,
                replay_address=_zmq_address(ec.kv_replay, ec, kv.replay_port),
                topic=kv.topic.encode(),
                ctx=self._ctx,
            )
            await sub.start()
            self.subscribers.append(sub)
        log.info("kv events subscribed", extra={"fields": {"pods": [s.pub_address for s in self.subscribers]}})

    async def aclose(self) -> None:
        for sub in self.subscribers:
            await sub.aclose()
        self.subscribers.clear()
        if self.scraper is not None:
            await self.scraper.aclose()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def refresh(self, endpoints: Iterable[EndpointState]) -> None:
        """Copy the latest scraped gauges into the endpoints' state; a stale pod is unhealthy."""
        if self.scraper is None:
            return
        for e in endpoints:
            st = self.scraper.state(e.address)
            if st is None:
                continue
            m = None if st.stale else st.metrics
            e.healthy = not st.stale
            e.queue = m.num_requests_waiting if m else None
            e.running = m.num_requests_running if m else None
            e.kv_usage = m.kv_cache_usage_perc if m else None

    def block_size(self, endpoints: Iterable[EndpointState]) -> int | None:
        """The pods' KV block size, as their events or their cache_config_info report it."""
        for e in endpoints:
            if self.precise is not None and e.address in self.precise.block_size_of:
                return self.precise.block_size_of[e.address]
            m = self.scraper.get(e.address) if self.scraper is not None else None
            if m is not None and m.block_size:
                return m.block_size
        return None


class LiveCollector(Collector):
    """Exports the subscribers', index's and scraper's counters at Prometheus scrape time."""

    def __init__(self, live: LiveView) -> None:
        self.live = live

    def collect(self) -> Iterator[GaugeMetricFamily]:
        live = self.live
        if live.precise is not None:
            g = GaugeMetricFamily("kvroute_precise_index", "Precise index counters and occupancy", labels=["stat"])
            for k, v in live.precise.stats().items():
                g.add_metric([k], v)
            yield g
            ev = GaugeMetricFamily("kvroute_kv_events", "KV-event subscriber counters", labels=["endpoint", "stat"])
            for sub in live.subscribers:
                for k, v in sub.stats().items():
                    ev.add_metric([sub.endpoint, k], v)
            yield ev
        if live.scraper is not None:
            sc = GaugeMetricFamily("kvroute_scrape", "vLLM /metrics scraper counters", labels=["stat"])
            for k, v in live.scraper.stats().items():
                sc.add_metric([k], v)
            yield sc
