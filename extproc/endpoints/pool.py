"""Endpoints and pools: static membership from config plus live load (kvroute's own in-flight
counts, and the pod's own gauges once a metrics scraper feeds them)."""

from __future__ import annotations

import itertools
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
    (a local prefill reports only the end of its whole exchange)."""

    __slots__ = ("_queue", "_tickets")

    def __init__(self) -> None:
        self._queue: list[_Prefill] = []  # due ascending
        self._tickets = itertools.count(1)

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

    def wait(self, now: float) -> float:
        """Seconds until a new prefill would start."""
        self._expire(now)
        return self._queue[-1].due - now if self._queue else 0.0

    def add(self, seconds: float, now: float, reports_within: float | None = None) -> int:
        """Queue ``seconds`` of prefill; a ticket for ``finished``, which ``reports_within`` (s)
        promises: until then the prefill counts as running, however late."""
        ticket = next(self._tickets)
        deadline = None if reports_within is None else now + reports_within
        self._queue.append(_Prefill(ticket, now + self.wait(now) + seconds, deadline))
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
    inflight: int = 0
    # Filled by the metrics scraper when configured; None = unknown (scorers then ignore them).
    queue: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    healthy: bool = True
    # The prefill work kvroute has sent here, as an estimated queue: the cost scorer counts it as
    # load, and P/D decisions compare a prefill pod's queue with the decode pod's own.
    prefills: PrefillQueue = field(default_factory=PrefillQueue)
    # P/D: split requests whose KV this pod (as decode pod) is about to pull.
    handoffs: Handoffs = field(default_factory=Handoffs)

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
