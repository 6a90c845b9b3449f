"""Endpoints and pools: membership as discovery publishes it (static config, a file, Kubernetes) plus
live load (kvroute's own in-flight counts, and the pod's own gauges once a metrics scraper feeds them)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from extproc.config import Config, EndpointConfig, Role
from extproc.index.base import EndpointId

_DONE_S = 1e-9  # work left below this is done (float residue of the proportional shares)
MEMO_MAX = 1024  # entries of the registry's per-model lookups before they start over


@dataclass(slots=True)
class _Prefill:
    ticket: int
    work: float  # seconds of it still to run
    deadline: float | None  # by when it reports its end (time.monotonic()); None: it does not
    whole: float = 0.0  # its whole estimate, as queued (what an estimate's error scales with)


class PrefillQueue:
    """The prefill work queued on one pod, in seconds, as kvroute estimates it: this replica's prefills
    (each until it has run its estimated duration) and, with shared state, each peer replica's queued
    seconds as it last reported them. The pod works through all of it at one second per second, so a
    new prefill waits for the sum (``wait``).

    Time is shared between this replica's part and the peers' in proportion to what each has queued
    (processor sharing): the sum then drains at exactly one second per second in every replica's view,
    and each replica's own part drains the way its peers count it down (the sender and its peers agree
    without a message). Counting every replica's part down at full speed, as if each ran alone, drained
    a queue fed by three replicas three times too fast: replicas kept sending long prompts to a pod that
    was still busy (the Mooncake trace's TTFT, bench/RESULTS.md "Replicas side by side").

    This replica's prefills run one after another: a prefill that will report its end (a gateway
    prefill leg, by a deadline) and has run its estimate is still running, so nothing of this replica's
    behind it moves until it reports or its deadline passes; others drop out when their estimate is
    spent (a local prefill reports only the end of its whole exchange). An end reported early takes
    the rest of that prefill's work off the queue."""

    __slots__ = ("_at", "_peers", "_queue", "_tickets", "served")

    def __init__(self) -> None:
        self._queue: list[_Prefill] = []
        self._peers: dict[str, float] = {}  # peer replica → its prefill seconds queued here, as of _at
        self._at: float | None = None  # the time the figures above hold for
        self._tickets = itertools.count(1)
        self.served = 0.0  # seconds of this replica's prefills run so far (a running total)

    def _advance(self, now: float) -> None:
        """Run the queue forward to ``now``."""
        t = self._at
        if t is None or now <= t:
            self._at = now if t is None else t
            return
        self._at = now
        q, peers = self._queue, self._peers
        while t < now:
            while q and q[0].work <= _DONE_S and (q[0].deadline is None or q[0].deadline <= t):
                q.pop(0)
            peer = sum(peers.values())
            if q and q[0].work <= _DONE_S and (deadline := q[0].deadline) is not None:
                # A reporting leg past its estimate: it runs, ours wait; the peers' part runs meanwhile.
                span = min(now, deadline) - t
                share = min(1.0, span / peer) if peer > 0 else 0.0
            else:
                own = sum([e.work for e in q])  # (a list sums faster than a generator, in the same order)
                total = own + peer
                if total <= 0:
                    break
                # The head of our part runs at own/total of the pod until it is done or all is.
                span = min(now - t, q[0].work * total / own if own > 0 else total, total)
                share = span / total
                if q:
                    q[0].work -= own * share
                    self.served += own * share
            for r, s in list(peers.items()) if peers else ():
                left = s * (1.0 - share)
                if left > _DONE_S:
                    peers[r] = left
                else:
                    del peers[r]
            if span <= 0:
                break
            t += span

    def own_wait(self, now: float) -> float:
        """Seconds of this replica's prefills still to run there (what its peers are told)."""
        self._advance(now)
        return sum(e.work for e in self._queue)

    def wait(self, now: float) -> float:
        """Seconds until a new prefill would start: all of the pod's queued prefill work."""
        if not self._queue and not self._peers:  # nothing to run forward (the next change advances first)
            return 0.0
        self._advance(now)
        return sum([e.work for e in self._queue]) + sum(self._peers.values())

    def ahead(self, now: float) -> tuple[float, float]:
        """``wait``, and the whole estimates of the prefills it is made of (the peers' as they last
        reported them): an estimate off by a share is off by that share of these, not of what is left."""
        wait = self.wait(now)  # (runs the queue forward to now)
        return wait, sum([e.whole for e in self._queue]) + sum(self._peers.values())

    def set_peer(self, replica: str, seconds: float, now: float) -> None:
        """Peer ``replica`` has ``seconds`` of prefill queued there as of ``now`` (0: none)."""
        self._advance(now)
        if seconds > 0:
            self._peers[replica] = seconds
        else:
            self._peers.pop(replica, None)

    def add(self, seconds: float, now: float, reports_within: float | None = None) -> int:
        """Queue ``seconds`` of prefill; a ticket for ``finished``, which ``reports_within`` (s)
        promises: until then the prefill counts as running, however late."""
        self._advance(now)
        ticket = next(self._tickets)
        deadline = None if reports_within is None else now + reports_within
        self._queue.append(_Prefill(ticket, seconds, deadline, seconds))
        return ticket

    def shorten(self, ticket: int, seconds: float, now: float) -> None:
        """The prefill with ``ticket`` turned out ``seconds`` shorter than queued (negative: longer), as a
        longer match than its decision saw: that much less of it is left, if it is still queued."""
        self._advance(now)
        for entry in self._queue:
            if entry.ticket == ticket:
                entry.work = max(0.0, entry.work - seconds)
                return

    def finished(self, ticket: int, now: float) -> None:
        """The prefill with ``ticket`` ended ``now``: what was left of it is off the queue (after a
        leg that ran late, ours behind it run from now)."""
        self._advance(now)
        for i, entry in enumerate(self._queue):
            if entry.ticket == ticket:
                del self._queue[i]
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
        if not self._due:
            return 0
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
    peers_inflight: dict[str, int] = field(default_factory=dict)  # the peers' part, by replica, as last reported
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
    # routing.hold: when the long prompts this replica sent here should be prefilled, margin included
    # (time.monotonic()); the queue estimate above drops them at their estimated end, without it.
    long_prefill_until: float = 0.0

    def serves(self, role: Role) -> bool:
        return self.role == "both" or self.role == role

    def serves_model(self, model: str | None) -> bool:
        return self.model is None or model is None or self.model == model

    @property
    def available(self) -> bool:
        """May take a new request: its metrics are fresh (or not scraped) and it is not draining."""
        return self.healthy and not self.draining

    @property
    def peer_inflight(self) -> int:
        """The peers' requests in flight there, as they last reported them."""
        return sum(self.peers_inflight.values())

    @property
    def own_inflight(self) -> int:
        """This replica's requests in flight there (what its metrics report: replicas add up)."""
        return self.inflight - self.peer_inflight

    def own_load(self, now: float) -> tuple[int, float, float]:
        """What this replica alone has there: requests in flight, prefill seconds queued, prefill
        seconds run so far (``PodLoad``)."""
        return self.own_inflight, self.prefills.own_wait(now), self.prefills.served

    def set_peer_load(self, replica: str, inflight: int, prefill_s: float, now: float) -> None:
        """What peer ``replica`` has there (``PodLoad``)."""
        old = self.peers_inflight.pop(replica, 0)
        if inflight:
            self.peers_inflight[replica] = inflight
        self.inflight += inflight - old
        self.prefills.set_peer(replica, prefill_s, now)

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
        # Per decision these were a scan of every pod; they change only when a pool is applied.
        self._serving: dict[str, str | None] = {}
        self._candidates: dict[tuple[str, str | None, Role], list[EndpointState]] = {}
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
        self._serving.clear()
        self._candidates.clear()
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
        if model in self._serving:
            return self._serving[model]
        found = next((p.name for p in self.pools.values() if any(e.model == model for e in p.endpoints)), None)
        if len(self._serving) >= MEMO_MAX:  # clients name models: a bound, not one entry per name ever sent
            self._serving.clear()
        self._serving[model] = found
        return found

    def candidates(self, pool: Pool, model: str | None, role: Role) -> list[EndpointState]:
        """``pool``'s pods that serve ``model`` in ``role`` (all that serve the model if none has the
        role). The list is shared between decisions until the pool changes: read it, never modify it."""
        key = (pool.name, model, role)
        got = self._candidates.get(key)
        if got is None:
            serving = [e for e in pool.endpoints if e.serves_model(model)]
            got = [e for e in serving if e.serves(role)] or serving
            if len(self._candidates) >= MEMO_MAX:
                self._candidates.clear()
            self._candidates[key] = got
        return got

    def acquire(self, address: EndpointId) -> None:
        st = self.by_address.get(address)
        if st is not None:
            st.inflight += 1

    def release(self, address: EndpointId) -> None:
        st = self.by_address.get(address)
        if st is not None and st.own_inflight > 0:
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
