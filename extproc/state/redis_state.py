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
number per replica (entries it wrote at its last heartbeat), which tells it whether Redis lost its
data; the marker and the stream's expiry are checked and renewed with the heartbeat (a flush between
two is one XADD). The hash tag
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
from typing import Any, ClassVar

import msgpack
from redis.exceptions import RedisError

from extproc.config import RedisConfig
from extproc.state.client import RedisClient, make_client, safe_url
from extproc.state.replicated import PINS, RETRY_MIN_S, Batch, ReplicatedState, StateCollector, log

READ_COUNT = 200  # entries applied between two awaits: a replayed log does not stall decisions
READ_BLOCK_S = 1.0  # XREAD BLOCK: also how soon a silent (paused) Redis is noticed by the reader
FAULTS = (RedisError, OSError, TimeoutError)

__all__ = ["FAULTS", "PINS", "RedisCollector", "RedisState"]

RedisCollector = StateCollector  # kvroute_redis_up, kvroute_redis{stat}


class RedisState(ReplicatedState):
    kind = "redis"
    faults: ClassVar[tuple[type[BaseException], ...]] = FAULTS

    def __init__(self, cfg: RedisConfig, replica: str | None = None) -> None:
        assert cfg.url is not None
        super().__init__(cfg, replica)
        self.log_key = f"{cfg.key_prefix}{{log}}"
        self.marker_key = f"{self.log_key}:replica:{self.replica}"
        self._written = 0  # entries this replica wrote (its marker's value)
        self._last_id: bytes | str = "0-0"
        self._writer: RedisClient | None = None
        self._reader: RedisClient | None = None

    def _where(self) -> dict[str, Any]:
        return {"redis": safe_url(self.cfg)}

    async def start(self) -> None:
        # The reader's socket waits out a blocking XREAD; the writer's gives up after timeout_s.
        self._writer = make_client(self.cfg, self.cfg.timeout_s)
        self._reader = make_client(self.cfg, READ_BLOCK_S + self.cfg.timeout_s)
        self._start_loops()

    async def aclose(self) -> None:
        await self._stop_loops(READ_BLOCK_S + self.cfg.timeout_s + 0.5)
        if self.up:
            await self._hand_over()
        for client in (self._writer, self._reader):
            if client is not None:
                with contextlib.suppress(*FAULTS):
                    async with asyncio.timeout(self.cfg.timeout_s):
                        await client.aclose()
        self._writer = self._reader = None

    # -- writer ----------------------------------------------------------------------------------------

    async def _flush(self, now: float, force_loads: bool) -> None:
        batch = self._batch(now, force_loads)
        if batch is None:
            return
        assert self._writer is not None
        # The marker and the stream's expiry with the heartbeat (and the first write) only: at a flush
        # every few ms, three more commands each time cost more than the XADD.
        beat = force_loads or self._written == 0
        pipe = self._writer.pipeline(transaction=False)
        if beat:
            pipe.exists(self.marker_key)
        for e in batch.entries:
            pipe.xadd(self.log_key, {"r": self.replica, "m": msgpack.packb(e)},
                      maxlen=self.cfg.log_maxlen, approximate=True)  # fmt: skip
        if beat:
            pipe.expire(self.log_key, self.cfg.ttl_s)
            pipe.set(self.marker_key, self._written + len(batch.entries), ex=self.cfg.ttl_s)
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                res = await pipe.execute()
        except BaseException:
            self._requeue(batch.ops)
            raise
        self._sent(batch, now, had_marker=bool(res[0]) if beat else True)

    def _sent(self, batch: Batch, now: float, had_marker: bool) -> None:
        self._delivered(batch, now)
        lost = self._written > 0 and not had_marker
        self._written += len(batch.entries)
        if lost:
            self._resync()

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
                    self._apply_safely(fields)
