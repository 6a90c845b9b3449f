"""The ext_authz transport: one unary Check per request instead of an ext_proc stream, and Envoy's gRPC
access log to learn when each request ended.

Why: an ext_proc stream per request, with a headers and a body message, is most of what a Python
processor costs (bench/overhead.py's floor); Envoy's ext_authz filter sends the request's headers and
whole body (``with_request_body``) in one unary call, and the do-nothing server's floor drops by a third
to a half (bench/RESULTS.md, The ext_authz transport). ``kvroute envoy-config --api ext_authz`` writes that Envoy.

The decision is ExternalProcessor's own, on a stream that gets the whole request at once: the same
parsing, tokenizing, scheduling, errors and metrics. Only the answer is translated
(``envoy.check_answer``): the routing headers are added to the request, the EPP fallback list becomes
the filter's dynamic metadata (the pool's override_host reads it under ``envoy.filters.http.ext_authz``),
a refusal (bad JSON, unknown model) is the denied answer with the same OpenAI-shaped body.

What an ext_authz answer cannot carry: a replaced body. A request whose decision rewrites it
(tenancy's ``cache_salt``, P/D's ``kv_transfer_params``) is refused (501; 403 over HTTP, where Envoy
takes a 5xx for the server's failure and would fail open) rather than sent without it; ``envoy-config``
refuses P/D clusters, shadow routes and response reading with ext_authz.

The end of a request: ext_proc's stream ends with it; a Check does not. Envoy's access log
(``envoy.access_loggers.http_grpc``, batched every ``buffer_flush_interval``) reports each finished
request by its x-request-id, and its pod slot is released then (``AccessLog``). A request whose entry
never comes (the log stream lost, Envoy restarted) is released ``server.stream_idle_timeout_s`` after
its decision, as an ext_proc stream Envoy abandoned is closed.

Over HTTP (``server.authz_http_port``, ``envoy-config --api ext_authz_http``) the same Check comes as an
HTTP/1.1 request: the client's method, path, headers and body, answered 200 with the routing headers
(the EPP fallback list in ``x-kvroute-endpoints``, which Envoy turns into the filter's metadata) or with
the refusal. A 5xx refusal (503: no pod ready) reads to Envoy as the server failing: it fails open, and
the pool's own balancing takes the request. No gRPC on that path at all: a do-nothing HTTP answer
costs Envoy's hop a fraction of a Check's (bench/RESULTS.md, The ext_authz transport). The access log
still comes over gRPC (batched).

One process per Envoy: a request's log entry reaches whichever kvroute process Envoy's log stream goes
to. With ``--workers N`` or replicas, that is often not the one that routed it, which then holds the
slot until the timeout (``kvroute_authz_access_log_entries_total{result="unknown"}`` counts entries for
requests another process holds); kvroute warns once when it serves Checks so. Run those on ext_proc.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar, cast

import grpc
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.auth.v3 import external_auth_pb2_grpc as authz_grpc

from extproc import envoy
from extproc.errors import BodyTooLarge
from extproc.observability import WORKER_ENV, Metrics
from extproc.server import ExternalProcessor, Stream

log = logging.getLogger("kvroute.authz")

T = TypeVar("T")
REWRITE_REFUSED = (
    "kvroute must rewrite this request's body (tenancy.cache_salt, P/D's kv_transfer_params), which Envoy's "
    "ext_authz filter cannot; run kvroute behind the ext_proc filter for it"
)


class Pending:
    """Decided requests holding a pod slot, by x-request-id, until the access log reports them done
    or ``timeout_s`` passes (oldest first: a dict keeps the order they were decided in)."""

    def __init__(self, ep: ExternalProcessor) -> None:
        self._ep = ep
        self._streams: dict[str, tuple[float, Stream]] = {}
        self._sweeping: asyncio.TimerHandle | None = None
        # The loop holding began on: asyncio.get_running_loop() checks the process id (a system call) each time.
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return len(self._streams)

    def hold(self, request_id: str, st: Stream) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        old = self._streams.pop(request_id, None)
        if old is not None:  # an id seen twice (a client's own x-request-id reused): the first is over
            self._ep.release(old[1])
        self._streams[request_id] = (loop.time(), st)
        if self._sweeping is None:
            self._arm(loop, self._timeout())

    def done(self, request_id: str) -> bool:
        held = self._streams.pop(request_id, None)
        if held is None:
            return False
        self._ep.release(held[1])
        return True

    def release_all(self) -> None:
        for _, st in self._streams.values():
            self._ep.release(st)
        self._streams.clear()
        if self._sweeping is not None:
            self._sweeping.cancel()
            self._sweeping = None

    def _timeout(self) -> float:
        return self._ep.router.config.server.stream_idle_timeout_s

    def _arm(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        self._sweeping = loop.call_later(delay, self._sweep)

    def _sweep(self) -> None:
        self._sweeping = None
        loop = asyncio.get_running_loop()
        timeout = self._timeout()
        now = loop.time()
        streams = self._streams
        while streams:
            rid, (since, st) = next(iter(streams.items()))
            if since + timeout > now:
                self._arm(loop, since + timeout - now)
                return
            del streams[rid]
            self._ep.release(st)
            self._ep.metrics.streams_limited.labels("authz_unlogged").inc()
            log.info("no access log entry for a routed request: its pod slot released",
                     extra={"fields": {"request_id": rid}})  # fmt: skip


class Authorizer(authz_grpc.AuthorizationServicer):
    """``Check``: the request's decision, answered as ext_authz's OK (routed) or denied (refused)."""

    def __init__(self, ep: ExternalProcessor, pending: Pending) -> None:
        self.ep = ep
        self.pending = pending
        self._warned = False

    def _warn_if_shared(self) -> None:
        """Once: Checks served by one of several processes (workers, replicas) whose slots the access log
        cannot reliably release (the module docstring)."""
        self._warned = True
        if os.environ.get(WORKER_ENV) or self.ep.router.state.peers():
            log.warning("ext_authz Checks served by one of several kvroute processes (workers or replicas): "
                        "Envoy's access log may report a request to another process, which leaves its pod slot "
                        "held until server.stream_idle_timeout_s; use the ext_proc transport there")  # fmt: skip

    async def Check(self, request: envoy.CheckRequest, context: grpc.aio.ServicerContext) -> envoy.CheckResponse:
        if not self._warned:
            self._warn_if_shared()
        headers, body = envoy.read_check(request)
        subset = envoy.subset_hint(request.attributes)
        got = _decided(self.ep, self.pending, headers, body, subset, envoy.check_answer, 501)
        return await got if isinstance(got, Coroutine) else got


class AccessLog(als_pb2_grpc.AccessLogServiceServicer):
    """Envoy's access log stream: every finished request's pod slot released."""

    def __init__(self, pending: Pending, metrics: Metrics) -> None:
        self.pending = pending
        self._released = metrics.authz_logged.labels("released")
        self._unknown = metrics.authz_logged.labels("unknown")

    async def StreamAccessLogs(
        self, request_iterator: AsyncIterator[envoy.AccessLogs], context: grpc.aio.ServicerContext
    ) -> envoy.AccessLogsResponse:
        async for msg in request_iterator:
            for rid in envoy.finished_request_ids(msg):
                (self._released if self.pending.done(rid) else self._unknown).inc()
        return envoy.AccessLogsResponse()


# An Envoy authorization request's head (request line and headers) may be this long at most.
HTTP_HEAD_MAX = 64 * 1024


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _parse_head(head: bytes | bytearray) -> tuple[str, str, dict[str, str]]:
    """(method, target, lower-cased headers; repeats joined with ', ') of a request head ending in CRLFCRLF."""
    try:
        text = head.decode("utf-8", "replace")  # as ext_proc's header values are read (envoy.read_headers)
        request_line, *lines = text[:-4].split("\r\n")
        method, target, version = request_line.split(" ")
    except ValueError:
        raise _BadRequest(400, "malformed request line") from None
    if not version.startswith("HTTP/1."):
        raise _BadRequest(400, f"unsupported protocol {version[:16]!r}")
    headers: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise _BadRequest(400, "malformed header line")
        key, value = name.lower(), value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return method, target, headers


class HttpAuthzServer:
    """An HTTP/1.1 server for Envoy's ext_authz requests: each request (method, target, lower-cased
    headers, whole body by content-length) handed to ``answer``, whose bytes are the response.
    Connections are kept alive; Envoy does not pipeline, but a connection's requests are answered in
    order, one at a time, whatever arrives. What cannot be read (a chunked body, a head over
    HTTP_HEAD_MAX, a body over ``max_body``) is answered with its status and the connection closed.

    A protocol, not asyncio streams: a request is parsed in the callback its bytes arrive in, without a
    reader's buffers and wake-ups per read (the do-nothing answer behind Envoy costs less CPU:
    bench/overhead.py's what-was-tried list), and an answer ``answer`` gives at once is written there too;
    one to await runs as a task, the connection's next request waiting for it."""

    def __init__(self, max_body: Callable[[], int], metrics: Metrics | None = None) -> None:
        self._max_body = max_body
        self._refused = metrics.errors.labels("authz_http") if metrics is not None else None
        self._server: asyncio.AbstractServer | None = None

    def answer(self, method: str, target: str, headers: dict[str, str], body: bytes) -> bytes | Awaitable[bytes]:
        """The response's bytes, or what to await for them: an answer given at once is written in the
        callback its request's bytes came in, without a task (most of kvroute's decisions)."""
        raise NotImplementedError

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _HttpConnection(self), host, port, reuse_address=True)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def _head(self, head: bytes | bytearray) -> tuple[str, str, dict[str, str], int]:
        """A request head's method, target, headers and body length; _BadRequest for what cannot be read."""
        method, target, headers = _parse_head(head)
        if "transfer-encoding" in headers:
            raise _BadRequest(501, "a chunked body (Envoy's ext_authz sends a buffered body with content-length)")
        try:
            n = int(headers.get("content-length", "0"))
        except ValueError:
            raise _BadRequest(400, "content-length is not a number") from None
        if n < 0:
            raise _BadRequest(400, "negative content-length")
        if n > (limit := self._max_body()):
            raise _BadRequest(413, str(BodyTooLarge.over(limit)))
        return method, target, headers, n

    def _refuse(self, e: _BadRequest) -> bytes:
        if self._refused is not None:
            self._refused.inc()
        log.info("ext_authz HTTP request refused", extra={"fields": {"status": e.status, "error": str(e)}})
        return envoy.http_response(e.status, {"connection": "close"})


