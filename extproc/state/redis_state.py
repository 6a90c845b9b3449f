"""Shared state through Redis: local reads, write-behind, and a shared log that every replica follows.

Decisions never wait on Redis. Each replica keeps the whole routing state in memory (the same
indexes and pins as one replica alone) and reads only that. What it changes goes into an outbox
(a deque append on the request path); a background writer sends the outbox every
``flush_interval_s`` as one entry of a Redis stream (XADD, trimmed with MAXLEN ~), together with
this replica's load (requests in flight and queued prefill seconds per pod) when it changed, or at
least every ``heartbeat_s``. A background reader follows the stream (XREAD BLOCK) and applies the
other replicas' entries to the local state. bench/RESULTS.md ("Shared state (Redis)") has the
measurement behind this design: a Redis round trip on each decision costs more than the whole
decision budget.

Why a stream rather than pub/sub: a reader that reconnects resumes where it was (nothing lost in a
short outage), and a replica that starts replays the recent history, so it routes an ongoing
conversation where the others do. Keys (``key_prefix`` + ...): ``{log}`` the stream (about
``log_maxlen`` entries, expiring ``ttl_s`` after the last write) and ``{log}:replica:<id>`` one
number per replica (entries it wrote), which tells it whether Redis lost its data. The hash tag
keeps both in one Redis Cluster slot. Entries hold block hashes, route-key hashes, counts, seconds
and pod addresses: never request text.

Faults: every Redis command runs under ``timeout_s``; a failure marks Redis down (metric
``kvroute_redis_up`` 0, one warning), the outbox keeps at most ``outbox_records`` (oldest dropped),
peers' loads expire after ``peer_timeout_s`` so routing falls back to this replica's own view, and
both loops retry at most ``retry_max_s`` apart. When Redis comes back empty (restart, failover
without the data), the replica's marker is gone: it writes its latest ``resync_records`` records
again, so the log is rebuilt for replicas that start later.

Peers' load: a pod's in-flight count is this replica's own plus what each live peer reported last;
its prefill queue is this replica's own estimate plus the peers' queued seconds, counted down from
when they were reported (the pod works through them meanwhile). Split hand-offs pending on decode
pods (``Handoffs``) are not shared: they weigh a local prefill on a pod for a second at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from array import array
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from extproc.config import RedisConfig
from extproc.index.base import EndpointId, PrefixIndex
from extproc.state.base import LocalRouteTable, PodLoad, RouteTable
from extproc.state.client import RedisClient, make_client, safe_url

log = logging.getLogger("kvroute.state")

PINS = "pins"  # the name purges use for route-id pins
OPS_PER_ENTRY = 256  # records per stream entry: bounded entries after an outage's backlog
ENTRIES_PER_FLUSH = 16
READ_COUNT = 200  # entries applied between two awaits: a replayed log does not stall decisions
READ_BLOCK_S = 1.0  # XREAD BLOCK: also how soon a silent (paused) Redis is noticed by the reader
RETRY_MIN_S = 0.05
LOAD_EPS_S = 0.005  # a pod's queued prefill end moving by less than this is not a change worth sending
FAULTS = (RedisError, OSError, TimeoutError)

# Ops in the outbox and on the wire (msgpack lists):
#   ["x", index name, endpoint, keys]  a record; keys are a list on the request path, packed
#                                      little-endian u64 bytes once drained
#   ["p", route key, endpoint]         a route-id pin
#   ["d", index name or "pins", endpoint]  a purge (pod removed or restarted)
Op = list[Any]


@dataclass(slots=True)
class _Peer:
    seen: float  # time.monotonic() of its last entry
    loads: dict[EndpointId, tuple[int, float, float]] = field(default_factory=dict)  # ep → (n, prefill s, at)


class _SharedIndex:
    """A prefix index whose records and purges also go to the peers' index of the same name."""

    def __init__(self, state: RedisState, name: str, inner: PrefixIndex) -> None:
        self._state, self.name, self.inner = state, name, inner

    def match(self, keys: Sequence[int], endpoints: Iterable[EndpointId]) -> dict[EndpointId, int]:
        return self.inner.match(keys, endpoints)

    def record(self, keys: Sequence[int], endpoint: EndpointId) -> None:
        self.inner.record(keys, endpoint)
        self._state.emit(["x", self.name, endpoint, keys])

    def remove_endpoint(self, endpoint: EndpointId) -> None:
        self.inner.remove_endpoint(endpoint)
        self._state.emit(["d", self.name, endpoint])

    def __getattr__(self, attr: str) -> Any:  # stats(), blocks(), ... of the wrapped index
        return getattr(self.inner, attr)


