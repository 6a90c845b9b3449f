"""Replicas that keep the whole routing state locally and exchange their changes as a log of entries.

What ``RedisState`` (a Redis stream) and ``RelayState`` (``kvroute serve --workers N`` without
Redis: the supervisor relays over a Unix socket) have in common: local reads, an outbox appended to
on the request path, batches of records and this replica's load sent every ``flush_interval_s``, and
the peers' entries applied to the local state. Only the transport differs; both carry the same
entry (a msgpack map, below), so a replica cannot tell one from the other.

Entry: ``{"o": [op, ...], "l": [[pod, in flight, queued prefill s], ...], "t": unix time}``, written
by replica ``r``. Ops:
  ``["x", index name, endpoint, keys]``   a record; keys are a list on the request path, packed
                                          little-endian u64 bytes once drained; a fifth element 0:
                                          the keys are a prompt's head, not where it ended
  ``["p", route key, endpoint]``          a route-id pin
  ``["d", index name or "pins", endpoint]``  a purge (pod removed or restarted)
  ``["m", endpoint, figures, held s]``   a pod's /metrics as the replica that owns its scraping
                                          read them (``PodMetrics`` fields in order), ``held`` seconds
                                          before the entry's time (not history)
Entries hold block hashes, route-key hashes, counts, seconds and pod addresses: never request text.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
from array import array
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.config import RedisConfig
from extproc.index.base import EndpointId, PrefixIndex
from extproc.state.base import LocalRouteTable, PodLoad, RouteTable, ScrapeOffer

log = logging.getLogger("kvroute.state")

PINS = "pins"  # the name purges use for route-id pins
OPS_PER_ENTRY = 256  # records per entry: bounded entries after an outage's backlog
ENTRIES_PER_FLUSH = 16
RETRY_MIN_S = 0.05
LOAD_EPS_S = 0.005  # a pod's queued prefill end moving by less than this is not a change worth sending
# With nothing in flight and nothing to send, the writer looks this often (a record wakes it at once):
# a flush every 5 ms of an idle replica cost 3 % of a core. A pod's first request after a lull with no
# record (precise mode without speculation) reaches the peers within this.
IDLE_FLUSH_S = 0.05
# A pod's scraped figures wait at most this long for a flush that goes anyway (a record, a load
# change), the latest per pod kept: they alone triggered a write and a read on every replica per
# scrape. Well inside the SHARED_FRESH_INTERVALS × scrape interval after which peers scrape themselves.
FIGURES_HOLD_S = 0.05

Op = list[Any]


@dataclass(slots=True)
class _Peer:
    seen: float  # time.monotonic() of its last entry
    loads: dict[EndpointId, tuple[int, float]] = field(default_factory=dict)  # ep → (n, prefill s)


@dataclass(slots=True)
class Batch:
    """What one flush sends: ``entries`` (each with its ``ops``), and the loads among them, if any
    (pod, in flight, queued prefill s, prefill s run so far: ``PodLoad.own_load``)."""

    ops: list[Op]
    entries: list[dict[str, Any]]
    loads: list[tuple[EndpointId, int, float, float]] | None


class _SharedIndex:
    """A prefix index whose records and purges also go to the peers' index of the same name."""

    def __init__(self, state: ReplicatedState, name: str, inner: PrefixIndex) -> None:
        self._state, self.name, self.inner = state, name, inner

    def match(self, keys: Sequence[int], endpoints: Iterable[EndpointId]) -> dict[EndpointId, int]:
        return self.inner.match(keys, endpoints)

    def record(self, keys: Sequence[int], endpoint: EndpointId, ended: bool = True) -> None:
        self.inner.record(keys, endpoint, ended)
        self._state.emit(["x", self.name, endpoint, keys] if ended else ["x", self.name, endpoint, keys, 0])

    def remove_endpoint(self, endpoint: EndpointId) -> None:
        self.inner.remove_endpoint(endpoint)
        self._state.emit(["d", self.name, endpoint])

    def __getattr__(self, attr: str) -> Any:  # stats(), blocks(), ... of the wrapped index
        return getattr(self.inner, attr)