class _HttpConnection(asyncio.Protocol):
    """One connection of an HttpAuthzServer: bytes gathered until a request is whole, its answer run,
    written, and the next request (if its bytes came meanwhile) taken up after it."""

    def __init__(self, server: HttpAuthzServer) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        # What arrived and is not taken up yet: most often one read's own bytes (never copied), gathered in a
        # bytearray when a request spans reads (a large body: appends, not a copy of the whole per read).
        self._buf: bytes | bytearray = b""
        self._request: tuple[str, str, dict[str, str], int] | None = None  # a head read, its body awaited
        self._busy = False  # an answer is being decided: the next request waits for it
        self._task: asyncio.Task[None] | None = None  # the answer being awaited (a hold, a prefill leg)
        self._paused = False  # reading paused: more than HTTP_HEAD_MAX waits behind the answer being decided

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # (uvloop's transports are not asyncio's classes)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._task is not None:  # Envoy gave up on the Check: what it awaits (a hold, a prefill leg) is too
            self._task.cancel()

    def data_received(self, data: bytes) -> None:
        if not self._buf:
            self._buf = data
        else:
            if isinstance(self._buf, bytes):
                self._buf = bytearray(self._buf)
            self._buf += data
        if not self._busy:
            self._next()
        elif len(self._buf) > HTTP_HEAD_MAX and not self._paused and self._transport is not None:
            # Envoy sends one request at a time; whoever sends more waits (as asyncio streams' reader would)
            self._paused = True
            self._transport.pause_reading()

    def _close(self, answer: bytes | None = None) -> None:
        if self._transport is not None:
            if answer is not None:
                self._transport.write(answer)
            self._transport.close()
            self._transport = None

    def _next(self) -> None:
        """Take up the buffered requests that are whole, in order, until one's answer must be awaited."""
        while self._transport is not None and not self._busy:
            if self._request is None:
                end = self._buf.find(b"\r\n\r\n", 0, HTTP_HEAD_MAX)
                if end < 0:
                    if len(self._buf) >= HTTP_HEAD_MAX:
                        self._close(envoy.http_response(431, {"connection": "close"}))
                    return
                head, self._buf = self._buf[: end + 4], self._buf[end + 4 :]
                try:
                    self._request = self._server._head(head)
                except _BadRequest as e:
                    self._close(self._server._refuse(e))
                    return
            method, target, headers, n = self._request
            if len(self._buf) < n:
                return
            body, self._buf = (self._buf, b"") if len(self._buf) == n else (self._buf[:n], self._buf[n:])
            if isinstance(body, bytearray):
                body = bytes(body)
            self._request = None
            try:
                got = self._server.answer(method, target, headers, body)
            except Exception:
                self._failed()
                return
            if isinstance(got, bytes):  # decided at once: written now, no task
                self._write(got, headers)
            else:
                self._busy = True
                self._task = asyncio.get_running_loop().create_task(self._answer(got, headers))

    async def _answer(self, got: Awaitable[bytes], headers: dict[str, str]) -> None:
        try:
            out = await got
        except Exception:
            self._failed()
            return
        finally:
            self._busy, self._task = False, None
        self._write(out, headers)
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        if self._buf:
            self._next()

    def _failed(self) -> None:
        """The answer's own errors are answered by it: this is a bug, and the connection goes."""
        log.exception("ext_authz HTTP answer failed")
        self._close()

    def _write(self, out: bytes, headers: dict[str, str]) -> None:
        if self._transport is None:  # the connection went while the answer was decided
            return
        if headers.get("connection", "").lower() == "close":
            self._close(out)
        else:
            self._transport.write(out)


