"""Endpoints and pools: membership as discovery publishes it (static config, a file, Kubernetes) plus
live load (kvroute's own in-flight counts, and the pod's own gauges once a metrics scraper feeds them)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from extproc.config import Config, EndpointConfig, Role
from extproc.index.base import EndpointId


@dataclass(slots=True)
class _Prefill:
    ticket: int
    due: float  # estimated end (time.monotonic())
    deadline: float | None  # by when it reports its end; None: it does not


class PrefillQueue:
    """Prefills sent to one pod, run one after another at an estimated duration each: when each
    should end (``time.monotonic()``). An end reported early moves everything behind it forward;
    one that will report its end (a gateway prefill leg, by a deadline) and is overdue is still
    running, so it and everything behind it end later than thought; others past their end drop out
    (a local prefill reports only the end of its whole exchange).

    With shared state, the other replicas' prefills there count too: their queued seconds as last
    reported (``set_peer``), counted down since. This queue's own timeline stays this replica's alone
    (what it reports to them), and a new prefill starts after both."""

    __slots__ = ("_peer_at", "_peer_s", "_queue", "_tickets")

    def __init__(self) -> None:
        self._queue: list[_Prefill] = []  # due ascending
        self._tickets = itertools.count(1)
        self._peer_s, self._peer_at = 0.0, 0.0

    def _shift(self, start: int, seconds: float) -> None:
        """Entries from ``start`` on end ``seconds`` later (earlier if negative)."""
        for entry in self._queue[start:]:
            entry.due += seconds

    def _expire(self, now: float) -> None:
        while self._queue and self._queue[0].due <= now:
            head = self._queue[0]
            if head.deadline is not None and head.deadline > now:
                self._shift(0, now - head.due)
                return
            self._queue.pop(0)

    def own_wait(self, now: float) -> float:
        """Seconds of this replica's prefills still queued there."""
        self._expire(now)
        return self._queue[-1].due - now if self._queue else 0.0

    def wait(self, now: float) -> float:
        """Seconds until a new prefill would start."""
        own = self.own_wait(now)
        return own + max(0.0, self._peer_s - (now - self._peer_at)) if self._peer_s else own

    def set_peer(self, seconds: float, now: float) -> None:
        """The other replicas' prefill seconds queued there as of ``now``."""
        self._peer_s, self._peer_at = seconds, now

    def add(self, seconds: float, now: float, reports_within: float | None = None) -> int:
        """Queue ``seconds`` of prefill; a ticket for ``finished``, which ``reports_within`` (s)
        promises: until then the prefill counts as running, however late."""
        ticket = next(self._tickets)
        deadline = None if reports_within is None else now + reports_within
        self._queue.append(_Prefill(ticket, now + self.own_wait(now) + seconds, deadline))
        return ticket

    def finished(self, ticket: int, now: float) -> None:
        """The prefill with ``ticket`` ended ``now``: what is behind it moves up (or, after a leg
        that ran late, back) by as much."""
        for i, entry in enumerate(self._queue):
            if entry.ticket == ticket:
                del self._queue[i]
                late = now - entry.due
                self._shift(i, late if entry.deadline is not None else min(0.0, late))
                return


class Handoffs:
    """Split requests headed for one decode pod, each until its KV should be there (``time.monotonic()``).
    vLLM admits waiting requests, those pulling remote KV too, only from the token budget that the
    running prefill chunks leave: a long prefill started here holds every one of them back."""

    __slots__ = ("_due", "_tickets")

    def __init__(self) -> None:
        self._due: dict[int, float] = {}
        self._tickets = itertools.count(1)

    def add(self, due: float) -> int:
        ticket = next(self._tickets)
        self._due[ticket] = due
        return ticket

    def settle(self, ticket: int, due: float | None) -> None:
        """A new estimate for ``ticket`` (the prefill leg returned), or None: it is not coming."""
        if ticket in self._due:
            if due is None:
                del self._due[ticket]
            else:
                self._due[ticket] = due

    def pending(self, now: float) -> int:
        for t in [t for t, due in self._due.items() if due <= now]:
            del self._due[t]
        return len(self._due)


@dataclass(slots=True)
class EndpointState:
    address: EndpointId
    role: Role
    cluster: str
    pool: str
    inflight: int = 0  # requests in flight there: this replica's, plus the peers' (shared state)
    peer_inflight: int = 0  # the peers' part, as they last reported it
    # Filled by the metrics scraper when configured; None = unknown (scorers then ignore them).
    queue: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    healthy: bool = True
    down: bool = False  # its scrapes are refused or fail TLS: dead or unreachable, not merely slow
    # Discovery says the pod is not Ready or is terminating: no new requests, in-flight ones finish.
    draining: bool = False
    model: str | None = None  # the only model it serves (a pod label); None: any
    cache_bucket: str | None = None
    uid: str | None = None
    # The prefill work kvroute has sent here, as an estimated queue: the cost scorer counts it as
    # load, and P/D decisions compare a prefill pod's queue with the decode pod's own.
    prefills: PrefillQueue = field(default_factory=PrefillQueue)
    # P/D: split requests whose KV this pod (as decode pod) is about to pull.
    handoffs: Handoffs = field(default_factory=Handoffs)

    def serves(self, role: Role) -> bool:
        return self.role == "both" or self.role == role

    def serves_model(self, model: str | None) -> bool:
        return self.model is None or model is None or self.model == model

    @property
    def available(self) -> bool:
        """May take a new request: its metrics are fresh (or not scraped) and it is not draining."""
        return self.healthy and not self.draining

    @property
    def own_inflight(self) -> int:
        """This replica's requests in flight there (what its metrics report: replicas add up)."""
        return self.inflight - self.peer_inflight

    def own_load(self, now: float) -> tuple[int, float]:
        """What this replica alone has there: requests in flight, prefill seconds queued (``PodLoad``)."""
        return self.own_inflight, self.prefills.own_wait(now)

    def set_peer_load(self, inflight: int, prefill_s: float, now: float) -> None:
        """What the other replicas have there (``PodLoad``)."""
        self.inflight += inflight - self.peer_inflight
        self.peer_inflight = inflight
        self.prefills.set_peer(prefill_s, now)

    def forget_estimates(self) -> None:
        """The pod restarted: what kvroute estimated of its queues and gauges no longer holds."""
        self.prefills = PrefillQueue()
        self.handoffs = Handoffs()
        self.queue = self.running = self.kv_usage = None


