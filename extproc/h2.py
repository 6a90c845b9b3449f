"""A lean gRPC server over HTTP/2 for Envoy's ext_proc stream (``server.h2_port``).

grpcio's machinery, not kvroute's decision, is most of what an ext_proc request costs kvroute
(bench/RESULTS.md, Router overhead: the do-nothing grpc.aio server alone spends 0.7-0.9 ms of CPU per
request, half of it opening and closing the stream). This server speaks just what a gRPC client such
as Envoy's needs for one bidirectional streaming method: HTTP/2 frames parsed in the read callback
they arrive in, HPACK decoded with ``hpack``, gRPC's length-prefixed messages handed to a handler as
bytes, answers written as they are given, no task or coroutine per stream or message.

What it keeps of HTTP/2 (RFC 9113): the connection preface and SETTINGS (acknowledged), PING,
WINDOW_UPDATE and flow control both ways (it advertises the largest windows, so a client rarely waits on
it; its own sends wait for the client's window), HEADERS with CONTINUATION, padding and priority
fields, RST_STREAM, GOAWAY (sent on shutdown: streams open finish, new ones are refused). It refuses
what a gRPC client never sends (PUSH_PROMISE, a compressed message, an unknown method: grpc-status
UNIMPLEMENTED) with the protocol's own errors. TLS (mTLS) is the listener's, via ``ssl`` with ALPN h2.

A handler (``Handler``) gets each message's bytes, the end of the client's side and a reset; it
answers through its ``GrpcStream`` (``send``, ``finish``). ``Unary`` adapts a function of one request
to a handler (the gRPC health check that Envoy's cluster and a gateway's probe send to this port).
Everything runs on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import struct
import time
from collections.abc import Callable
from typing import Protocol, cast

import hpack

log = logging.getLogger("kvroute")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Frame types and flags.
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# SETTINGS identifiers.
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 1, 2, 3, 4, 5
# Error codes.
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR = 0x0, 0x1, 0x2, 0x3, 0x6
REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x7, 0x8, 0x9
# gRPC status codes it sends.
OK, CANCELLED, INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL = 0, 1, 3, 5, 8, 12, 13

MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65_535
# What it lets a client send in one frame (the client's own limit applies to what it sends back): a
# large body comes in a few frames, not one per 16 KiB.
OUR_MAX_FRAME = (1 << 24) - 1
# Its receive windows are replenished once this much of them was used (a WINDOW_UPDATE per GiB, not per frame).
REPLENISH_AT = 1 << 30
EXT_PROC_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
# Frames handled in one turn of the event loop, at most this long (then the rest in the next turn).
SLICE_S = 0.002
# The answers of frames read together are written together for up to this long: a saturated connection
# (many streams' messages a read) paid a socket write per frame, a third of kvroute's CPU there; with one
# message a read (Envoy below saturation) nothing waits. python -m bench.workers --api ext_proc_h2: +9-11 %
# decisions per core, p50 -1.5 ms; bench.overhead's h2 rows at 300 req/s unchanged.
COALESCE_S = 0.0002
MAX_HEADER_BLOCK = 64 * 1024  # a header block's encoded size, at most (a gRPC call's metadata is small)
MEMO_BLOCKS = 64  # decoded header blocks a connection remembers (Envoy sends one or two kinds)

_U32 = struct.Struct(">I")
# Answers' header blocks, HPACK without the dynamic table (the same bytes every time): ":status: 200" is
# static entry 8; content-type (static name 31) and grpc-status are literals not indexed.
_RESPONSE_HEADERS = b"\x88" + b"\x0f\x10" + bytes([16]) + b"application/grpc"


def _literal(name: bytes, value: bytes) -> bytes:
    """A header field as an HPACK literal without indexing, new name (names and values under 127 bytes)."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


_STATUS_OK = _literal(b"grpc-status", b"0")


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + _U32.pack(stream_id) + payload