class HttpAuthorizer(HttpAuthzServer):
    """kvroute's decision for each HTTP authorization request (``envoy.http_answer``)."""

    def __init__(self, ep: ExternalProcessor, pending: Pending) -> None:
        super().__init__(lambda: ep.max_body_bytes, ep.metrics)
        self.ep = ep
        self.pending = pending

    def answer(self, method: str, target: str, headers: dict[str, str], body: bytes) -> bytes | Awaitable[bytes]:
        headers[":method"], headers[":path"] = method, target
        if "host" in headers:
            headers.setdefault(":authority", headers["host"])
        # A refusal is 403, not 501: Envoy takes an HTTP authorization server's 5xx for its failure and,
        # failing open, would send the request on unsalted.
        return _decided(self.ep, self.pending, headers, body, None, envoy.http_answer, 403)


def _decided(
    ep: ExternalProcessor, pending: Pending, headers: dict[str, str], body: bytes, subset: set[str] | None,
    translate: Callable[[list[envoy.ProcessingResponse], dict[str, Any] | None], T], refusal: int,
) -> T | Coroutine[Any, Any, T]:  # fmt: skip
    """The decision on a whole request as a transport answers it (``translate``d; refused with status
    ``refusal`` when it would rewrite the body); a routed request's pod slot held until the access log
    reports it done. The answer itself when nothing waits, else the coroutine that gives it."""
    st = ep.whole_request(headers, body, subset)
    got = ep.decide_whole(st, body)
    if isinstance(got, list):
        return _translated(ep, pending, st, got, translate, refusal)
    return _translated_later(ep, pending, st, got, translate, refusal)