@dataclass(slots=True)
class Pool:
    name: str
    cluster: str | None
    endpoints: list[EndpointState] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Change:
    """What one published endpoint set changed (the registry's listeners act on it)."""

    pool: str
    added: tuple[EndpointConfig, ...] = ()
    removed: tuple[EndpointId, ...] = ()  # gone from every pool: purge what is known of them
    restarted: tuple[EndpointConfig, ...] = ()  # same address, new pod (uid): purge, resubscribe
    drained: tuple[EndpointId, ...] = ()
    undrained: tuple[EndpointId, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.restarted or self.drained or self.undrained)


Listener = Callable[[Change], None]


class Registry:
    """All pools and endpoints, as discovery last published them; the single owner of in-flight counts.

    ``apply`` replaces one pool's endpoints and tells the listeners what changed, synchronously, on the
    event loop: a decision never sees a half-applied set."""

    def __init__(self, config: Config) -> None:
        self.pools: dict[str, Pool] = {}
        self.by_address: dict[EndpointId, EndpointState] = {}
        self.configs: dict[EndpointId, EndpointConfig] = {}
        self._pool_clusters = {name: pc.cluster for name, pc in config.pools.items()}
        k8s = config.discovery.kubernetes
        if config.discovery.provider == "kubernetes" and k8s is not None:
            for kp in k8s.pools:
                self._pool_clusters.setdefault(kp.name, kp.cluster)
        for name in config.pool_names:
            self.pools[name] = Pool(name=name, cluster=self._pool_clusters.get(name))
        self._listeners: list[Listener] = []
        self.changes = 0
        # The config's own endpoints are there from the start (decisions need no started server);
        # a provider's first sets arrive when the router starts it.
        for name, pc in config.pools.items():
            self.apply(name, pc.endpoints)

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def apply(self, pool_name: str, endpoints: Sequence[EndpointConfig]) -> Change:
        """The pool's endpoints are now exactly ``endpoints``. An address already in another pool is
        the same pod there: it keeps one state (one in-flight count)."""
        pool = self.pools.get(pool_name)
        if pool is None:
            pool = self.pools[pool_name] = Pool(name=pool_name, cluster=self._pool_clusters.get(pool_name))
        wanted = {ec.address: ec for ec in endpoints}
        added: list[EndpointConfig] = []
        restarted: list[EndpointConfig] = []
        drained: list[EndpointId] = []
        undrained: list[EndpointId] = []
        new_list: list[EndpointState] = []
        for addr, ec in wanted.items():
            st = self.by_address.get(addr)
            if st is None:
                st = self.by_address[addr] = _state(ec, pool_name)
                added.append(ec)
            else:
                old = self.configs[addr]
                if ec.uid != old.uid and old.uid is not None:
                    st.forget_estimates()
                    restarted.append(ec)
                st.role, st.cluster, st.model, st.cache_bucket, st.uid = (
                    ec.role, ec.cluster_name, ec.model, ec.cache_bucket, ec.uid)  # fmt: skip
                if st.draining and ec.ready:
                    undrained.append(addr)
                elif not st.draining and not ec.ready:
                    drained.append(addr)
            st.draining = not ec.ready
            self.configs[addr] = ec
            new_list.append(st)
        gone = {e.address for e in pool.endpoints} - wanted.keys()
        pool.endpoints = new_list
        elsewhere = {e.address for p in self.pools.values() for e in p.endpoints}
        removed = tuple(sorted(a for a in gone if a not in elsewhere))
        for addr in removed:
            del self.by_address[addr]
            del self.configs[addr]
        change = Change(pool_name, tuple(added), removed, tuple(restarted), tuple(drained), tuple(undrained))
        if change:
            self.changes += 1
            for listener in self._listeners:
                listener(change)
        return change

    def pool_serving(self, model: str) -> str | None:
        """The pool whose pods say they serve ``model`` (pod label), if any."""
        for pool in self.pools.values():
            if any(e.model == model for e in pool.endpoints):
                return pool.name
        return None

    def acquire(self, address: EndpointId) -> None:
        st = self.by_address.get(address)
        if st is not None:
            st.inflight += 1

    def release(self, address: EndpointId) -> None:
        st = self.by_address.get(address)
        if st is not None and st.inflight > st.peer_inflight:
            st.inflight -= 1


def _state(ec: EndpointConfig, pool: str) -> EndpointState:
    return EndpointState(
        address=ec.address,
        role=ec.role,
        cluster=ec.cluster_name,
        pool=pool,
        draining=not ec.ready,
        model=ec.model,
        cache_bucket=ec.cache_bucket,
        uid=ec.uid,
    )
