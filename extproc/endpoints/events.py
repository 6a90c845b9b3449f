"""Asyncio ZMQ consumers of vLLM KV events, one ordered stream per (pod, data-parallel rank).

Two topologies, both feeding a ``KVEventSink`` (the precise index):

- ``KVEventSubscriber`` (pod binds, kvroute connects): vLLM started with
  ``"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"``; one subscriber per pod connects
  its SUB socket to ``tcp://<pod-ip>:5557`` and asks ``tcp://<pod-ip>:5558`` for replays.
- ``KVEventListener`` (kvroute binds, pods connect): vLLM started with an endpoint *without* ``*``,
  e.g. ``"endpoint": "tcp://kvroute:5557"``, connects its PUB socket to our one bound SUB socket.
  A pod is then named by its topic. Convention: ``"topic": "kv@<ip:port>"`` where ``ip:port`` is the
  pod's serving address exactly as Envoy sees it (``DEFAULT_TOPIC_PREFIX`` + EndpointId); another
  mapping can be passed as ``endpoint_for_topic``.

Sequence handling (vLLM numbers batches 0, 1, 2, ... per publisher process):
- ``seq == last + 1``: apply.
- ``seq > last + 1`` (gap: HWM drop, reconnect): replay ``[last+1, seq)`` from the pod's ROUTER
  (DEALER sends ``[b"", start_seq u64 BE]``; replies ``[b"", seq, payload]`` until seq = 0xFF*8 with an
  empty payload). An answer cut short (vLLM sends its whole buffer at once; its ROUTER drops what does
  not fit the high-water marks) is asked again from the first batch missing, while each answer brings
  more. If replay is not configured, times out or stays incomplete, the pod is *resynced*: cleared in
  the sink, because the lost batches may have removed blocks we still list.
- ``seq == last`` with the same batch: a duplicate, dropped.
- ``seq < last``, or ``seq == last`` with another batch: the publisher restarted (a new process
  counts from 0, so a restart while ``last`` is 0 shows only as a different batch 0): purge the pod,
  then catch up.
- first message from a stream with ``seq > 0``: optionally catch up on ``[0, seq)`` from the replay
  buffer (whatever it still holds; the index was empty for this pod anyway).
- a message that does not decode: counted, and the pod is resynced (we cannot know what it held).

Mutations of the sink are synchronous (no awaits inside), so a single asyncio loop needs no locks.

Intake. A consumer alone waits on its socket and takes each batch as it arrives: one wake-up of the
event loop per batch per pod, each on cold CPU caches (on a 2-core VM, 0.8-1.3 ms of the loop's CPU per
one-block batch at 200 a second against ~0.1 ms decoding and applying such batches back to back:
``python -m bench.kv_fanout --shapes``). Consumers given a shared ``KVIntake`` (kvroute's: one per
process, ``kv_events.batch_window_s``) are woken together instead: the first batch to arrive on any
of their sockets starts a window, and when it ends every socket that signalled is drained, each batch
decoded and applied in order. The index learns of a block up to a window later; what kvroute itself
routed there counts meanwhile (the precise index's speculative records).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import zmq
import zmq.asyncio

from extproc.index.base import EndpointId
from extproc.kvevents.decode import (
    SEQ_BYTES,
    EventBatch,
    KVEventDecodeError,
    KVEventMessage,
    decode_message,
    decode_replay_reply,
)
from extproc.tasks import cancel_and_wait

log = logging.getLogger(__name__)

DEFAULT_TOPIC_PREFIX = b"kv@"
REPLAY_TIMEOUT_S = 1.0  # whole replay round trip; vLLM answers from memory, so this is generous
RCV_HWM = 100_000  # vLLM's PUB HWM, and 10x its replay buffer: bursts of batches must not be dropped by us
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 5_000
ERROR_BACKOFF_S = 0.2
REPLAY_YIELD_EVERY = 64  # replayed batches applied between two turns of the event loop
REPLAY_RESUMES = 16  # asks again for the rest of a replay cut short, each bringing more
# KVIntake: how long after the first batch of a quiet spell the sockets are drained (kv_events.batch_window_s's
# default), and at most how many batches one socket gives per drain before the others get their turn.
DEFAULT_WINDOW_S = 0.02
DRAIN_MAX = 256
YIELD_EVERY = 32  # batches a drain takes in between two turns of the event loop


class KVEventSink(Protocol):
    """What the consumers feed (``PreciseIndex`` implements it)."""

    def apply_batch(self, endpoint: EndpointId, batch: EventBatch) -> None: ...

    def clear_endpoint(self, endpoint: EndpointId) -> None:
        """Forget what the endpoint holds (resync / restart), keeping it known."""
        ...


@dataclass(slots=True)
class ConsumerStats:
    """Counters for observability; the server exports them (all monotonic)."""

    messages: int = 0
    batches_applied: int = 0
    events_applied: int = 0
    unknown_events: int = 0
    duplicates: int = 0
    gaps: int = 0
    replays: int = 0  # replays that delivered every missing batch
    replay_failures: int = 0
    replay_resumes: int = 0  # asks again for the rest of an answer cut short
    catch_ups: int = 0
    resyncs: int = 0  # pod cleared because batches were lost for good
    restarts: int = 0  # publisher restarted (seq went backwards)
    decode_errors: int = 0
    sink_errors: int = 0
    unknown_topics: int = 0
    socket_errors: int = 0


def endpoint_from_topic(topic: bytes, prefix: bytes = DEFAULT_TOPIC_PREFIX) -> EndpointId | None:
    """``kv@10.0.0.5:8000`` → ``10.0.0.5:8000``; None when the topic does not follow the convention."""
    if not topic.startswith(prefix):
        return None
    try:
        ep = topic[len(prefix) :].decode("ascii")
    except UnicodeDecodeError:
        return None
    host, sep, port = ep.rpartition(":")
    return ep if sep and host and port.isdigit() else None


class _Consumer:
    """Shared sequence tracking, replay and error policy for both topologies."""

    def __init__(
        self,
        sink: KVEventSink,
        ctx: zmq.asyncio.Context | None,
        replay_timeout_s: float,
        catch_up: bool,
        intake: KVIntake | None = None,
    ) -> None:
        self._sink = sink
        self._intake = intake
        self._stopped = False  # cancelled: nothing more reaches the sink
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self._replay_timeout_s = replay_timeout_s
        self._catch_up = catch_up
        # The last message applied per stream: its seq, and its batch to tell a duplicate from a
        # restarted publisher's batch of the same number.
        self._last: dict[tuple[EndpointId, int | None], KVEventMessage] = {}
        self._task: asyncio.Task[None] | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._shadow: zmq.Socket[bytes] | None = None  # the same socket, synchronous: drains without a future each
        self.counters = ConsumerStats()

    def stats(self) -> dict[str, int]:
        return asdict(self.counters)

    # -- lifecycle ---------------------------------------------------------------------------------
    def _open_sub(self, subscribe: bytes) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        sock.setsockopt(zmq.SUBSCRIBE, subscribe)
        return sock

    def _spawn(self, sock: zmq.asyncio.Socket, name: str) -> None:
        self._sock = sock
        self._shadow = zmq.Socket.shadow(sock.underlying)
        if self._intake is not None:
            self._intake.add(self)
        else:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=name)

    @property
    def running(self) -> bool:
        """Taking events in (started, not cancelled or closed)."""
        return self._sock is not None and not self._stopped

    def cancel(self) -> None:
        """Stop applying events now (``aclose`` then releases the socket): its endpoint is being purged."""
        self._stopped = True
        if self._intake is not None:
            self._intake.discard(self)
        if self._task is not None:
            self._task.cancel()

    async def aclose(self) -> None:
        self.cancel()
        task, self._task = self._task, None
        await cancel_and_wait([task])
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
            self._shadow = None
        if self._own_ctx:
            self._ctx.term()

    async def _run(self) -> None:
        assert self._sock is not None
        while True:
            try:
                frames = await self._sock.recv_multipart()
            except zmq.ZMQError as exc:
                self._socket_failed(exc)
                await asyncio.sleep(ERROR_BACKOFF_S)
                continue
            await self._on_frames(frames)

    async def drain(self, limit: int = DRAIN_MAX) -> bool:
        """Take in the batches already queued on the socket, up to ``limit``; True if more may wait."""
        shadow = self._shadow
        if shadow is None:
            return False
        for taken in range(limit):
            if self._stopped:  # (cancelled while a batch was being handled)
                return False
            try:
                if not int(shadow.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # (cheaper than raising Again)
                    return False
                frames = shadow.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            except zmq.ZMQError as exc:
                self._socket_failed(exc)
                return False
            await self._on_frames(frames)
            if taken % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)  # a long backlog must not hold requests back
        return True

    def _socket_failed(self, exc: Exception) -> None:
        self.counters.socket_errors += 1
        log.warning("kv-events socket error: %s", exc)

    async def _on_frames(self, frames: list[bytes]) -> None:
        raise NotImplementedError

    # -- sequence handling -------------------------------------------------------------------------
    async def _handle(self, endpoint: EndpointId, msg: KVEventMessage, replay_address: str | None) -> None:
        key = (endpoint, msg.batch.dp_rank)
        previous = self._last.get(key)
        last = None if previous is None else previous.seq
        seq = msg.seq
        if previous is not None and seq == previous.seq and msg.batch == previous.batch:
            self.counters.duplicates += 1
            return
        if last is not None and seq <= last:  # (equal: another batch under the same number)
            self.counters.restarts += 1
            log.info("kv-events: %s restarted (seq %d after %d): purging", endpoint, seq, last)
            self._clear(endpoint)
            last = None
        if last is None:
            if (
                seq > 0
                and self._catch_up
                and replay_address is not None
                and await self._replay(endpoint, replay_address, msg.topic, 0, seq, require_start=False)
            ):
                self.counters.catch_ups += 1
        elif seq > last + 1:
            self.counters.gaps += 1
            if replay_address is not None and await self._replay(
                endpoint, replay_address, msg.topic, last + 1, seq, require_start=True
            ):
                self.counters.replays += 1
            else:
                self.counters.resyncs += 1
                log.info("kv-events: %s lost batches %d..%d: resync", endpoint, last + 1, seq - 1)
                self._clear(endpoint)
        self._last[key] = msg
        self._apply_all(endpoint, [msg])

    def _apply_all(self, endpoint: EndpointId, msgs: Sequence[KVEventMessage]) -> bool:
        """False if the sink failed (the endpoint is then cleared)."""
        if self._stopped:  # (cancelled while a replay was awaited: the endpoint has been purged)
            return True
        for m in msgs:
            try:
                self._sink.apply_batch(endpoint, m.batch)
            except Exception:  # a sink bug must not kill the consumer; the index is then resynced
                self.counters.sink_errors += 1
                log.exception("kv-events: sink failed on a batch from %s", endpoint)
                self._clear(endpoint)
                return False
            self.counters.batches_applied += 1
            self.counters.events_applied += len(m.batch.events)
            self.counters.unknown_events += m.batch.skipped_unknown
        return True

    def _clear(self, endpoint: EndpointId) -> None:
        if self._stopped:
            return
        try:
            self._sink.clear_endpoint(endpoint)
        except Exception:
            self.counters.sink_errors += 1
            log.exception("kv-events: sink failed to clear %s", endpoint)

    def _decode_failed(self, endpoint: EndpointId | None, exc: KVEventDecodeError) -> None:
        self.counters.decode_errors += 1
        log.warning("kv-events: undecodable message from %s: %s", endpoint or "?", exc)
        if endpoint is not None:
            self.counters.resyncs += 1
            self._clear(endpoint)

    async def _replay(
        self, endpoint: EndpointId, address: str, topic: bytes, start: int, stop: int, *, require_start: bool
    ) -> bool:
        """Apply batches ``[start, stop)`` from a replay ROUTER as they arrive; True if all of them came.

        With ``require_start=False`` a contiguous tail ending at ``stop - 1`` is enough (catch-up).
        One decoded batch at a time, yielding to the loop every ``REPLAY_YIELD_EVERY``: a catch-up on
        a pod's whole buffer (10,000 batches in vLLM) held at once spiked memory by its size and
        stalled the loop for seconds. An answer cut short (vLLM sends its whole buffer at once, and its
        ROUTER drops what does not fit the high-water marks between it and this process) is asked again from
        the first batch missing, as long as each answer brings more (``REPLAY_RESUMES``). What a failed
        catch-up applied is cleared again.
        """
        expected = start if require_start else None  # the next seq a contiguous run needs
        applied = 0
        ask = start
        for _ in range(1 + REPLAY_RESUMES):
            expected, got, ended = await self._replay_once(endpoint, address, topic, ask, stop, expected)
            applied += got
            if expected is None or expected == stop or ended != "cut" or not got:
                break
            self.counters.replay_resumes += 1
            ask = expected
        complete = expected == stop
        if not complete:
            if ended != "end" or require_start or applied:  # (a catch-up that found the buffer empty did not fail)
                self.counters.replay_failures += 1
            if applied and not require_start:  # (a gap's replay failed: the caller resyncs the endpoint)
                self._clear(endpoint)
        return complete

    async def _replay_once(
        self, endpoint: EndpointId, address: str, topic: bytes, start: int, stop: int, expected: int | None
    ) -> tuple[int | None, int, str]:
        """One ask for the batches from ``start``: (the next seq still needed, batches applied, how the answer
        ended: "end" as it should, "cut" short (timed out, or batches missing), or an "error"). The timeout runs
        from each reply. A fresh DEALER per ask, so a late answer to an abandoned one can never be misread."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Room for a whole buffer: at the default high-water mark (1,000) a long answer lost its end.
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        loop = asyncio.get_running_loop()
        applied = 0
        try:
            sock.connect(address)
            await sock.send_multipart([b"", start.to_bytes(SEQ_BYTES, "big")])
            deadline = loop.time() + self._replay_timeout_s
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await sock.poll(int(remaining * 1000) + 1):
                    return expected, applied, "cut"  # (the rest, or the end marker, lost or late)
                deadline = loop.time() + self._replay_timeout_s
                msg = decode_replay_reply(await sock.recv_multipart(), topic)
                if msg is None:  # the end marker: short of stop, what was sent is lost (the buffer holds it)
                    break
                if expected is not None and expected < msg.seq < stop:
                    return expected, applied, "cut"  # batches between were dropped
                if (expected is None or msg.seq == expected) and start <= msg.seq < stop:
                    if not self._apply_all(endpoint, [msg]):
                        return expected, applied, "error"
                    applied += 1
                    expected = msg.seq + 1
                    if applied % REPLAY_YIELD_EVERY == 0:
                        await asyncio.sleep(0)
                if msg.seq >= stop - 1:
                    break
            return expected, applied, "cut" if expected is not None and expected < stop else "end"
        except KVEventDecodeError as exc:
            self.counters.decode_errors += 1
            log.warning("kv-events: undecodable replay reply from %s: %s", address, exc)
        except zmq.ZMQError as exc:
            log.warning("kv-events: replay from %s failed: %s", address, exc)
        finally:
            sock.close(linger=0)
        return expected, applied, "error"


