"""What kvroute replicas share, as one small protocol the router and scheduler use.

Four things are shared: the prefix indexes' records (which pod was sent which prefix blocks, and in
precise mode the blocks a pod is expected to hold before its events say so), route-id pins, and
each pod's load: requests in flight and the estimated prefill queue. Matches, pin look-ups and load
reads are always local reads: ``LocalState`` keeps everything in this process (one replica), and
``RedisState`` keeps the same local state as its read path while it exchanges changes with the
other replicas through Redis in the background.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from extproc.index.base import EndpointId, PrefixIndex
from extproc.lru import ShardedLRU


class RouteTable(Protocol):
    """Route-id pins: a conversation's route key → the pod it was sent to (bounded, least recently used out)."""

    def get(self, key: int) -> EndpointId | None:
        """The pinned pod (a hit counts as use), or None."""
        ...

    def put(self, key: int, endpoint: EndpointId) -> None: ...

    def forget_endpoint(self, endpoint: EndpointId) -> None:
        """Drop every pin to ``endpoint`` (removed or restarted: its cache is gone)."""
        ...


class PodLoad(Protocol):
    """What shared state reads and writes on a pod (``EndpointState`` implements it)."""

    def own_load(self, now: float) -> tuple[int, float, float]:
        """This replica's requests in flight there, seconds of prefill it queued there (at ``now``,
        ``time.monotonic()``) and seconds of its prefill run there so far (a running total: a queue
        that only ran since it was reported is what the peers already count down)."""
        ...

    def set_peer_load(self, replica: str, inflight: int, prefill_s: float, now: float) -> None:
        """Peer ``replica``'s requests in flight there and its queued prefill seconds, as of ``now``
        (0, 0.0: none, or the peer is gone)."""
        ...


# A scraper's ``offer``: (pod, figures of one scrape, their age in seconds) -> taken.
ScrapeOffer = Callable[[EndpointId, Sequence[Any], float], bool]


class ScrapeShare(Protocol):
    """Scrapes split among replicas (``MetricsScraper.share``)."""

    def owns(self, endpoint: EndpointId) -> bool:
        """Whether this replica scrapes ``endpoint`` (the others take its figures)."""
        ...

    def publish(self, endpoint: EndpointId, figures: Sequence[Any]) -> None:
        """Hand the figures of a successful scrape to the other replicas."""
        ...


class SharedState(Protocol):
    kind: str  # "local", "redis" or "relay"

    def share_index(self, name: str, index: PrefixIndex) -> PrefixIndex:
        """``index`` as the router should use it: matches read it, records (and purges) reach the peers'
        index of the same ``name`` (``approx``, ``precise``)."""
        ...

    def route_table(self, capacity: int) -> RouteTable:
        """The route-id pins, shared."""
        ...

    def bind_pods(self, pods: Mapping[EndpointId, PodLoad]) -> None:
        """The pods whose load is shared (a live mapping: pods come and go with discovery)."""
        ...

    def share_scrapes(self, offer: ScrapeOffer) -> ScrapeShare | None:
        """Split the pods' /metrics scraping with the other replicas: each pod scraped by one, its
        figures passed to the others' ``offer``. None: this replica scrapes every pod."""
        ...

    def peers(self) -> int:
        """Other replicas deciding beside this one now (heard from within ``peer_timeout_s``)."""
        ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...


class LocalRouteTable:
    """The in-process pins: an LRU map of at most ``capacity`` entries (``ShardedLRU``: one OrderedDict of
    100,000 pins, the default, held the event loop 8-10 ms each time it rebuilt its table)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._routes: ShardedLRU[int, EndpointId] = ShardedLRU(capacity)

    def get(self, key: int) -> EndpointId | None:
        return self._routes.get(key)

    def put(self, key: int, endpoint: EndpointId) -> None:
        self._routes.put(key, endpoint)

    def forget_endpoint(self, endpoint: EndpointId) -> None:
        for k in [k for k, a in self._routes.items() if a == endpoint]:
            self._routes.pop(k)

    def __len__(self) -> int:
        return len(self._routes)


class LocalState:
    """One replica on its own: today's in-process state, nothing shared."""

    kind = "local"

    def share_index(self, name: str, index: PrefixIndex) -> PrefixIndex:
        return index

    def route_table(self, capacity: int) -> RouteTable:
        return LocalRouteTable(capacity)

    def bind_pods(self, pods: Mapping[EndpointId, PodLoad]) -> None:
        return None

    def share_scrapes(self, offer: ScrapeOffer) -> ScrapeShare | None:
        return None

    def peers(self) -> int:
        return 0

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None