class _SharedRoutes:
    def __init__(self, state: ReplicatedState, inner: LocalRouteTable) -> None:
        self._state, self.inner = state, inner

    def get(self, key: int) -> EndpointId | None:
        return self.inner.get(key)

    def put(self, key: int, endpoint: EndpointId) -> None:
        self.inner.put(key, endpoint)
        self._state.emit(["p", key, endpoint])

    def forget_endpoint(self, endpoint: EndpointId) -> None:
        self.inner.forget_endpoint(endpoint)
        self._state.emit(["d", PINS, endpoint])


class ReplicatedState:
    """The transport-free part. A subclass provides ``start``/``aclose``, ``_flush`` (send
    ``self._batch(...)``, then ``self._delivered(...)``) and a reader that calls ``apply``."""

    kind: str  # "redis" | "relay": the SharedState kind, log lines' and metrics' name
    faults: ClassVar[tuple[type[BaseException], ...]]  # what the transport raises when it is down

    def __init__(self, cfg: RedisConfig, replica: str | None = None) -> None:
        self.cfg = cfg
        self.replica = replica or secrets.token_hex(8)
        self._indexes: dict[str, PrefixIndex] = {}
        self._routes: LocalRouteTable | None = None
        self._pods: Mapping[EndpointId, PodLoad] = {}
        self._outbox: deque[Op] = deque(maxlen=cfg.outbox_records)
        self._ring: deque[Op] = deque(maxlen=cfg.resync_records)  # sent records, for a resync
        self._peers: dict[str, _Peer] = {}
        self._sent_loads: dict[EndpointId, tuple[int, float, float]] = {}  # as sent: n, queued s, run s
        self._next_beat = 0.0
        self._closing = False
        self._tasks: list[asyncio.Task[None]] = []
        self._wake: asyncio.Event | None = None  # set by a record while the writer idles
        self._offer: ScrapeOffer | None = None  # the scraper, when scrapes are split
        self._figures: dict[EndpointId, tuple[float, list[Any]]] = {}  # pod -> (scraped at, figures) unsent
        self.up = False
        self._down_since: float | None = time.monotonic()  # not connected yet
        self._warned = False
        self.lags: deque[float] = deque(maxlen=1000)  # seconds from a peer's write to its apply here
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "sent_entries",
                "sent_records",
                "received_records",
                "received_scrapes",
                "dropped_records",
                "errors",
                "timeouts",
                "resyncs",
            ),
            0,
        )

    # -- the SharedState protocol ------------------------------------------------------------------

    def share_index(self, name: str, index: PrefixIndex) -> PrefixIndex:
        self._indexes[name] = index
        return _SharedIndex(self, name, index)

    def route_table(self, capacity: int) -> RouteTable:
        self._routes = LocalRouteTable(capacity)
        return _SharedRoutes(self, self._routes)

    def bind_pods(self, pods: Mapping[EndpointId, PodLoad]) -> None:
        self._pods = pods

    def share_scrapes(self, offer: ScrapeOffer) -> ReplicatedState:
        self._offer = offer
        return self

    def peers(self) -> int:
        return len(self._peers)

    def owns(self, endpoint: EndpointId) -> bool:
        """Rendezvous hashing over this replica and the live peers: each pod has one owner, and a
        replica that comes or goes moves only its own share of the pods."""
        mine = _rank(self.replica, endpoint)
        return all(_rank(r, endpoint) < mine for r in self._peers)

    def publish(self, endpoint: EndpointId, figures: Sequence[Any]) -> None:
        if self.up:  # (down: the peers scrape for themselves)
            self._figures[endpoint] = (time.monotonic(), list(figures))

    # -- the request path: a deque append ------------------------------------------------------------

    def emit(self, op: Op) -> None:
        if len(self._outbox) == self._outbox.maxlen:
            self.counters["dropped_records"] += 1
        self._outbox.append(op)
        if self._wake is not None:
            self._wake.set()
        if op[0] == "d":  # a purge (rare): what was sent about the pod must not come back in a resync
            kind = "p" if op[1] == PINS else "x"
            kept = (o for o in self._ring if not (o[0] == kind and o[2] == op[2] and (kind == "p" or o[1] == op[1])))
            self._ring = deque(kept, maxlen=self._ring.maxlen)

    # -- the two loops ---------------------------------------------------------------------------------

    def _start_loops(self) -> None:
        """The writer and the subclass's reader, as tasks."""
        self._wake = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self._write_loop(), name=f"kvroute-{self.kind}-writer"),
            asyncio.create_task(self._read_loop(), name=f"kvroute-{self.kind}-reader"),
        ]

    async def _stop_loops(self, timeout: float) -> None:
        """Both loops ended, waiting at most ``timeout``. The flag ends a loop whose cancellation
        Python 3.11's asyncio.timeout may swallow (when its own deadline falls at the same moment)."""
        self._closing = True
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout)
        self._tasks.clear()

    async def _hand_over(self) -> None:
        """A stopping replica (or worker) sends what it has not sent, and its load drops to none at once."""
        self._pods = {}
        with contextlib.suppress(*self.faults):
            await self._flush(time.monotonic(), force_loads=True)

    async def _read_loop(self) -> None:
        raise NotImplementedError

    # -- writer ----------------------------------------------------------------------------------------

    async def _flush(self, now: float, force_loads: bool) -> None:
        raise NotImplementedError

    async def _idle(self) -> bool:
        """Nothing of this replica's is in flight or unsent: wait for a record, at most IDLE_FLUSH_S (or
        until held figures are due)."""
        if self._outbox or self._sent_loads or self._wake is None:
            return False
        timeout = IDLE_FLUSH_S
        if self._figures:
            due = min(at for at, _ in self._figures.values()) + FIGURES_HOLD_S
            timeout = min(timeout, max(0.0, due - time.monotonic()))
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)
        return True

    async def _write_loop(self) -> None:
        backoff = RETRY_MIN_S
        while not self._closing:
            if not self.up:
                await asyncio.sleep(backoff)
            elif not await self._idle() or self._outbox:
                await asyncio.sleep(self.cfg.flush_interval_s)  # (write-behind: a record waits this to batch)
            now = time.monotonic()
            self._expire_peers(now)
            try:
                await self._flush(now, force_loads=now >= self._next_beat)
            except self.faults as e:
                self._failed("write", e)
                backoff = min(self.cfg.retry_max_s, backoff * 2)
            except Exception:  # a bug must not end sharing for good: count it and go on
                self.counters["errors"] += 1
                log.exception("shared-state write failed")
                backoff = min(self.cfg.retry_max_s, backoff * 2)
            else:
                backoff = RETRY_MIN_S

    def _batch(self, now: float, force_loads: bool) -> Batch | None:
        """The next entries to send (outbox records, this replica's load if it changed), stamped
        with the time; None when there is nothing to send."""
        loads = self._own_loads(now, force_loads)
        figures_due = any(now - at >= FIGURES_HOLD_S for at, _ in self._figures.values())
        if not self._outbox and loads is None and not figures_due:
            return None
        ops: list[Op] = []
        entries: list[dict[str, Any]] = []
        while self._outbox and len(entries) < ENTRIES_PER_FLUSH:
            batch = [self._pack(self._outbox.popleft()) for _ in range(min(OPS_PER_ENTRY, len(self._outbox)))]
            ops.extend(batch)
            entries.append({"o": batch})
        if not entries:
            entries.append({})
        if loads is not None:
            entries[-1]["l"] = [[ep, n, s] for ep, n, s, _ in loads]
        if self._figures:  # (with whatever goes anyway; not history, so not in ops: no resync replays them)
            figures = [["m", ep, f, round(now - at, 4)] for ep, (at, f) in self._figures.items()]
            entries[-1]["o"] = [*entries[-1].get("o", ()), *figures]
            self._figures.clear()
        t = time.time()
        for e in entries:
            e["t"] = t
        return Batch(ops, entries, loads)

    def _delivered(self, batch: Batch, now: float) -> None:
        """``batch`` reached the transport."""
        self._ok()
        if batch.loads is not None:
            self._sent_loads = {ep: (n, s, ran) for ep, n, s, ran in batch.loads}
            self._next_beat = now + self.cfg.heartbeat_s
        self.counters["sent_entries"] += len(batch.entries)
        self.counters["sent_records"] += len(batch.ops)
        self._ring.extend(op for op in batch.ops if op[0] != "d")

    @staticmethod
    def _pack(op: Op) -> Op:
        if op[0] == "x" and not isinstance(op[3], bytes):
            return ["x", op[1], op[2], array("Q", op[3]).tobytes(), *op[4:]]
        return op

    def _requeue(self, ops: list[Op]) -> None:
        """Put unsent ops back in front of the outbox; past its bound the oldest go."""
        pending = [*ops, *self._outbox]
        self.counters["dropped_records"] += max(0, len(pending) - (self._outbox.maxlen or 0))
        self._outbox.clear()
        self._outbox.extend(pending)

    def _own_loads(self, now: float, force: bool) -> list[tuple[EndpointId, int, float, float]] | None:
        """This replica's load on each busy pod (pod, in flight, queued prefill s, prefill s run), if
        it changed since it was last sent (or ``force``)."""
        loads = []
        changed = force
        sent = self._sent_loads
        for ep, pod in self._pods.items():
            n, s, ran = pod.own_load(now)
            if n or s > 0:
                loads.append((ep, n, round(s, 4), ran))
                old = sent.get(ep)
                # What peers hold now is the count sent and the queued prefill sent less what ran
                # since (they run it down as this replica does): a queue only draining, or a count
                # unchanged with nothing queued, is no news however long ago it went out.
                if old is None or old[0] != n or abs(max(old[1] - (ran - old[2]), 0.0) - s) > LOAD_EPS_S:
                    changed = True
            elif ep in sent:
                changed = True
        if not changed and len(loads) != len(sent):
            changed = True  # a pod that was busy is gone
        return loads if changed else None

    # -- reader ----------------------------------------------------------------------------------------

    def apply(self, fields: Mapping[bytes, bytes]) -> None:
        """Apply one log entry (``{b"r": replica, b"m": msgpack entry}``) written by another replica."""
        replica = fields[b"r"].decode()
        if replica == self.replica:
            return
        entry = msgpack.unpackb(fields[b"m"])
        now = time.monotonic()
        age = max(0.0, time.time() - float(entry.get("t", 0)))
        known = self._pods
        for op in entry.get("o", ()):
            kind = op[0]
            if kind == "x":
                idx = self._indexes.get(op[1])
                if idx is not None and (not known or op[2] in known):
                    keys = array("Q")
                    keys.frombytes(op[3])
                    idx.record(keys, op[2], len(op) < 5 or bool(op[4]))  # (an older peer sends no flag)
                    self.counters["received_records"] += 1
            elif kind == "p":
                if self._routes is not None and (not known or op[2] in known):
                    self._routes.put(op[1], op[2])
                    self.counters["received_records"] += 1
            elif kind == "d":
                if op[1] == PINS:
                    if self._routes is not None:
                        self._routes.forget_endpoint(op[2])
                elif (idx := self._indexes.get(op[1])) is not None:
                    idx.remove_endpoint(op[2])
            elif kind == "m" and self._offer is not None and self._offer(op[1], op[2], age + float(op[3])):
                self.counters["received_scrapes"] += 1
        if age > self.cfg.peer_timeout_s:
            return  # replayed history: its loads are long over
        self.lags.append(age)
        peer = self._peers.get(replica)
        if peer is None:
            peer = self._peers[replica] = _Peer(seen=now)
        peer.seen = now
        if "l" in entry:
            old = peer.loads
            peer.loads = {ep: (int(n), float(s)) for ep, n, s in entry["l"]}
            self._apply_loads(replica, peer, now, old.keys() | peer.loads.keys())

    def _apply_safely(self, fields: Mapping[bytes, bytes]) -> None:
        try:
            self.apply(fields)
        except Exception as e:  # a malformed entry (or a bug) costs that entry only
            self.counters["errors"] += 1
            log.warning("shared-state entry skipped", extra={"fields": {"error": repr(e)}})

    def _expire_peers(self, now: float) -> None:
        gone = [r for r, p in self._peers.items() if now - p.seen > self.cfg.peer_timeout_s]
        for r in gone:
            peer = self._peers.pop(r)
            gone_loads = peer.loads.keys()
            peer.loads = {}
            self._apply_loads(r, peer, now, gone_loads)
            log.info("peer replica silent: its load no longer counts", extra={"fields": {"replica": r}})

    def _apply_loads(self, replica: str, peer: _Peer, now: float, endpoints: Iterable[EndpointId]) -> None:
        """Peer ``replica``'s load on ``endpoints`` is what ``peer.loads`` says (absent: none). Each pod
        runs the peers' queued prefill down from here (``PrefillQueue``); a peer's entry is a few ms
        old at most (older ones are replayed history and carry no load)."""
        for ep in endpoints:
            pod = self._pods.get(ep)
            if pod is not None:
                n, s = peer.loads.get(ep, (0, 0.0))
                pod.set_peer_load(replica, n, s, now)

    # -- health ----------------------------------------------------------------------------------------

    def _where(self) -> dict[str, Any]:
        """The transport, for log lines (no credentials)."""
        return {}

    def _ok(self) -> None:
        if self.up:
            return
        self.up = True
        if self._warned:
            down_s = time.monotonic() - self._down_since if self._down_since is not None else 0.0
            log.warning(f"{self.kind} reachable again: sharing resumed",
                        extra={"fields": {**self._where(), "down_s": round(down_s, 1)}})  # fmt: skip
        else:
            log.info(f"{self.kind} connected: state shared",
                     extra={"fields": {**self._where(), "replica": self.replica}})  # fmt: skip
        self._warned = False
        self._down_since = None

    def _failed(self, op: str, e: BaseException) -> None:
        self.counters["errors"] += 1
        if isinstance(e, TimeoutError):
            self.counters["timeouts"] += 1
        if self.up or not self._warned:
            log.warning(
                f"{self.kind} unavailable: routing on this replica's own state until it returns",
                extra={"fields": {**self._where(), "op": op, "error": f"{type(e).__name__}: {e}"}},
            )
            self._warned = True
        if self.up:
            self._down_since = time.monotonic()
        self.up = False

    def stats(self) -> dict[str, float]:
        return {
            **self.counters,
            "up": float(self.up),
            "peers": len(self._peers),
            "outbox": len(self._outbox),
            "lag_ms": 1e3 * sorted(self.lags)[len(self.lags) // 2] if self.lags else 0.0,
        }


class StateCollector(Collector):
    """``kvroute_<kind>_up`` (0/1, for alerts) and ``kvroute_<kind>{stat}`` counters and gauges."""

    def __init__(self, state: ReplicatedState) -> None:
        self.state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        st = self.state.stats()
        kind = self.state.kind
        yield GaugeMetricFamily(f"kvroute_{kind}_up", f"1 while {kind} answers: state shared with the other replicas",
                                value=st.pop("up"))  # fmt: skip
        g = GaugeMetricFamily(f"kvroute_{kind}", f"Shared state through {kind}: counters and gauges", labels=["stat"])
        for k, v in st.items():
            g.add_metric([k], v)
        yield g


def _rank(replica: str, endpoint: EndpointId) -> bytes:
    return hashlib.blake2b(f"{replica}|{endpoint}".encode(), digest_size=8).digest()