class KVEventSubscriber(_Consumer):
    """Connects to one pod's PUB socket (and replay ROUTER); events are attributed to ``endpoint``."""

    def __init__(
        self,
        endpoint: EndpointId,
        sink: KVEventSink,
        *,
        pub_address: str,
        replay_address: str | None = None,
        topic: bytes = b"",
        ctx: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
        catch_up: bool = True,
        intake: KVIntake | None = None,
    ) -> None:
        super().__init__(sink, ctx, replay_timeout_s, catch_up, intake)
        self.endpoint = endpoint
        self.pub_address = pub_address
        self.replay_address = replay_address
        self.topic = topic

    async def start(self) -> None:
        self.connect()

    def connect(self) -> None:
        """Connect and start consuming (ZMQ connects in the background: nothing here waits)."""
        if self._task is not None:
            return
        sock = self._open_sub(self.topic)
        sock.connect(self.pub_address)
        self._spawn(sock, f"kv-events:{self.endpoint}")

    async def _on_frames(self, frames: list[bytes]) -> None:
        self.counters.messages += 1
        try:
            msg = decode_message(frames)
        except KVEventDecodeError as exc:
            self._decode_failed(self.endpoint, exc)
            return
        await self._handle(self.endpoint, msg, self.replay_address)


class KVEventListener(_Consumer):
    """Binds one SUB socket that many pods' PUB sockets connect to; the topic names the pod."""

    def __init__(
        self,
        bind_address: str,
        sink: KVEventSink,
        *,
        topic_prefix: bytes = DEFAULT_TOPIC_PREFIX,
        endpoint_for_topic: Callable[[bytes], EndpointId | None] | None = None,
        replay_address_for: Callable[[EndpointId], str | None] | None = None,
        ctx: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
        catch_up: bool = True,
        intake: KVIntake | None = None,
    ) -> None:
        super().__init__(sink, ctx, replay_timeout_s, catch_up, intake)
        self.bind_address = bind_address
        self.topic_prefix = topic_prefix
        # A custom mapping may use any topic, so only the default convention filters inside ZMQ.
        self._subscribe = topic_prefix if endpoint_for_topic is None else b""
        self._endpoint_for_topic = endpoint_for_topic or (lambda t: endpoint_from_topic(t, topic_prefix))
        self._replay_address_for = replay_address_for or (lambda ep: None)
        self.bound_address: str | None = None

    async def start(self) -> None:
        if self._task is not None:
            return
        sock = self._open_sub(self._subscribe)
        sock.bind(self.bind_address)
        self.bound_address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._spawn(sock, f"kv-events-listener:{self.bind_address}")

    async def _on_frames(self, frames: list[bytes]) -> None:
        self.counters.messages += 1
        endpoint = self._endpoint_for_topic(bytes(frames[0])) if frames else None
        if endpoint is None:
            self.counters.unknown_topics += 1
            return
        try:
            msg = decode_message(frames)
        except KVEventDecodeError as exc:
            self._decode_failed(endpoint, exc)
            return
        await self._handle(endpoint, msg, self._replay_address_for(endpoint))


