"""What the pods themselves say: vLLM /metrics (load) and KV events (the precise cache index).

``LiveView`` owns the background tasks (one metrics poller per pod, one ZMQ subscriber per pod),
follows the registry's changes (a new pod is scraped and subscribed, a removed or restarted one is
purged and, if still there, subscribed anew), copies the latest gauges into each ``EndpointState``
just before a decision, and exports its own counters to Prometheus when scraped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping

import zmq.asyncio
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.config import Config, EndpointConfig, parse_address
from extproc.discovery import Provider
from extproc.endpoints.events import KVEventSubscriber, KVIntake
from extproc.endpoints.metrics import MetricsScraper
from extproc.endpoints.pool import Change, EndpointState, Registry
from extproc.endpoints.tls import PodTLS
from extproc.index.base import EndpointId
from extproc.index.precise import PreciseIndex

log = logging.getLogger("kvroute.live")


def _zmq_address(explicit: str | None, ec: EndpointConfig, port: int | None) -> str | None:
    if explicit:
        return explicit
    if port is None:
        return None
    host, _ = parse_address(ec.address)
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class LiveView:
    def __init__(self, config: Config, tls: PodTLS | None = None) -> None:
        self.config = config
        self.tls = tls or PodTLS(config.pods.tls)
        kv = config.kv_events
        self.precise: PreciseIndex | None = (
            PreciseIndex(kv.capacity_blocks, speculative_ttl_s=kv.speculative_ttl_s) if kv.enabled else None
        )
        self._metrics_at: dict[EndpointId, str] = {}  # endpoint -> the URL of its /metrics
        sc = config.scrape
        self.scraper: MetricsScraper | None = (
            MetricsScraper(
                interval_s=sc.interval_s,
                timeout_s=sc.timeout_s,
                stale_after_misses=sc.stale_after_misses,
                max_age_s=sc.max_age_s,
                url_for=lambda ep: self._metrics_at.get(ep, f"http://{ep}/metrics"),
                tls=self.tls,
                purge_after_refusals=sc.purge_after_refusals,
                on_down=self._pod_down,
            )
            if sc.enabled
            else None
        )
        self.subscribers: dict[EndpointId, KVEventSubscriber] = {}
        self._ctx: zmq.asyncio.Context | None = zmq.asyncio.Context() if self.precise is not None else None
        # One wake-up for every pod's batches (events.py, KVIntake), not one per batch per pod.
        self.intake = KVIntake(config.kv_events.batch_window_s) if self.precise is not None else None
        self._closing: set[asyncio.Task[None]] = set()
        # Told when a pod refuses its scrapes (died): the router purges its routing history there.
        self._down_listeners: list[Callable[[EndpointId], None]] = []

    async def start(self, endpoints: Iterable[EndpointConfig]) -> None:
        """Follow the ``endpoints`` known before start; later ones arrive through ``on_change``."""
        for ec in endpoints:
            self._follow(ec)
        if self.scraper is not None:
            self.scraper.set_endpoints(self._metrics_at)
            await self.scraper.start()

    def on_change(self, change: Change) -> None:
        """A registry listener: runs synchronously in ``Registry.apply``, so the next decision
        already sees a removed or restarted pod's index entries gone."""
        for addr in change.removed:
            self._metrics_at.pop(addr, None)
            self._unsubscribe(addr)
            if self.precise is not None:
                self.precise.remove_endpoint(addr)
        for ec in change.restarted:
            self._unsubscribe(ec.address)
            if self.precise is not None:
                self.precise.remove_endpoint(ec.address)
            if self.scraper is not None:
                self.scraper.set_endpoints(a for a in self._metrics_at if a != ec.address)  # forget its gauges
            self._follow(ec)
        for ec in change.added:
            self._follow(ec)
        if self.scraper is not None and (change.added or change.removed or change.restarted):
            self.scraper.set_endpoints(self._metrics_at)
            self.scraper.mark_changed(ec.address for ec in (*change.added, *change.restarted))

    def subscribe_down(self, listener: Callable[[EndpointId], None]) -> None:
        self._down_listeners.append(listener)

    def _pod_down(self, addr: EndpointId) -> None:
        """The pod's scrapes were refused (``scrape.purge_after_refusals`` in a row): its cache died with
        it. Its precise entries go now; its KV events, if it comes back, start a new stream (seq 0)."""
        if self.precise is not None:
            self.precise.remove_endpoint(addr)
        for listener in self._down_listeners:
            listener(addr)

    def _follow(self, ec: EndpointConfig) -> None:
        """Scrape and subscribe to a new (or restarted) pod."""
        self._metrics_at[ec.address] = f"{self.tls.scheme(ec)}://{ec.metrics or ec.address}/metrics"
        if self.precise is None or self._ctx is None:
            return
        kv = self.config.kv_events
        pub = _zmq_address(ec.kv_events, ec, kv.port)
        if pub is None:
            return
        sub = KVEventSubscriber(
            ec.address,
            self.precise,
            pub_address=pub,
            replay_address=_zmq_address(ec.kv_replay, ec, kv.replay_port),
            topic=kv.topic.encode(),
            ctx=self._ctx,
            intake=self.intake,
        )
        sub.connect()
        self.subscribers[ec.address] = sub
        log.info("kv events subscribed", extra={"fields": {"endpoint": ec.address, "pub": pub}})

    def _unsubscribe(self, addr: EndpointId) -> None:
        sub = self.subscribers.pop(addr, None)
        if sub is None:
            return
        sub.cancel()  # no event of the old pod is applied after its purge
        task = asyncio.get_running_loop().create_task(sub.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        subs = list(self.subscribers.values())
        self.subscribers.clear()
        for sub in subs:
            await sub.aclose()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        if self.intake is not None:
            await self.intake.aclose()
        if self.scraper is not None:
            await self.scraper.aclose()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def refresh(self, by_address: Mapping[EndpointId, EndpointState]) -> None:
        """Copy the latest scraped gauges into the endpoints' state; a stale pod is unhealthy. Only the
        pods whose scrape state changed since the last call (``MetricsScraper.take_changed``), so a
        decision's cost does not grow with the fleet."""
        if self.scraper is None:
            return
        for addr in self.scraper.take_changed():
            e = by_address.get(addr)
            st = self.scraper.state(addr)
            if e is None or st is None:  # not in the registry (yet: its addition marks it again) or gone
                continue
            m = None if st.stale else st.metrics
            e.healthy = not st.stale
            e.down = st.down
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
            for sub in list(live.subscribers.values()):
                for k, v in sub.stats().items():
                    ev.add_metric([sub.endpoint, k], v)
            yield ev
        if live.scraper is not None:
            sc = GaugeMetricFamily("kvroute_scrape", "vLLM /metrics scraper counters", labels=["stat"])
            for k, v in live.scraper.stats().items():
                sc.add_metric([k], v)
            yield sc


class RegistryCollector(Collector):
    """Endpoints per pool and state, and the discovery provider's own counters (API reachable,
    relists, watch restarts...), at Prometheus scrape time."""

    def __init__(self, registry: Registry, provider: Provider) -> None:
        self.registry = registry
        self.provider = provider

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily("kvroute_endpoints", "Endpoints per pool and state", labels=["pool", "state"])
        for pool in list(self.registry.pools.values()):
            counts = dict.fromkeys(("ready", "draining", "unhealthy"), 0)
            for e in pool.endpoints:
                counts["draining" if e.draining else "ready" if e.healthy else "unhealthy"] += 1
            for state, n in counts.items():
                g.add_metric([pool.name, state], n)
        yield g
        d = GaugeMetricFamily("kvroute_discovery", "Discovery provider counters", labels=["provider", "stat"])
        d.add_metric([self.provider.name, "endpoint_set_changes"], self.registry.changes)
        for k, v in self.provider.stats().items():
            d.add_metric([self.provider.name, k], v)
        yield d


class IndexCollector(Collector):
    """Blocks the approximate index remembers per endpoint."""

    def __init__(self, counts: Callable[[], dict[EndpointId, int]]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily("kvroute_index_blocks", "Prefix blocks the approximate index holds", labels=["endpoint"])
        for addr, n in self.counts().items():
            g.add_metric([addr], n)
        yield g
