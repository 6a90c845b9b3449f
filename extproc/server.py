"""The ext_proc stream state machine: one gRPC stream per HTTP request, any body mode.

Request path, by what Envoy's processing mode lets us do:
- BUFFERED: answer the headers at once (stripping client routing headers); the whole body comes in
  one message; the routing override rides on the body response (Envoy still holds the headers).
- STREAMED with ``send_body_without_waiting_for_header_response``, and FULL_DUPLEX_STREAMED: hold
  the headers answer, buffer the chunks, decide at end of stream (or at the trailers), then answer
  the headers with the override; full duplex also streams the body back in ≤ 62,000-byte chunks.
- headers with end_of_stream (no body): decide from headers alone (route id, or load).
A gateway P/D hand-off runs the prefill leg before answering: kvroute first asks Envoy to wait that
long (``override_message_timeout``; Envoy's ``max_message_timeout`` must allow it), since a queued
prefill easily outlasts the ``message_timeout`` that protects against a hung kvroute.
Precise routing encodes a prompt whose new text is long in a thread (``OFF_LOOP_CHARS``): the other
streams' messages go on meanwhile, as they do while a prefill leg runs. Before that, it tries the
prompt's heads (``ModelTokenizer.heads``: its cached first pieces, then up to each new piece): when no
pod holds all of a head's blocks, the whole prompt could match no further; when one pod does (a
conversation's history on its pod) and the decision picks it, more blocks could only add to its match.
Either way the decision is made on the head and the rest is encoded after the answer (``_complete``: in
a thread, cached for the next turn, recorded for the pod chosen) while prompts reuse text; where they do
not, it is held until a later prompt needs it (extproc/rests.py).
Response path: release the endpoint's in-flight slot at the end of the response (or the stream),
and read ``usage`` (prompt and cached tokens) from the tail of the response body.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc import envoy, h2
from extproc.errors import BodyAlreadySent, BodyTooLarge, RequestError
from extproc.request import MESSAGES_PATH, RESPONSES_PATH, InferenceRequest, dump_body
from extproc.rests import HeldRests, ReuseGauge
from extproc.rollout import ROLLOUT_METADATA
from extproc.router import Outcome, Router
from extproc.scheduling.base import WholePromptNeeded
from extproc.tokenize import ModelTokenizer, TokenPlan

log = logging.getLogger("kvroute.server")

# Precise routing encodes a prompt's uncached text in a thread from this many characters (about 2k
# tokens): a new turn or question stays on the loop, where it spares the hop; a new document leaves it.
OFF_LOOP_CHARS = 8192
# A decision is made on a head only when at least this much text would be left to encode after it (about
# 1k tokens, a millisecond or two): a shorter rest costs less encoded inline than deferred (a thread hop,
# the whole prompt keyed and recorded a second time).
DEFER_MIN_CHARS = 4096
# A head of cached pieces only (a conversation's history before its new message) is tried from this much
# new text (about 250 tokens, 0.2-0.3 ms to encode on a small host, about what deferring it costs): the
# decision then waits for no encoding at all.
CACHED_HEAD_MIN_CHARS = 1024
# Prompts decided on their head whose rest waits to be encoded, at most: past it (the host cannot keep
# up) a rest is not encoded at all; the pod's own KV events still tell the index what it holds.
DEFERRED_MAX = 8
# A decision whose new text is in a rest being encoded waits this long at most for it (a 32k-token rest
# takes tens of ms on a small host); after it, the decision goes on with what is cached.
REST_WAIT_S = 0.1
# The rests' thread runs this much nicer than the process (Linux, per thread), each rest on that one
# thread: a rest only speeds up later requests, so the event loop, Envoy and the pods sharing the
# cores come first. (Encoded in one batch, the tokenizer's pool took every core in bursts.)
REST_NICE = 10
USAGE_TAIL_BYTES = 8192  # usage sits in the last SSE chunk / at the end of a JSON body
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_INPUT_TOKENS = re.compile(rb'"input_tokens"\s*:\s*(\d+)')  # a Responses API usage's prompt
# An Anthropic Messages response's usage: the prompt is its input, cache read and cache creation tokens.
_MESSAGES_USAGE = re.compile(rb'"(input_tokens|cache_read_input_tokens|cache_creation_input_tokens)"\s*:\s*(\d+)')


def lower_thread_priority(nice: int) -> None:
    """Raise the calling thread's nice value by ``nice`` (a ThreadPoolExecutor initializer). Linux only,
    where setpriority takes a thread id; elsewhere, or if refused, the thread keeps the process's."""
    if sys.platform != "linux" or nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        log.debug("could not lower the tokenizer thread's priority", exc_info=True)