class KVIntake:
    """Wakes many consumers' sockets together (module docstring, Intake): the first batch on any of them
    after a quiet spell starts a window of ``window_s``; then each socket that signalled is drained (up
    to ``DRAIN_MAX`` batches) and watched again; one that had more is drained again in the next window.
    Each drain is a task of its own: a pod whose batch waits on a replay (up to ``replay_timeout_s``, or a
    whole catch-up) holds back only its own later batches, as a consumer alone does. 0: drained as soon
    as the loop gets to it. Runs on the loop that first adds a consumer; ``aclose`` stops it."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        if window_s < 0:
            raise ValueError("window_s must be >= 0")
        self.window_s = window_s
        self._fds: dict[_Consumer, int] = {}  # consumer -> its socket's ZMQ_FD
        self._signalled: dict[_Consumer, None] = {}  # waiting for the window's drain, in the order they woke
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._drains: set[asyncio.Task[None]] = set()  # in flight (a consumer is neither watched nor due then)
        self.windows = 0  # windows drained, for observability and tests

    @property
    def consumers(self) -> tuple[_Consumer, ...]:
        """The consumers it wakes (added, not discarded)."""
        return tuple(self._fds)

    @property
    def waiting(self) -> int:
        """Consumers whose batches wait for the window's drain."""
        return len(self._signalled)

    def add(self, consumer: _Consumer) -> None:
        assert consumer._sock is not None
        self._fds[consumer] = int(consumer._sock.getsockopt(zmq.FD))
        self._watch(consumer)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-events-intake")

    def discard(self, consumer: _Consumer) -> None:
        fd = self._fds.pop(consumer, None)
        self._signalled.pop(consumer, None)
        if fd is not None:  # (not watched while signalled: removing it then is a no-op)
            asyncio.get_running_loop().remove_reader(fd)

    async def aclose(self) -> None:
        for consumer in list(self._fds):
            self.discard(consumer)
        task, self._task = self._task, None
        await cancel_and_wait([task, *self._drains])

    def _watch(self, consumer: _Consumer) -> None:
        """Watch the socket's ZMQ_FD. It signals a change, not a level: batches that came in since the
        last drain are a signal now."""
        asyncio.get_running_loop().add_reader(self._fds[consumer], self._on_signal, consumer)
        sock = consumer._shadow
        if sock is not None and int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._on_signal(consumer)

    def _on_signal(self, consumer: _Consumer) -> None:
        fd = self._fds.get(consumer)
        if fd is None or consumer in self._signalled:
            return
        asyncio.get_running_loop().remove_reader(fd)  # until drained: no wake-up per batch meanwhile
        self._signalled[consumer] = None
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            if self.window_s:
                await asyncio.sleep(self.window_s)
            self._wake.clear()
            self.windows += 1
            due = list(self._signalled)
            self._signalled.clear()
            loop = asyncio.get_running_loop()
            for consumer in due:
                task = loop.create_task(self._drain(consumer))
                self._drains.add(task)
                task.add_done_callback(self._drains.discard)

    async def _drain(self, consumer: _Consumer) -> None:
        """One window's drain of ``consumer``; then it is watched again, or due in the next window."""
        try:
            more = await consumer.drain()
        except Exception:  # a bug in one pod's intake must not stop it for good
            consumer.counters.socket_errors += 1
            log.exception("kv-events: draining a socket failed")
            more = False
        if consumer not in self._fds:  # discarded (while draining, or before its turn)
            return
        if more:
            self._signalled[consumer] = None
            self._wake.set()
        else:
            self._watch(consumer)