class _SharedRoutes:
    def __init__(self, state: RedisState, inner: LocalRouteTable) -> None:
        self._state, self.inner = state, inner

    def get(self, key: int) -> EndpointId | None:
        return self.inner.get(key)

    def put(self, key: int, endpoint: EndpointId) -> None:
        self.inner.put(key, endpoint)
        self._state.emit(["p", key, endpoint])

    def forget_endpoint(self, endpoint: EndpointId) -> None:
        self.inner.forget_endpoint(endpoint)
        self._state.emit(["d", PINS, endpoint])


class RedisState:
    kind = "redis"

    def __init__(self, cfg: RedisConfig, replica: str | None = None) -> None:
        assert cfg.url is not None
        self.cfg = cfg
        self.replica = replica or secrets.token_hex(8)
        self.log_key = f"{cfg.key_prefix}{{log}}"
        self.marker_key = f"{self.log_key}:replica:{self.replica}"
        self._indexes: dict[str, PrefixIndex] = {}
        self._routes: LocalRouteTable | None = None
        self._pods: Mapping[EndpointId, PodLoad] = {}
        self._outbox: deque[Op] = deque(maxlen=cfg.outbox_records)
        self._ring: deque[Op] = deque(maxlen=cfg.resync_records)  # sent records, for a resync
        self._peers: dict[str, _Peer] = {}
        self._sent_loads: dict[EndpointId, tuple[int, float]] = {}
        self._next_beat = 0.0
        self._written = 0  # entries this replica wrote (its marker's value)
        self._last_id: bytes | str = "0-0"
        self._writer: RedisClient | None = None
        self._reader: RedisClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self.up = False
        self._down_since: float | None = time.monotonic()  # not connected yet
        self._warned = False
        self.lags: deque[float] = deque(maxlen=1000)  # seconds from a peer's write to its apply here
        self.counters: dict[str, int] = dict.fromkeys(
            ("sent_entries", "sent_records", "received_records", "dropped_records", "errors", "timeouts", "resyncs"),
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

    async def start(self) -> None:
        # The reader's socket waits out a blocking XREAD; the writer's gives up after timeout_s.
        self._writer = make_client(self.cfg, self.cfg.timeout_s)
        self._reader = make_client(self.cfg, READ_BLOCK_S + self.cfg.timeout_s)
        self._tasks = [
            asyncio.create_task(self._write_loop(), name="kvroute-redis-writer"),
            asyncio.create_task(self._read_loop(), name="kvroute-redis-reader"),
        ]

    async def aclose(self) -> None:
        # The flag ends a loop whose cancellation Python 3.11's asyncio.timeout may swallow (when its
        # own deadline falls at the same moment); the wait is bounded either way.
        self._closing = True
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=READ_BLOCK_S + self.cfg.timeout_s + 0.5)
        self._tasks.clear()
        if self.up:
            # A stopping replica hands over what it has not sent, and its load drops to none at once.
            self._pods = {}
            with contextlib.suppress(*FAULTS):
                await self._flush(time.monotonic(), force_loads=True)
        for client in (self._writer, self._reader):
            if client is not None:
                with contextlib.suppress(*FAULTS):
                    async with asyncio.timeout(self.cfg.timeout_s):
                        await client.aclose()
        self._writer = self._reader = None

    # -- the request path: a deque append ------------------------------------------------------------

    def emit(self, op: Op) -> None:
        if len(self._outbox) == self._outbox.maxlen:
            self.counters["dropped_records"] += 1
        self._outbox.append(op)
        if op[0] == "d":  # a purge (rare): what was sent about the pod must not come back in a resync
            kind = "p" if op[1] == PINS else "x"
            kept = (o for o in self._ring if not (o[0] == kind and o[2] == op[2] and (kind == "p" or o[1] == op[1])))
            self._ring = deque(kept, maxlen=self._ring.maxlen)

    # -- writer ----------------------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        backoff = RETRY_MIN_S
        while not self._closing:
            await asyncio.sleep(self.cfg.flush_interval_s if self.up else backoff)
            now = time.monotonic()
            self._expire_peers(now)
            try:
                await self._flush(now, force_loads=now >= self._next_beat)
            except FAULTS as e:
                self._failed("write", e)
                backoff = min(self.cfg.retry_max_s, backoff * 2)
            except Exception:  # a bug must not end sharing for good: count it and go on
                self.counters["errors"] += 1
                log.exception("shared-state write failed")
                backoff = min(self.cfg.retry_max_s, backoff * 2)
            else:
                backoff = RETRY_MIN_S

    async def _flush(self, now: float, force_loads: bool) -> None:
        loads = self._own_loads(now, force_loads)
        if not self._outbox and loads is None:
            return
        assert self._writer is not None
        ops: list[Op] = []
        entries: list[dict[str, Any]] = []
        while self._outbox and len(entries) < ENTRIES_PER_FLUSH:
            batch = [self._pack(self._outbox.popleft()) for _ in range(min(OPS_PER_ENTRY, len(self._outbox)))]
            ops.extend(batch)
            entries.append({"o": batch})
        if loads is not None:
            if not entries:
                entries.append({})
            entries[-1]["l"] = loads
        t = time.time()
        pipe = self._writer.pipeline(transaction=False)
        pipe.exists(self.marker_key)
        for e in entries:
            e["t"] = t
            pipe.xadd(self.log_key, {"r": self.replica, "m": msgpack.packb(e)},
                      maxlen=self.cfg.log_maxlen, approximate=True)  # fmt: skip
        pipe.expire(self.log_key, self.cfg.ttl_s)
        pipe.set(self.marker_key, self._written + len(entries), ex=self.cfg.ttl_s)
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                res = await pipe.execute()
        except BaseException:
            self._requeue(ops)
            raise
        had_marker = bool(res[0])
        self._ok()
        if loads is not None:
            self._sent_loads = {ep: (n, now + s) for ep, n, s in loads}
            self._next_beat = now + self.cfg.heartbeat_s
        self.counters["sent_entries"] += len(entries)
        self.counters["sent_records"] += len(ops)
        lost = self._written > 0 and not had_marker
        self._written += len(entries)
        self._ring.extend(op for op in ops if op[0] != "d")
        if lost:
            self._resync()

    @staticmethod
    def _pack(op: Op) -> Op:
        if op[0] == "x" and not isinstance(op[3], bytes):
            return ["x", op[1], op[2], array("Q", op[3]).tobytes()]
        return op

    def _requeue(self, ops: list[Op]) -> None:
        """Put unsent ops back in front of the outbox; past its bound the oldest go."""
        pending = [*ops, *self._outbox]
        self.counters["dropped_records"] += max(0, len(pending) - (self._outbox.maxlen or 0))
        self._outbox.clear()
        self._outbox.extend(pending)

    def _resync(self) -> None:
        """Redis lost this replica's data (restarted empty): write its latest records again."""
        ring = list(self._ring)
        self._ring.clear()
        self._requeue(ring)
        self.counters["resyncs"] += 1
        log.warning(
            "redis lost the shared state (restarted empty?): writing this replica's latest records again",
            extra={"fields": {"redis": safe_url(self.cfg), "records": len(ring)}},
        )

    def _own_loads(self, now: float, force: bool) -> list[tuple[EndpointId, int, float]] | None:
        """This replica's load on each busy pod (pod, in flight, queued prefill s), if it changed
        since it was last sent (or ``force``)."""
        loads = []
        changed = force
        sent = self._sent_loads
        for ep, pod in self._pods.items():
            n, s = pod.own_load(now)
            if n or s > 0:
                loads.append((ep, n, round(s, 4)))
                old = sent.get(ep)
                if old is None or old[0] != n or abs(old[1] - (now + s)) > LOAD_EPS_S:
                    changed = True
            elif ep in sent:
                changed = True
        if not changed and len(loads) != len(sent):
            changed = True  # a pod that was busy is gone
        return loads if changed else None

    # -- reader ----------------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        backoff = RETRY_MIN_S
        while not self._closing:
            assert self._reader is not None
            try:
                async with asyncio.timeout(READ_BLOCK_S + self.cfg.timeout_s):
                    resp: Any = await self._reader.xread(
                        {self.log_key: self._last_id}, count=READ_COUNT, block=int(READ_BLOCK_S * 1000)
                    )
            except FAULTS as e:
                self._failed("read", e)
                await asyncio.sleep(backoff)
                backoff = min(self.cfg.retry_max_s, backoff * 2)
                continue
            backoff = RETRY_MIN_S
            self._ok()
            for _stream, entries in resp or ():
                for entry_id, fields in entries:
                    self._last_id = entry_id
                    try:
                        self.apply(fields)
                    except Exception as e:  # a malformed entry (or a bug) costs that entry only
                        self.counters["errors"] += 1
                        log.warning("shared-state entry skipped", extra={"fields": {"error": repr(e)}})

    def apply(self, fields: Mapping[bytes, bytes]) -> None:
        """Apply one log entry written by another replica to the local state."""
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
                    idx.record(keys, op[2])
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
        if age > self.cfg.peer_timeout_s:
            return  # replayed history: its loads are long over
        self.lags.append(age)
        peer = self._peers.get(replica)
        if peer is None:
            peer = self._peers[replica] = _Peer(seen=now)
        peer.seen = now
        if "l" in entry:
            old = peer.loads
            peer.loads = {ep: (int(n), max(0.0, float(s) - age), now) for ep, n, s in entry["l"]}
            self._apply_loads(now, old.keys() | peer.loads.keys())

    def _expire_peers(self, now: float) -> None:
        gone = [r for r, p in self._peers.items() if now - p.seen > self.cfg.peer_timeout_s]
        for r in gone:
            peer = self._peers.pop(r)
            self._apply_loads(now, peer.loads.keys())
            log.info("peer replica silent: its load no longer counts", extra={"fields": {"replica": r}})

    def _apply_loads(self, now: float, endpoints: Iterable[EndpointId]) -> None:
        for ep in endpoints:
            pod = self._pods.get(ep)
            if pod is None:
                continue
            n, s = 0, 0.0
            for peer in self._peers.values():
                got = peer.loads.get(ep)
                if got is not None:
                    n += got[0]
                    s += max(0.0, got[1] - (now - got[2]))
            pod.set_peer_load(n, s, now)

    # -- health ----------------------------------------------------------------------------------------

    def _ok(self) -> None:
        if self.up:
            return
        self.up = True
        if self._warned:
            down_s = time.monotonic() - self._down_since if self._down_since is not None else 0.0
            log.warning("redis reachable again: sharing resumed",
                        extra={"fields": {"redis": safe_url(self.cfg), "down_s": round(down_s, 1)}})  # fmt: skip
        else:
            log.info("redis connected: state shared",
                     extra={"fields": {"redis": safe_url(self.cfg), "replica": self.replica}})  # fmt: skip
        self._warned = False
        self._down_since = None

    def _failed(self, op: str, e: BaseException) -> None:
        self.counters["errors"] += 1
        if isinstance(e, TimeoutError):
            self.counters["timeouts"] += 1
        if self.up or not self._warned:
            log.warning(
                "redis unavailable: routing on this replica's own state until it returns",
                extra={"fields": {"redis": safe_url(self.cfg), "op": op, "error": f"{type(e).__name__}: {e}"}},
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


class RedisCollector(Collector):
    """``kvroute_redis_up`` (0/1, for alerts) and ``kvroute_redis{stat}`` counters and gauges."""

    def __init__(self, state: RedisState) -> None:
        self.state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        st = self.state.stats()
        yield GaugeMetricFamily("kvroute_redis_up", "1 while Redis answers: state shared with the other replicas",
                                value=st.pop("up"))  # fmt: skip
        g = GaugeMetricFamily("kvroute_redis", "Shared state through Redis: counters and gauges", labels=["stat"])
        for k, v in st.items():
            g.add_metric([k], v)
        yield g