@dataclass(slots=True)
class Stream:
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | bytearray = b""  # one chunk (BUFFERED) is kept as Envoy's bytes: no copy
    full_duplex: bool = False
    hold_headers: bool = False  # the headers answer waits for the routing decision
    held_chunks: int = 0  # STREAMED chunks whose (empty) answers wait for the decision
    passed_chunks: int = 0  # STREAMED chunks already sent upstream: the body can no longer be replaced
    subset: set[str] | None = None
    strip: list[str] = field(default_factory=list)
    outcome: Outcome | None = None
    got_headers: bool = False
    decided: bool = False  # the request was answered (routed, passed on, or refused): never decide twice
    released: bool = False
    tail: bytes = b""
    upstream: str | None = None  # a shadowed request's pod, whose in-flight slot it holds
    shadow: bool = False  # the route says shadow it (ROLLOUT_METADATA on the stream)
    # The routing override the answers carry (``_routing``'s keywords), kept when the body is Envoy's own:
    # the ext_authz transports translate it as is instead of reading the answers back (envoy._Decided).
    routing: dict[str, Any] | None = None
    # The rest of a decision that waits on a prefill leg: run once its timeout override is sent.
    after: Coroutine[Any, Any, list[envoy.ProcessingResponse]] | None = None
    holding: bool = False  # its answer waits in routing.hold (``_held``)


async def _then(
    first: Coroutine[Any, Any, list[envoy.ProcessingResponse]], last: envoy.ProcessingResponse
) -> list[envoy.ProcessingResponse]:
    return [*(await first), last]


async def _held(st: Stream, out: list[envoy.ProcessingResponse], hold_s: float) -> list[envoy.ProcessingResponse]:
    """A decision's answers, sent once its pod's queued prefills should be done (routing.hold)."""
    await asyncio.sleep(hold_s)
    st.holding = False
    return out


def _route_shadows(context: grpc.aio.ServicerContext | None) -> bool:
    """Envoy's route asked to shadow this request (the stream's gRPC metadata; clients cannot set it)."""
    metadata = context.invocation_metadata() if context is not None else None
    return metadata is not None and (ROLLOUT_METADATA, "shadow") in metadata  # (key, value) pairs


class _IdleTimer:
    """Closes a stream Envoy abandoned without closing it (server.stream_idle_timeout_s), so it cannot
    hold its state (and pod slot) for good. Only the wait for Envoy's next message counts as idle.

    A message only notes the time (``rest``); the stream's ``_IdleSweeper`` looks at the note when
    due. Expiry cancels the stream's task, which ``expired`` tells from any other cancellation."""

    __slots__ = ("_cancelling", "_expired", "_sweeper", "_task", "busy", "since")

    def __init__(self, sweeper: _IdleSweeper) -> None:
        self._sweeper = sweeper
        self._task = asyncio.current_task()
        self._cancelling = self._task.cancelling() if self._task is not None else 0
        self._expired = False
        self.busy = False  # handling a message: not idle, however long that takes
        self.since = sweeper.loop.time()  # idle since
        sweeper.add(self)

    def rest(self) -> None:
        """The stream waits for Envoy's next message from now on."""
        self.busy = False
        self.since = self._sweeper.rested(self)

    def expire(self) -> None:
        if self._task is not None:
            self._expired = True
            self._task.cancel()

    def expired(self) -> bool:
        """The stream's task was cancelled by this timer alone (not also by its server)."""
        return self._expired and self._task is not None and self._task.uncancel() <= self._cancelling

    def cancel(self) -> None:
        self._sweeper.discard(self)