class ProtocolError(Exception):
    """The client broke HTTP/2: the connection ends with GOAWAY and ``code``."""

    def __init__(self, message: str, code: int = PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


class Handler(Protocol):
    """One call's handler, made by the server's ``handlers[path](stream)``."""

    def on_message(self, data: bytes) -> None: ...  # one request message, serialized
    def on_end(self) -> None: ...  # the client closed its side (no more messages)
    def on_reset(self) -> None: ...  # the call ended early: reset by the client, or the connection lost


class Unary:
    """A unary method's handler (``H2Server({path: Unary.of(answer)})``): its one request message goes
    to ``answer(data)``, which gives ``(status, response, message)``; the response (serialized, or None
    for none) and the status are sent at the client's end."""

    __slots__ = ("_answer", "_data", "_stream")

    def __init__(self, stream: GrpcStream, answer: Callable[[bytes], tuple[int, bytes | None, str]]) -> None:
        self._stream = stream
        self._answer = answer
        self._data: bytes | None = None

    @classmethod
    def of(cls, answer: Callable[[bytes], tuple[int, bytes | None, str]]) -> Callable[[GrpcStream], Unary]:
        return lambda stream: cls(stream, answer)

    def on_message(self, data: bytes) -> None:
        if self._data is not None:
            self._stream.finish(INVALID_ARGUMENT, "a unary method takes one request message")
            return
        self._data = data

    def on_end(self) -> None:
        if self._data is None:
            self._stream.finish(INVALID_ARGUMENT, "no request message")
            return
        try:
            status, response, message = self._answer(self._data)
        except Exception:
            log.exception("h2: a unary method's answer failed")
            status, response, message = INTERNAL, None, "internal error"
        if response is not None and status == OK:
            self._stream.send(response)
        self._stream.finish(status, message)

    def on_reset(self) -> None:
        pass


def _trailers(status: int, message: str) -> bytes:
    block = _STATUS_OK if status == OK else _literal(b"grpc-status", str(status).encode())
    if message:
        msg = message.encode()[:120].replace(b"%", b"%25")  # grpc-message is percent-encoded
        block += _literal(b"grpc-message", msg)
    return block


class GrpcStream:
    """One call: its request headers (``headers``, pseudo-headers included) and the way to answer."""

    __slots__ = ("_buf", "_conn", "_recv_used", "_sent_headers", "closed", "ended", "handler", "headers", "id",
                 "send_window")  # fmt: skip

    def __init__(self, conn: _Connection, stream_id: int, headers: dict[str, str], send_window: int) -> None:
        self._conn = conn
        self.id = stream_id
        self.headers = headers
        self.handler: Handler | None = None
        self._buf = bytearray()  # a message's bytes not all here yet
        self._recv_used = 0
        self._sent_headers = False
        self.send_window = send_window
        self.ended = False  # the client's side is closed
        self.closed = False  # trailers sent, or reset

    def send(self, message: bytes) -> None:
        """Send one response message (serialized); the response headers go first."""
        if self.closed:
            return
        out = b""
        if not self._sent_headers:
            self._sent_headers = True
            out = frame(HEADERS, END_HEADERS, self.id, _RESPONSE_HEADERS)
        self._conn.send_data(self, out, b"\x00" + _U32.pack(len(message)) + message)

    def finish(self, status: int = OK, message: str = "") -> None:
        """End the call with ``status`` (trailers; a call that sent nothing sends headers and status at once)."""
        if self.closed:
            return
        if self._sent_headers:
            block = _trailers(status, message)
        else:  # trailers-only: the status with the response headers
            self._sent_headers = True
            block = _RESPONSE_HEADERS + _trailers(status, message)
        self._conn.send_trailers(self, frame(HEADERS, END_HEADERS | END_STREAM, self.id, block))


class _Connection(asyncio.Protocol):
    def __init__(self, server: H2Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._preface = False
        self._decoder = hpack.Decoder()
        self._decoder.max_allowed_table_size = 4096
        self._blocks: dict[bytes, tuple[int, object, int, list[tuple[str, str]]]] = {}  # see _decode
        self._streams: dict[int, GrpcStream] = {}
        self._last_id = 0  # the highest stream id the client opened
        self._headers: tuple[int, int, bytearray] | None = None  # a header block awaiting CONTINUATION
        self._recv_used = 0  # connection-level bytes received since the last WINDOW_UPDATE
        self._send_window = DEFAULT_WINDOW
        self._peer_window = DEFAULT_WINDOW  # the client's initial stream window (its SETTINGS)
        self._peer_frame = 16_384  # the largest frame the client takes
        self._blocked: dict[int, list[tuple[bytes, bytes, bool]]] = {}  # sends waiting for window, per stream
        self._going_away = False
        self._out: list[bytes] | None = None  # writes gathered while a frame is handled
        self._paused = self._scheduled = False  # reading paused, the rest of the frames read for the next turn

    # -- asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.server._conns.add(self)
        settings = b"".join(struct.pack(">HI", k, v) for k, v in (
            (MAX_CONCURRENT_STREAMS, self.server.max_streams), (INITIAL_WINDOW_SIZE, MAX_WINDOW),
            (MAX_FRAME_SIZE, OUR_MAX_FRAME), (ENABLE_PUSH, 0)))  # fmt: skip
        transport.write(frame(SETTINGS, 0, 0, settings)
                        + frame(WINDOW_UPDATE, 0, 0, _U32.pack(MAX_WINDOW - DEFAULT_WINDOW)))  # fmt: skip

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.server._conns.discard(self)
        streams, self._streams = self._streams, {}
        for st in streams.values():
            self._reset(st)
        self.server._changed()

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if not self._scheduled:
            self._process()

    def _process(self) -> None:
        """The frames read so far, for up to ``SLICE_S``: past it, reading pauses and the rest waits for the
        loop's next turn, so a read holding many streams' messages (a saturated connection) cannot keep the
        loop's other work (shared state, scrapes, timers) waiting behind all of their decisions."""
        self._scheduled = False
        buf = self._buf
        self._out = cast(list[bytes], [])
        more = False
        try:
            pos = 0
            if not self._preface:
                if len(buf) < len(PREFACE):
                    if not PREFACE.startswith(bytes(buf)):
                        raise ProtocolError("not an HTTP/2 connection preface")
                    return
                if buf[: len(PREFACE)] != PREFACE:
                    raise ProtocolError("not an HTTP/2 connection preface")
                self._preface = True
                pos = len(PREFACE)
            end = len(buf)
            deadline, flush_by = time.perf_counter() + SLICE_S, 0.0
            # A frame's payload copied out of the buffer once (a slice of the bytearray, then bytes of it,
            # copied a large body's every frame twice); the view is let go before the buffer shrinks.
            with memoryview(buf) as view:
                while end - pos >= 9:
                    length = int.from_bytes(view[pos : pos + 3], "big")
                    if length > OUR_MAX_FRAME:
                        raise ProtocolError("frame over SETTINGS_MAX_FRAME_SIZE", FRAME_SIZE_ERROR)
                    if end - pos < 9 + length:
                        break
                    kind, flags = buf[pos + 3], buf[pos + 4]
                    sid = _U32.unpack_from(buf, pos + 5)[0] & MAX_WINDOW
                    payload = view[pos + 9 : pos + 9 + length].tobytes()
                    pos += 9 + length
                    self._frame(kind, flags, sid, payload)
                    # A frame's answers go out with the next ones read with it for up to COALESCE_S (the
                    # read's last frame's at its end, below): a burst's first answer waits at most that (and
                    # one more frame's handling) for the decisions behind it, and costs a socket write per
                    # COALESCE_S.
                    now = time.perf_counter()
                    if self._out:
                        if not flush_by:
                            flush_by = now + COALESCE_S
                        if now >= flush_by:
                            self._flush_out()
                            flush_by = 0.0
                    if end - pos >= 9 and now >= deadline:
                        more = True
                        break
            del buf[:pos]
        except ProtocolError as e:
            self._goaway(e.code, str(e))
        except Exception:
            log.exception("h2: a frame's handling failed")
            self._goaway(INTERNAL_ERROR, "internal error")
        finally:
            self._flush_out()
            self._out = None
        if self.transport is None:
            return
        if more:
            if not self._paused:
                self._paused = True
                self.transport.pause_reading()
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._process)
        elif self._paused:
            self._paused = False
            self.transport.resume_reading()

    # -- frames in --------------------------------------------------------------------------------

    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if self._headers is not None and kind != CONTINUATION:
            raise ProtocolError("a header block was interrupted")
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            self._headers_frame(flags, sid, payload)
        elif kind == CONTINUATION:
            if self._headers is None or self._headers[0] != sid:
                raise ProtocolError("CONTINUATION without its HEADERS")
            block = self._headers[2]
            block += payload
            if len(block) > MAX_HEADER_BLOCK:
                raise ProtocolError("header block too large")
            if flags & END_HEADERS:
                hsid, hflags, _ = self._headers
                self._headers = None
                self._header_block(hsid, hflags, bytes(block))
        elif kind == SETTINGS:
            self._settings(flags, sid, payload)
        elif kind == PING:
            if sid or len(payload) != 8:
                raise ProtocolError("bad PING", FRAME_SIZE_ERROR if len(payload) != 8 else PROTOCOL_ERROR)
            if not flags & ACK:
                self._write(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == RST_STREAM:
            if not sid or len(payload) != 4:
                raise ProtocolError("bad RST_STREAM")
            st = self._streams.pop(sid, None)
            if st is not None:
                self._blocked.pop(sid, None)
                self._reset(st)
                self.server._changed()
        elif kind == GOAWAY:
            self._going_away = True  # the client opens no more streams; those open finish
        elif kind == PUSH_PROMISE:
            raise ProtocolError("PUSH_PROMISE from a client")
        elif kind == PRIORITY and not sid:
            raise ProtocolError("PRIORITY on stream 0")
        # unknown frame types are ignored (RFC 9113 section 4.1)

    def _settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid:
            raise ProtocolError("SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise ProtocolError("SETTINGS of a bad size", FRAME_SIZE_ERROR)
        for i in range(0, len(payload), 6):
            ident, value = struct.unpack_from(">HI", payload, i)
            if ident == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolError("SETTINGS_INITIAL_WINDOW_SIZE too large", FLOW_CONTROL_ERROR)
                delta, self._peer_window = value - self._peer_window, value
                for st in self._streams.values():
                    st.send_window += delta
            elif ident == MAX_FRAME_SIZE:
                if not 16_384 <= value <= OUR_MAX_FRAME:
                    raise ProtocolError("bad SETTINGS_MAX_FRAME_SIZE")
                self._peer_frame = value
            # HEADER_TABLE_SIZE: its answers' blocks use no dynamic table; the rest do not apply to a server
        self._write(frame(SETTINGS, ACK, 0))
        self._flush_blocked()

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolError("bad WINDOW_UPDATE", FRAME_SIZE_ERROR)
        inc = _U32.unpack(payload)[0] & MAX_WINDOW
        if not inc:
            raise ProtocolError("WINDOW_UPDATE of 0")
        if sid == 0:
            self._send_window += inc
            if self._send_window > MAX_WINDOW:
                raise ProtocolError("connection window over 2^31-1", FLOW_CONTROL_ERROR)
        elif (st := self._streams.get(sid)) is not None:
            st.send_window += inc
        self._flush_blocked()

    def _headers_frame(self, flags: int, sid: int, payload: bytes) -> None:
        if not sid or not sid & 1:
            raise ProtocolError("HEADERS on a server-initiated or zero stream id")
        pos, end = 0, len(payload)
        if flags & PADDED:
            if not payload:
                raise ProtocolError("PADDED without its length")
            end -= payload[0]
            pos = 1
        if flags & PRIORITY_FLAG:
            pos += 5
        if pos > end:
            raise ProtocolError("padding over the frame")
        block = payload[pos:end]
        if flags & END_HEADERS:
            self._header_block(sid, flags, block)
        else:
            self._headers = (sid, flags, bytearray(block))

    def _decode(self, block: bytes) -> list[tuple[str, str]]:
        """The block's fields, from a memo where an earlier decode of the same bytes left the dynamic table
        as it is now. Envoy opens each request's ext_proc stream with the same block (``:path`` a literal it
        never indexes, the rest indexed), and decoding it in Python was an eighth of kvroute's CPU under
        load. A block that inserts into the table is never memoized; the table's state is its length and
        its newest entry (held, so a new entry cannot share its identity), since every insertion adds a
        new newest entry and every eviction without one shortens it; and its size limit, which a block may
        change without evicting (such a block is not memoized either)."""
        ht = self._decoder.header_table
        table = ht.dynamic_entries
        n, newest, limit = len(table), table[0] if table else None, ht.maxsize
        hit = self._blocks.get(block)
        if hit is not None and hit[0] == n and hit[1] is newest and hit[2] == limit:
            return hit[3]
        try:
            fields = cast(list[tuple[str, str]], self._decoder.decode(block))  # str pairs (raw=False)
        except Exception as e:  # hpack's errors: the connection's decoder state is lost with it
            raise ProtocolError(f"HPACK: {e}", COMPRESSION_ERROR) from None
        if len(table) == n and (table[0] if table else None) is newest and ht.maxsize == limit:
            if len(self._blocks) >= MEMO_BLOCKS:
                self._blocks.clear()
            self._blocks[block] = (n, newest, limit, fields)
        return fields

    def _header_block(self, sid: int, flags: int, block: bytes) -> None:
        fields = self._decode(block)
        st = self._streams.get(sid)
        if st is not None:  # trailers from the client: its side ends
            if flags & END_STREAM:
                self._end(st)
            return
        if sid <= self._last_id:
            if flags & END_STREAM:
                return  # a stream already closed (e.g. reset by us): nothing to do
            raise ProtocolError("a stream id reused")
        self._last_id = sid
        if self._going_away or self.server.stopping:
            self._write(frame(RST_STREAM, 0, sid, _U32.pack(REFUSED_STREAM)))
            return
        headers = dict(fields)
        st = GrpcStream(self, sid, headers, self._peer_window)
        self._streams[sid] = st
        make = self.server.handlers.get(headers.get(":path", ""))
        if make is None or headers.get(":method") != "POST":
            st.ended = bool(flags & END_STREAM)  # a refusal then needs no RST_STREAM to stop the client
            st.finish(UNIMPLEMENTED, f"unknown method {headers.get(':path', '')}")
        elif not headers.get("content-type", "").startswith("application/grpc"):
            st.ended = bool(flags & END_STREAM)
            st.finish(INVALID_ARGUMENT, "content-type is not application/grpc")
        else:
            st.handler = make(st)
            self.server._changed()
            if flags & END_STREAM:
                self._end(st)

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        n = len(payload)
        self._recv_used += n
        if self._recv_used >= REPLENISH_AT:
            self._write(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._recv_used)))
            self._recv_used = 0
        st = self._streams.get(sid)
        if st is None:
            if not sid or sid > self._last_id:
                raise ProtocolError("DATA on a stream not open")
            return  # a stream it reset or finished: the client's in-flight frames
        if flags & PADDED:
            if not payload or payload[0] >= n:
                raise ProtocolError("bad DATA padding")
            payload = payload[1 : n - payload[0]]
        if st.ended:
            raise ProtocolError("DATA after the stream's end")
        st._recv_used += n
        if st._recv_used >= REPLENISH_AT:
            self._write(frame(WINDOW_UPDATE, 0, sid, _U32.pack(st._recv_used)))
            st._recv_used = 0
        if st.handler is not None and payload:
            self._messages(st, payload)
        if flags & END_STREAM:
            self._end(st)

    def _messages(self, st: GrpcStream, payload: bytes) -> None:
        # A message in one frame is sliced from it; one over several frames gathers in the stream's
        # bytearray (appended to, never rebuilt: a 400 KB body in 16 KB frames is copied once, not 25 times).
        buf: bytes | bytearray = payload
        if st._buf:
            st._buf += payload
            buf = st._buf
        pos, end = 0, len(buf)
        limit = self.server.max_message
        while end - pos >= 5:
            if buf[pos]:
                self._fail(st, UNIMPLEMENTED, "compressed messages are not accepted")
                return
            size = _U32.unpack_from(buf, pos + 1)[0]
            if size > limit:
                self._fail(st, RESOURCE_EXHAUSTED, f"message of {size} bytes over the limit of {limit}")
                return
            if end - pos - 5 < size:
                break
            msg = buf[pos + 5 : pos + 5 + size]
            pos += 5 + size
            handler = st.handler
            if handler is None or st.closed:
                return
            handler.on_message(msg if type(msg) is bytes else bytes(msg))
        if buf is st._buf:
            del st._buf[:pos]
        elif pos < end:
            st._buf = bytearray(buf[pos:])

    def _end(self, st: GrpcStream) -> None:
        if st.ended:
            return
        st.ended = True
        if st._buf:
            self._fail(st, INTERNAL, "the stream ended inside a message")
        elif st.handler is not None and not st.closed:
            st.handler.on_end()
        self._forget_if_done(st)

    def _fail(self, st: GrpcStream, status: int, message: str) -> None:
        handler, st.handler = st.handler, None
        st.finish(status, message)
        if handler is not None:
            handler.on_reset()

    def _reset(self, st: GrpcStream) -> None:
        st.closed = True
        handler, st.handler = st.handler, None
        if handler is not None:
            try:
                handler.on_reset()
            except Exception:
                log.exception("h2: a stream's reset handling failed")

    def _forget_if_done(self, st: GrpcStream) -> None:
        if st.closed and st.ended and self._streams.get(st.id) is st and st.id not in self._blocked:
            del self._streams[st.id]
            self.server._changed()
            if self.server.stopping and not self._streams and self.transport is not None:
                self._flush_out()
                self.transport.close()  # drained after GOAWAY

    # -- frames out -------------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        if self._out is not None:
            self._out.append(data)
        elif self.transport is not None:
            self.transport.write(data)

    def send_data(self, st: GrpcStream, head: bytes, data: bytes, end: bool = False) -> None:
        """``head`` (a HEADERS frame, or nothing) then ``data`` as DATA frames within the windows; what
        the windows do not allow waits for the client's WINDOW_UPDATE."""
        if st.id in self._blocked:
            self._blocked[st.id].append((head, data, end))
            return
        self._send(st, head, data, end)

    def _send(self, st: GrpcStream, head: bytes, data: bytes, end: bool) -> bool:
        n = len(data)
        if n <= st.send_window and n <= self._send_window and n <= self._peer_frame:
            st.send_window -= n
            self._send_window -= n
            self._write(head + frame(DATA, END_STREAM if end else 0, st.id, data))
            return True
        parts = [head] if head else []
        pos = 0
        while pos < n:
            room = min(st.send_window, self._send_window, self._peer_frame, n - pos)
            if room <= 0:
                break
            st.send_window -= room
            self._send_window -= room
            last = pos + room == n
            parts.append(frame(DATA, END_STREAM if end and last else 0, st.id, data[pos : pos + room]))
            pos += room
        if parts:
            self._write(b"".join(parts))
        if pos < n:
            self._blocked.setdefault(st.id, []).append((b"", data[pos:], end))
            return False
        return True

    def send_trailers(self, st: GrpcStream, trailers: bytes) -> None:
        if not st.ended:
            # Answered before the client's end (a refusal, an error): RST_STREAM NO_ERROR tells it to
            # stop sending (RFC 9113 section 8.1), as gRPC servers do; what it sent meanwhile is ignored.
            trailers += frame(RST_STREAM, 0, st.id, _U32.pack(NO_ERROR))
            st.ended = True
        if st.id in self._blocked:
            self._blocked[st.id].append((trailers, b"", False))
        else:
            self._write(trailers)
        st.closed = True
        self._forget_if_done(st)

    def _flush_blocked(self) -> None:
        for sid in list(self._blocked):
            st = self._streams.get(sid)
            queue = self._blocked[sid]
            while queue and st is not None:
                head, data, end = queue[0]
                if not data:  # trailers (or a bare header frame) behind the data
                    self._write(head)
                    queue.pop(0)
                    continue
                queue.pop(0)
                if not self._send(st, head, data, end):  # re-queued its remainder at the end: move it first
                    queue.insert(0, queue.pop())
                    break
            if not queue or st is None:
                del self._blocked[sid]
                if st is not None:
                    self._forget_if_done(st)

    def _goaway(self, code: int, why: str) -> None:
        if self.transport is None:
            return
        if code != NO_ERROR:
            log.warning("h2: closing a connection", extra={"fields": {"error_code": code, "why": why}})
        self._write(frame(GOAWAY, 0, 0, _U32.pack(self._last_id) + _U32.pack(code) + why.encode()[:200]))
        self._flush_out()
        self.transport.close()
        self.transport = None

    def _flush_out(self) -> None:
        if self._out and self.transport is not None:
            self.transport.write(b"".join(self._out))
            self._out.clear()

    def shutdown(self) -> None:
        """No new streams (GOAWAY, NO_ERROR); the connection closes when its streams are done."""
        if self.transport is not None and not self._going_away:
            self._write(frame(GOAWAY, 0, 0, _U32.pack(self._last_id) + _U32.pack(NO_ERROR)))
        self._going_away = True
        if not self._streams and self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class H2Server:
    """Serves ``handlers`` (a gRPC method's path -> a handler factory) on a listening socket."""

    def __init__(
        self,
        handlers: dict[str, Callable[[GrpcStream], Handler]],
        max_message: int,
        max_streams: int = 1 << 16,
    ) -> None:
        self.handlers = handlers
        self.max_message = max_message
        self.max_streams = max_streams
        self.stopping = False
        self._sock: socket.socket | None = None
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_Connection] = set()
        self._idle = asyncio.Event()

    def open_streams(self) -> int:
        return sum(len(c._streams) for c in self._conns)

    def _changed(self) -> None:
        if self.stopping and not self.open_streams():
            self._idle.set()

    def bind(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Listen on host:port (0: a free port) before serving (``start``); the port bound. OSError if taken."""
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:  # one of several workers on the port (extproc/workers.py)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            sock.listen(1024)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        return int(sock.getsockname()[1])

    async def start(self, tls: ssl.SSLContext | None = None) -> None:
        """Serve on the bound socket (TLS with ALPN h2 when ``tls`` is given)."""
        if self._sock is None:
            raise RuntimeError("bind() first")
        if tls is not None:
            tls.set_alpn_protocols(["h2"])
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), sock=self._sock, ssl=tls)

    def close(self) -> None:
        """Give back a bound socket that never served (a failed start)."""
        if self._server is None and self._sock is not None:
            self._sock.close()
        self._sock = None

    async def stop(self, grace_s: float | None) -> None:
        """Refuse new streams, let open ones finish (up to ``grace_s``), then close every connection."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            c.shutdown()
        if self.open_streams():
            self._idle.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace_s)
        for c in list(self._conns):
            c.abort()
        self._conns.clear()