async def _translated_later(
    ep: ExternalProcessor, pending: Pending, st: Stream, answers: Awaitable[list[envoy.ProcessingResponse]],
    translate: Callable[[list[envoy.ProcessingResponse], dict[str, Any] | None], T], refusal: int,
) -> T:  # fmt: skip
    return _translated(ep, pending, st, await answers, translate, refusal)


def _translated(
    ep: ExternalProcessor, pending: Pending, st: Stream, answers: list[envoy.ProcessingResponse],
    translate: Callable[[list[envoy.ProcessingResponse], dict[str, Any] | None], T], refusal: int,
) -> T:  # fmt: skip
    headers = st.headers
    try:
        out = translate(answers, st.routing)
    except envoy.BodyRewriteNeeded:
        ep.release(st)
        ep.metrics.errors.labels("body_rewrite").inc()
        return translate([envoy.immediate(refusal, REWRITE_REFUSED, "body_rewrite_unsupported")], None)
    if st.outcome is not None and not st.released:
        if rid := headers.get("x-request-id"):
            pending.hold(rid, st)
        else:  # Envoy always sets one (HCM generate_request_id); without it nothing could release the slot
            ep.release(st)
    return out


def add_to_server(ep: ExternalProcessor, server: grpc.aio.Server) -> Pending:
    """Serve Check and the access log beside ext_proc on ``server``; the requests they hold."""
    pending = Pending(ep)
    authz_grpc.add_AuthorizationServicer_to_server(Authorizer(ep, pending), server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLog(pending, ep.metrics), server)
    return pending