class H2Call:
    """``Process`` over extproc/h2.py: the same answers, given in the read callback each message comes in
    (no task or coroutine per stream or message); an answer that waits (``st.after``: a prompt encoded in
    the tokenizer thread, a prefill leg) runs as a task, the stream's later messages queued behind it.
    It is its own idle timer (``_IdleSweeper``): expiry or a reset releases what the request held."""

    __slots__ = ("_queue", "_sweeper", "_task", "busy", "ended", "ep", "since", "st", "stream")

    def __init__(self, ep: ExternalProcessor, stream: h2.GrpcStream) -> None:
        self.ep, self.stream = ep, stream
        self.st: Stream | None = None
        self._task: asyncio.Task[None] | None = None
        self._queue: list[bytes] = []  # messages that came while an answer waited
        self.ended = self.busy = False
        if (refused := ep._open_stream()) is not None:
            stream.finish(h2.RESOURCE_EXHAUSTED, refused)
            return
        self.st = Stream(shadow=stream.headers.get(ROLLOUT_METADATA) == "shadow")
        self._sweeper = ep._idle_sweeper(ep.router.config.server.stream_idle_timeout_s)
        self.since = self._sweeper.loop.time()
        self._sweeper.add(self)

    def on_message(self, data: bytes) -> None:
        if self.st is None:
            return
        if self._task is not None:
            self._queue.append(data)
            return
        self.since = self._sweeper.rested(self)
        self._handle(data)

    def _handle(self, data: bytes) -> None:
        st = self.st
        assert st is not None
        try:
            answers = self.ep.answer(st, envoy.ProcessingRequest.FromString(data))
        except Exception:
            self._failed()
            return
        send = self.stream.send
        for resp in answers:
            send(resp.SerializeToString())
        if st.after is not None:
            self.busy = True
            self._task = asyncio.get_running_loop().create_task(self._wait())

    async def _wait(self) -> None:
        st = self.st
        assert st is not None
        try:
            while st.after is not None:
                after, st.after = st.after, None
                for resp in await after:
                    self.stream.send(resp.SerializeToString())
        except asyncio.CancelledError:
            return
        except Exception:
            self._task = None
            self._failed()
            return
        self._task = None
        self.busy = False
        self.since = self._sweeper.rested(self)
        while self._queue and self._task is None and self.st is not None:
            self._handle(self._queue.pop(0))
        if self.ended and self._task is None:
            self.on_end()

    def on_end(self) -> None:
        self.ended = True
        if self._task is None and self.st is not None:
            self.stream.finish()
            self._release()

    def on_reset(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._release()

    def expire(self) -> None:
        """Idle past server.stream_idle_timeout_s: the stream ends (Envoy fails open), its state released."""
        if self.st is None:
            return
        self.ep._stream_idle(self.st)
        self.stream.finish(h2.CANCELLED, "kvroute: stream idle")
        self.on_reset()

    def _failed(self) -> None:
        """As ``Process``: never crash Envoy's request; count it, end the stream (Envoy fails open)."""
        self.ep._stream_failed(self.st)
        self.stream.finish(h2.INTERNAL, "kvroute: internal error")
        self._release()

    def _release(self) -> None:
        st, self.st = self.st, None
        if st is None:
            return
        self._sweeper.discard(self)
        self._queue.clear()
        self.ep._close_stream(st)


class _IdleSweeper:
    """The idle timers of one event loop's streams with one timeout, under one loop timer: arming and
    cancelling a loop timer per stream was ~2 % of a request's CPU in kvroute (``bench.servicer``).

    Timers sit in the order they last rested, so the first one is due first: the loop timer fires
    when it is, closes the expired, re-notes the busy (due a timeout from now, as each stream's own
    timer would), and waits for the next. With no stream left it stays armed until it fires, so a
    stream that starts meanwhile arms nothing."""

    def __init__(self, timeout_s: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.timeout_s = timeout_s
        self._timers: dict[_IdleTimer | H2Call, None] = {}  # insertion order = rest order (``since`` ascending)
        self._armed = False

    def add(self, timer: _IdleTimer | H2Call) -> None:
        self._timers[timer] = None
        if not self._armed:
            self._armed = True
            self.loop.call_at(timer.since + self.timeout_s, self._check)

    def rested(self, timer: _IdleTimer | H2Call) -> float:
        """``timer`` rests from now (returned): it moves to the back of the queue."""
        timers = self._timers
        if timer in timers:
            del timers[timer]
            timers[timer] = None
        return self.loop.time()

    def discard(self, timer: _IdleTimer | H2Call) -> None:
        self._timers.pop(timer, None)

    def _check(self) -> None:
        now = self.loop.time()
        timers = self._timers
        while timers:
            first = next(iter(timers))
            if first.since + self.timeout_s > now:
                break
            del timers[first]
            if first.busy:  # handling a message, not idle: due a timeout from now at the earliest
                first.since = now
                timers[first] = None
            else:
                first.expire()
        if timers:
            self.loop.call_at(next(iter(timers)).since + self.timeout_s, self._check)
        else:
            self._armed = False


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, router: Router) -> None:
        self.router = router
        self.metrics = router.metrics
        self._max_body = router.config.server.max_body_bytes
        self._open = 0  # streams open now (server.max_streams)
        self._sweeper: _IdleSweeper | None = None
        # One thread: long prompts are encoded one at a time (the tokenizer spreads one over its own pool).
        self._tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvroute-tokenize")
        # The rests of prompts decided on their heads: another thread, so they never delay a decision.
        self._tokenize_rest = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvroute-tokenize-rest",
                                                 initializer=lower_thread_priority, initargs=(REST_NICE,))  # fmt: skip
        self._deferred: set[asyncio.Task[None]] = set()
        self._rests: dict[str, asyncio.Task[None]] = {}  # a text being encoded in a rest -> that rest's task
        self._held = HeldRests()  # rests left unencoded while prompts reuse little (extproc/rests.py)
        self._reuse = ReuseGauge()
        self.metrics.prompt_reuse.v = self._reuse.value

    async def Process(
        self, request_iterator: AsyncIterator[envoy.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[envoy.ProcessingResponse]:
        if (refused := self._open_stream()) is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
        st = Stream(shadow=_route_shadows(context))
        idle = _IdleTimer(self._idle_sweeper(self.router.config.server.stream_idle_timeout_s))
        try:
            async for msg in request_iterator:
                idle.busy = True
                for resp in await self._on_message(st, msg):
                    yield resp
                while st.after is not None:  # an answer that waits (tokenizing, a prefill leg), then its own
                    after, st.after = st.after, None
                    for resp in await after:
                        yield resp
                idle.rest()
        except asyncio.CancelledError:
            if not idle.expired():
                raise
            self._stream_idle(st)
        except Exception:  # the stream handler must never crash Envoy's request; count and fail open
            self._stream_failed(st)
        finally:
            idle.cancel()
            self._close_stream(st)

    # -- what every stream does, over grpcio (Process) or extproc/h2.py (H2Call) ------------------

    def _open_stream(self) -> str | None:
        """Count a stream open; past server.max_streams nothing is held and the refusal's message is given
        (Envoy fails open on it: the request still goes through)."""
        limit = self.router.config.server.max_streams
        if self._open >= limit:
            self.metrics.streams_limited.labels("max_streams").inc()
            return f"kvroute: {limit} streams open"
        self._open += 1
        self.metrics.open_streams.v += 1
        return None

    def _close_stream(self, st: Stream) -> None:
        """The stream is over: what its request held is released and it is counted closed."""
        self._give_up(st)
        self.metrics.open_streams.v -= 1
        self._open -= 1

    def _give_up(self, st: Stream) -> None:
        """The stream (or Check) is over: an answer still to come that never started (``st.after`` is
        cleared as it starts) gives up the prefill leg it would have run, and what the request held is
        released."""
        after, st.after = st.after, None
        if after is not None:
            after.close()
            if st.outcome is not None:
                self.router.abandon(st.outcome)
        self.release(st)

    def _stream_idle(self, st: Stream) -> None:
        self.metrics.streams_limited.labels("idle").inc()
        log.info("ext_proc stream idle: closed", extra={"fields": {"request_id": st.headers.get("x-request-id")}})

    def _stream_failed(self, st: Stream | None) -> None:
        self.metrics.errors.labels("internal").inc()
        log.exception("ext_proc stream failed",
                      extra={"fields": {"request_id": st.headers.get("x-request-id") if st else None}})  # fmt: skip

    def h2_call(self, stream: h2.GrpcStream) -> H2Call:
        """A Process call over kvroute's own HTTP/2 server (``server.h2_port``, extproc/h2.py)."""
        return H2Call(self, stream)

    def close(self) -> None:
        """Drop the prompts still waiting to be encoded (their streams have ended by now)."""
        self._tokenize.shutdown(wait=False, cancel_futures=True)
        self._tokenize_rest.shutdown(wait=False, cancel_futures=True)
        self._held.clear()
        for task in self._deferred:
            task.cancel()

    def _idle_sweeper(self, timeout_s: float) -> _IdleSweeper:
        """The sweeper of this loop's streams; a new one when the timeout was reloaded (the streams
        open keep theirs)."""
        sw = self._sweeper
        if sw is None or sw.timeout_s != timeout_s or sw.loop is not asyncio.get_running_loop():
            sw = self._sweeper = _IdleSweeper(timeout_s)
        return sw

    # -- a whole request at once (the ext_authz transport, extproc/authz.py) ------------------------

    @property
    def max_body_bytes(self) -> int:
        return self._max_body

    def whole_request(self, headers: dict[str, str], body: bytes, subset: set[str] | None) -> Stream:
        """A stream that got ``headers`` and ``body`` in one message, as an ext_authz Check brings them."""
        st = Stream(headers=headers, body=body, subset=subset, got_headers=True)
        self._strip(st)
        return st

    def _strip(self, st: Stream) -> None:
        """The client's routing headers in ``st.headers``, to remove (and counted)."""
        st.strip = [h for h in self.router.routing_headers if h in st.headers]
        for h in st.strip:
            self.metrics.stripped.labels(h).inc()

    def decide_whole(
        self, st: Stream, body: bytes
    ) -> list[envoy.ProcessingResponse] | Coroutine[Any, Any, list[envoy.ProcessingResponse]]:
        """The decision on a ``whole_request``, as answers to a BUFFERED body: the answers when nothing
        waits (most decisions), else the coroutine that awaits the rest (a precise prompt's deferred
        tokens, a prefill leg) and gives them. A body over ``server.max_body_bytes`` is refused as the
        body message's would be."""
        if len(body) > self._max_body:
            return [self._error(st, BodyTooLarge.over(self._max_body))]
        try:
            out = self._decide(st, body, as_headers=False)
        except Exception:
            return self._whole_failed(st)
        return out if st.after is None else self._decide_rest(st, out)

    async def _decide_rest(self, st: Stream, out: list[envoy.ProcessingResponse]) -> list[envoy.ProcessingResponse]:
        try:
            while st.after is not None:
                after, st.after = st.after, None
                out = [*out, *(await after)]
        except asyncio.CancelledError:  # Envoy gave up on the Check: the request never reaches its pod
            self._give_up(st)
            raise
        except Exception:
            return self._whole_failed(st)
        return out

    def _whole_failed(self, st: Stream) -> list[envoy.ProcessingResponse]:
        """As a stream's handler: never fail the request, count it and pass it on unrouted."""
        self.metrics.errors.labels("internal").inc()
        log.exception("ext_authz decision failed", extra={"fields": {"request_id": st.headers.get("x-request-id")}})
        self.release(st)
        st.routing = None
        return [envoy.request_body_response()]

    # -- one message in, zero or more answers out ------------------------------------------------

    async def _on_message(self, st: Stream, msg: envoy.ProcessingRequest) -> list[envoy.ProcessingResponse]:
        # The one coroutine per message (a handler may wait); what it calls is synchronous, as a decision
        # never waits (a prefill leg runs after its answer, as ``st.after``): no coroutine per level.
        return self.answer(st, msg)

    def answer(self, st: Stream, msg: envoy.ProcessingRequest) -> list[envoy.ProcessingResponse]:
        """One message's answers; what waits (``st.after``) is the caller's to run, then send."""
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            return self._on_request_headers(st, msg)
        if kind == "request_body":
            return self._on_request_body(st, msg.request_body.body, msg.request_body.end_of_stream)
        if kind == "request_trailers":
            out = self._finish_request(st, trailers=True) if not st.decided and st.hold_headers else []
            if st.after is not None:  # the trailers' answer must follow the decision's
                st.after = _then(st.after, envoy.request_trailers_response())
                return out
            return [*out, envoy.request_trailers_response()]
        if kind == "response_headers":
            return [self._on_response_headers(st, msg)]
        if kind == "response_body":
            self._on_response_chunk(st, msg.response_body.body, msg.response_body.end_of_stream)
            return [envoy.response_body_response()]
        if kind == "response_trailers":
            self._on_response_chunk(st, b"", True)
            return [envoy.response_trailers_response()]
        return []

    def _on_request_headers(self, st: Stream, msg: envoy.ProcessingRequest) -> list[envoy.ProcessingResponse]:
        if st.got_headers or st.decided:  # a second headers message (never from Envoy): the first request stands
            return [envoy.request_headers_response()]
        st.got_headers = True
        st.headers = envoy.read_headers(msg.request_headers)
        st.full_duplex, no_wait = envoy.body_modes(msg)
        st.subset = envoy.subset_hint(msg)
        self._strip(st)
        if msg.request_headers.end_of_stream:
            return self._decide(st, None, as_headers=True)
        if st.full_duplex or no_wait:
            st.hold_headers = True
            return []
        return [envoy.request_headers_response(remove=st.strip)]

    def _on_request_body(self, st: Stream, chunk: bytes, end: bool) -> list[envoy.ProcessingResponse]:
        if st.decided:  # decided already (e.g. an error answered, or body after end_of_stream); pass through
            return [envoy.request_body_response()]
        if not st.body:
            st.body = chunk
        elif chunk:
            if isinstance(st.body, bytes):  # a second chunk: only now gather into a buffer
                st.body = bytearray(st.body)
            st.body += chunk
        if len(st.body) > self._max_body:
            return [self._error(st, BodyTooLarge.over(self._max_body))]
        if end:
            return self._finish_request(st, trailers=False)
        if st.full_duplex:
            return []
        if st.hold_headers:
            st.held_chunks += 1
            return []
        st.passed_chunks += 1
        return [envoy.request_body_response()]

    def _finish_request(self, st: Stream, trailers: bool) -> list[envoy.ProcessingResponse]:
        body = st.body if isinstance(st.body, bytes) else bytes(st.body)
        return self._decide(st, body, as_headers=st.hold_headers, trailers=trailers)

    # -- the decision and how it is sent ------------------------------------------------------------

    def _decide(
        self, st: Stream, body: bytes | None, as_headers: bool, trailers: bool = False
    ) -> list[envoy.ProcessingResponse]:
        h = st.headers
        st.decided = True
        started = time.perf_counter()
        new_body: bytes | None = None  # the body kvroute rewrote (tenancy's cache_salt), sent in place of the client's
        try:
            req = self.router.parse(h.get(":path", "/"), h.get(":method", "GET"), h, body)
            if req.rewritten and req.body is not None:
                if st.passed_chunks:
                    raise BodyAlreadySent("kvroute must rewrite this request's body, but its first chunks went "
                                          "upstream already (use BUFFERED, or STREAMED with "
                                          "send_body_without_waiting_for_header_response)")  # fmt: skip
                new_body = dump_body(req.body)
            planned = self.router.token_plan(req)
        except RequestError as err:
            return [self._error(st, err)]
        except Exception:
            return self._unrouted(st, new_body, body, as_headers, trailers)
        if planned is not None:
            self._note_reuse(planned[1])
        if (
            planned is not None
            and self._rests
            and (waits := {self._rests[t] for t in planned[1].missing if t in self._rests})
        ):
            # Another request's rest is being encoded: these texts are on their way into the cache, and
            # its keys into the index. Wait for them (a few ms) rather than decide on less of the prompt.
            self.metrics.tokenize_deferred.labels("waited").inc()
            st.after = self._after_rests(waits, st, req, started, body, new_body, as_headers, trailers)
            return []
        return self._decide_planned(st, req, planned, started, body, new_body, as_headers, trailers)

    def _note_reuse(self, plan: TokenPlan) -> None:
        """How much of this prompt was known before it came (``ReuseGauge``); held rests holding its new
        text are encoded now (the wait for rests being encoded, in ``_decide``, then covers them)."""
        missing, held, rests = plan.missing, self._held, self._rests
        new = plan.missing_chars
        if missing and (held or rests):
            new -= held.known(missing) + sum(len(t) for t in missing if t in rests)
            if held:
                for start in held.take(missing):
                    self.metrics.tokenize_deferred.labels("asked").inc()
                    start()
        self._reuse.note(plan.chars - new, plan.chars)
        self.metrics.prompt_reuse.v = self._reuse.value

    async def _after_rests(
        self, waits: set[asyncio.Task[None]], st: Stream, req: InferenceRequest, started: float, body: bytes | None,
        new_body: bytes | None, as_headers: bool, trailers: bool,
    ) -> list[envoy.ProcessingResponse]:  # fmt: skip
        await asyncio.wait(waits, timeout=REST_WAIT_S)
        return self._decide_planned(st, req, self.router.token_plan(req), started, body, new_body, as_headers,
                                    trailers)  # fmt: skip

    def _decide_planned(
        self, st: Stream, req: InferenceRequest, planned: tuple[ModelTokenizer, TokenPlan] | None, started: float,
        body: bytes | None, new_body: bytes | None, as_headers: bool, trailers: bool,
    ) -> list[envoy.ProcessingResponse]:  # fmt: skip
        """The decision once the prompt's tokenizing is planned: on a head, on the whole prompt inline or
        in the tokenizer thread, or (no plan) as ``route`` keys it."""
        ids: Sequence[int] | None = None
        if planned is not None:
            tok, plan = planned
            encoded: dict[str, Sequence[int]] = {}  # the heads' texts, encoded on the loop
            for head in tok.heads(plan):
                least = DEFER_MIN_CHARS if head.missing else CACHED_HEAD_MIN_CHARS
                if head.missing_chars >= OFF_LOOP_CHARS or plan.missing_chars - head.missing_chars < least:
                    break  # that much is for the thread; or what a head would spare is cheaper than deferring it
                if head.missing and not encoded and (probe := tok.probe(plan)) is not None:
                    # Before the first text's whole chunk, its start: where no pod holds that, nothing more
                    # can match (a new prompt), and the decision needs no more encoded.
                    try:
                        return self._route_head(st, req, tok, plan, probe, tok.encode_missing(probe), started,
                                                body, new_body, as_headers, trailers)  # fmt: skip
                    except WholePromptNeeded:
                        pass  # a pod holds it: the heads as they come
                    except Exception:
                        break
                try:
                    encoded.update(tok.encode_missing(head.without(encoded)))
                except Exception:
                    break  # the whole prompt's path meets the fault again, counts it and routes approximately
                try:
                    return self._route_head(st, req, tok, plan, head, encoded, started, body, new_body, as_headers,
                                            trailers)  # fmt: skip
                except WholePromptNeeded:
                    continue  # a pod may hold blocks past this head: one more piece
            rest = plan.without(encoded)
            if rest.missing_chars >= OFF_LOOP_CHARS:
                self.metrics.tokenize_off_loop.inc()
                st.after = self._route_tokenized(st, req, tok, plan, encoded, started, body, new_body, as_headers,
                                                 trailers)  # fmt: skip
                return []
            try:
                ids = tok.finish(plan, {**encoded, **tok.encode_missing(rest)})
            except Exception:  # route encodes again and, on failure, counts it and routes approximately
                ids = None
        return self._route(st, req, ids, started, body, new_body, as_headers, trailers)

    def _route_head(
        self, st: Stream, req: InferenceRequest, tok: ModelTokenizer, plan: TokenPlan, head: TokenPlan,
        encoded: dict[str, Sequence[int]], started: float, body: bytes | None, new_body: bytes | None,
        as_headers: bool, trailers: bool,
    ) -> list[envoy.ProcessingResponse]:  # fmt: skip
        """The decision on the prompt's head, its texts in ``encoded`` (WholePromptNeeded, with nothing
        recorded, when a pod may hold more), the rest encoded and recorded once the answer is on its way."""
        ids = tok.finish(head, encoded)
        estimate = tok.estimate_tokens(plan, head, len(ids), encoded)
        out = self._route(st, req, ids, started, body, new_body, as_headers, trailers, head_tokens=estimate)
        outcome = st.outcome
        if outcome is not None and outcome.keys is not None and outcome.keys.precise and outcome.arm == "enforced":
            rest = plan.without(encoded)
            if not self._reuse.eager and rest.missing:
                start = partial(self._start_rest, tok, plan, rest, dict(encoded), st)
                self.metrics.tokenize_deferred.labels("held").inc()
                if dropped := self._held.hold(list(rest.missing), rest.missing_chars, start):
                    self.metrics.tokenize_deferred.labels("dropped").inc(dropped)
            elif len(self._deferred) >= DEFERRED_MAX:
                self.metrics.tokenize_deferred.labels("skipped").inc()
            else:
                self._start_rest(tok, plan, rest, dict(encoded), st)
        return out

    def _start_rest(
        self, tok: ModelTokenizer, plan: TokenPlan, rest: TokenPlan, head_encoded: dict[str, Sequence[int]], st: Stream
    ) -> None:
        """Encode and record a head-decided prompt's rest (``_complete``), its texts in ``_rests`` meanwhile."""
        task = asyncio.get_running_loop().create_task(self._complete(tok, plan, rest, head_encoded, st))
        self._deferred.add(task)
        texts = list(rest.missing)
        self._rests.update(dict.fromkeys(texts, task))
        task.add_done_callback(lambda done: self._forget_rest(done, texts))

    def _forget_rest(self, task: asyncio.Task[None], texts: list[str]) -> None:
        self._deferred.discard(task)
        for t in texts:
            if self._rests.get(t) is task:
                del self._rests[t]

    async def _complete(
        self,
        tok: ModelTokenizer,
        plan: TokenPlan,
        rest: TokenPlan,
        head_encoded: Mapping[str, Sequence[int]],
        st: Stream,
    ) -> None:
        """A head-decided prompt's rest: encoded in a thread, every piece cached (the next turn finds
        them), its blocks recorded for the pods the request went to (``st.outcome`` by then: a P/D
        redirect may have moved it), as a whole-prompt decision does."""
        try:
            encoded = await asyncio.get_running_loop().run_in_executor(
                self._tokenize_rest, partial(tok.encode_missing, rest, one_thread=True)
            )
            ids = tok.finish(plan, {**head_encoded, **encoded})
            if st.outcome is not None:
                st.outcome = self.router.record_whole(st.outcome, ids)
        except Exception:  # shut down meanwhile, or a tokenizer fault: the pods' KV events still come
            self.metrics.tokenize_deferred.labels("failed").inc()
            log.debug("a deferred prompt's rest was not encoded", exc_info=True)
        else:
            self.metrics.tokenize_deferred.labels("recorded").inc()

    async def _route_tokenized(
        self, st: Stream, req: InferenceRequest, tok: ModelTokenizer, plan: TokenPlan,
        encoded: dict[str, Sequence[int]], started: float, body: bytes | None, new_body: bytes | None,
        as_headers: bool, trailers: bool,
    ) -> list[envoy.ProcessingResponse]:  # fmt: skip
        """The whole prompt's decision, what ``encoded`` lacks of it encoded in the tokenizer thread."""
        try:
            loop = asyncio.get_running_loop()
            more = await loop.run_in_executor(self._tokenize, tok.encode_missing, plan.without(encoded), True)
            ids: Sequence[int] | None = tok.finish(plan, {**encoded, **more})
        except Exception:  # e.g. the pool shut down: route encodes inline (and on failure, counts it, routes approx)
            ids = None
        return self._route(st, req, ids, started, body, new_body, as_headers, trailers)

    def _route(
        self, st: Stream, req: InferenceRequest, ids: Sequence[int] | None, started: float, body: bytes | None,
        new_body: bytes | None, as_headers: bool, trailers: bool, head_tokens: int | None = None,
    ) -> list[envoy.ProcessingResponse]:  # fmt: skip
        try:
            st.outcome = outcome = self.router.route(req, st.subset, shadow=st.shadow, token_ids=ids, started=started,
                                                     head_tokens=head_tokens, defer_record=True)  # fmt: skip
            self._settle_soon()
            if outcome.pd is not None and outcome.pd.split and outcome.pd.handoff == "gateway":
                st.after = self._after_prefill(st, outcome, body, new_body, as_headers, trailers)
                wait_s = self.router.config.pd_for(req.model).prefill_timeout_s + envoy.WAIT_MARGIN_S
                return [envoy.message_timeout_override(wait_s)]
            kwargs = self._routing(st, outcome, new_body)
        except WholePromptNeeded:
            raise
        except RequestError as err:
            return [self._error(st, err)]
        except Exception:
            return self._unrouted(st, new_body, body, as_headers, trailers)
        out = self._answer(st, kwargs, new_body, body, as_headers, trailers)
        if outcome.hold_s:
            self.metrics.hold_seconds.observe(outcome.hold_s)
            st.holding, st.after = True, _held(st, out, outcome.hold_s)
            # Envoy's message_timeout may be under the hold (its own default: 200 ms); kvroute's Envoy
            # configs allow longer (max_message_timeout), others ignore this and keep theirs.
            return [envoy.message_timeout_override(outcome.hold_s + envoy.WAIT_MARGIN_S)]
        return out

    def _settle_soon(self) -> None:
        """The index learns where the prompt just decided went once its answer is on its way (the next
        decision settles it first if it comes sooner): the answer does not wait on that bookkeeping."""
        try:
            asyncio.get_running_loop().call_soon(self.router.settle)
        except RuntimeError:  # no event loop running (a synchronous caller): at once
            self.router.settle()

    def _unrouted(
        self, st: Stream, new_body: bytes | None, body: bytes | None, as_headers: bool, trailers: bool
    ) -> list[envoy.ProcessingResponse]:
        """A bug must not cost the request: answer without an override, Envoy's fallback route (round
        robin over the pool) takes it."""
        self.metrics.errors.labels("internal").inc()
        log.exception("routing failed; passing the request on unrouted",
                      extra={"fields": {"request_id": st.headers.get("x-request-id")}})  # fmt: skip
        kwargs: dict[str, Any] = {"remove": st.strip}
        if new_body is not None and "content-length" in st.headers:
            kwargs["set_headers"] = {"content-length": str(len(new_body))}
        return self._answer(st, kwargs, new_body, body, as_headers, trailers)

    async def _after_prefill(
        self, st: Stream, outcome: Outcome, body: bytes | None, rewritten: bytes | None, as_headers: bool,
        trailers: bool,
    ) -> list[envoy.ProcessingResponse]:  # fmt: skip
        new_body = await self._prefill(st, outcome)
        if new_body is not None:  # the KV is ready: the decode pod may be re-picked before it is named
            st.outcome = outcome = self.router.redirect(outcome)
        else:  # a local prefill: the request as kvroute rewrote it, if it did
            new_body = rewritten
        return self._answer(st, self._routing(st, outcome, new_body), new_body, body, as_headers, trailers)

    @staticmethod
    def _routing(st: Stream, outcome: Outcome, new_body: bytes | None) -> dict[str, Any]:
        """The routing override: the pick's headers (and metadata), the client's routing headers removed."""
        set_headers = outcome.set_headers  # read only (as the answer is built): copied only to add to it
        if new_body is not None and "content-length" in st.headers:
            set_headers = {**set_headers, "content-length": str(len(new_body))}
        return {
            "set_headers": set_headers,
            # Envoy applies removals after sets: never remove what this answer sets.
            "remove": [x for x in st.strip if x not in set_headers],
            "clear_route_cache": outcome.clear_route_cache,
            "metadata": outcome.metadata,
        }

    @staticmethod
    def _answer(
        st: Stream, kwargs: dict[str, Any], new_body: bytes | None, body: bytes | None, as_headers: bool,
        trailers: bool,
    ) -> list[envoy.ProcessingResponse]:  # fmt: skip
        """The decision as the body mode wants it: on the body answer, or on the held headers answer
        (then the held chunks' answers, or the whole body streamed back in full duplex)."""
        if not as_headers:
            if new_body is None:
                st.routing = kwargs
            return [envoy.request_body_response(**kwargs, body=new_body)]
        out = [envoy.request_headers_response(**kwargs)]
        if st.full_duplex and body is not None:
            out.extend(envoy.streamed_body(new_body if new_body is not None else body, end_of_stream=not trailers))
            return out
        # STREAMED, held: one answer per held chunk; a replaced body rides on the first, the rest are emptied.
        for i in range(st.held_chunks + (body is not None and not trailers)):
            if new_body is None:
                out.append(envoy.request_body_response())
            else:
                out.append(envoy.request_body_response(body=new_body if i == 0 else None, clear_body=i > 0))
        return out

    async def _prefill(self, st: Stream, outcome: Outcome) -> bytes | None:
        """Gateway P/D hand-off; None means the decode pod prefills locally (never a client error)."""
        if st.passed_chunks:
            self.metrics.pd_decisions.labels("fallback-local", "body-already-sent").inc()
            return None
        try:
            return await self.router.prefill(outcome)
        except Exception:
            self.metrics.errors.labels("internal").inc()
            log.exception("prefill leg failed", extra={"fields": {"request_id": outcome.request.request_id}})
            return None

    def _error(self, st: Stream, err: RequestError) -> envoy.ProcessingResponse:
        self.metrics.errors.labels(err.kind).inc()
        log.info(
            "rejected",
            extra={
                "fields": {
                    "request_id": st.headers.get("x-request-id"),
                    "status": err.status,
                    "kind": err.kind,
                    "error": err.message,
                }
            },
        )
        st.released = True  # nothing was acquired
        st.outcome = None
        st.decided = True
        return envoy.immediate(err.status, err.message, err.error_type, err.param)

    # -- response path -------------------------------------------------------------------------------

    def _on_response_headers(self, st: Stream, msg: envoy.ProcessingRequest) -> envoy.ProcessingResponse:
        """Envoy names the pod it used (rollout.upstream_header): a shadowed request's load and prefix
        are recorded there, agreement is counted; the header is not for clients unless configured."""
        rollout = self.router.config.rollout
        headers = envoy.read_headers(msg.response_headers)
        upstream = headers.get(rollout.upstream_header)
        if st.outcome is not None and not st.released:
            st.upstream = self.router.observe_upstream(st.outcome, upstream)
        if msg.response_headers.end_of_stream:
            self.release(st)
        hide = upstream is not None and not rollout.expose_upstream_header
        return envoy.response_headers_response(remove=[rollout.upstream_header] if hide else None)

    def _on_response_chunk(self, st: Stream, chunk: bytes, end: bool) -> None:
        if chunk:
            st.tail = (st.tail + chunk)[-USAGE_TAIL_BYTES:]
        if end:
            if st.outcome is not None and st.tail:
                self.router.report_usage(st.outcome, *_usage(st.tail, st.outcome.request.path))
            self.release(st)

    def release(self, st: Stream) -> None:
        if not st.released and st.outcome is not None:
            st.released = True
            if st.holding:  # ended while held: the request never reached its pod
                st.holding = False
                self.router.unhold(st.outcome)
            if st.outcome.acquired:
                self.router.release(st.outcome.endpoint, st.outcome.local_prefill)
            if st.upstream is not None:
                self.router.release(st.upstream)


def _usage(tail: bytes, path: str) -> tuple[int | None, int | None]:
    """A response's prompt and cached tokens, from its last bytes (the last value of each, streamed or not):
    OpenAI's prompt_tokens (input_tokens in the Responses API) and cached_tokens; Anthropic's input, cache read
    and cache creation tokens."""
    if path == MESSAGES_PATH:
        last = {k: int(v) for k, v in _MESSAGES_USAGE.findall(tail)}
        if b"input_tokens" not in last:
            return None, None
        return sum(last.values()), last.get(b"cache_read_input_tokens")
    p = (_INPUT_TOKENS if path == RESPONSES_PATH else _PROMPT_TOKENS).findall(tail)
    c = _CACHED_TOKENS.findall(tail)
    return (int(p[-1]) if p else None), (int(c[-1]) if c else None)
