"""extproc/h2.py: the HTTP/2 gRPC server, against grpcio's client and frame by frame over a raw socket."""

import asyncio
import struct
import time
from collections.abc import Callable
from typing import Any

import grpc
import hpack
import pytest

from extproc import h2

METHOD = "/test.Echo/Chat"


class Echo:
    """Answers each message with itself (a reset or end is recorded)."""

    def __init__(self, stream: h2.GrpcStream, log: list[str]) -> None:
        self.stream, self.log = stream, log

    def on_message(self, data: bytes) -> None:
        self.log.append(f"message {len(data)}")
        self.stream.send(data)

    def on_end(self) -> None:
        self.log.append("end")
        self.stream.finish()

    def on_reset(self) -> None:
        self.log.append("reset")


class Quiet:
    """Finishes the call at the client's end; messages and resets ignored (tests override what they watch)."""

    def __init__(self, stream: h2.GrpcStream) -> None:
        self.stream = stream

    def on_message(self, data: bytes) -> None:
        pass

    def on_end(self) -> None:
        self.stream.finish()

    def on_reset(self) -> None:
        pass


async def _started(handler: type[Quiet] | Callable[[h2.GrpcStream], Any]) -> tuple[h2.H2Server, int]:
    srv = h2.H2Server({METHOD: handler}, max_message=1 << 20)
    port = srv.bind("127.0.0.1", 0)
    await srv.start()
    return srv, port


@pytest.fixture
async def server():
    log: list[str] = []
    srv = h2.H2Server({METHOD: lambda s: Echo(s, log)}, max_message=4 << 20)
    port = srv.bind("127.0.0.1", 0)
    await srv.start()
    srv.log, srv.port = log, port  # type: ignore[attr-defined]
    yield srv
    await srv.stop(0)


def _raw(b: bytes) -> bytes:
    return b


async def test_grpcio_client_many_streams_and_large_messages(server):
    """Real grpcio: 40 concurrent calls, messages up to 3 MiB each way (the answers wait on grpcio's
    receive window, which starts at 64 KiB), every call OK with its messages echoed in order."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        chat = ch.stream_stream(METHOD, request_serializer=_raw, response_deserializer=_raw)

        async def one(i: int) -> list[bytes]:
            msgs = [bytes([i]) * 10, bytes([i]) * (3 << 20 if i % 8 == 0 else 70_000), b""]
            call = chat(iter(msgs), timeout=20)
            got = [m async for m in call]
            assert await call.code() == grpc.StatusCode.OK
            assert got == msgs
            return got

        await asyncio.gather(*(one(i) for i in range(40)))
    assert server.log.count("end") == 40 and "reset" not in server.log


async def test_a_unary_method_answers_once_at_the_clients_end():
    """``Unary``: one request, one answer and its status (grpcio's unary and stream-unary calls); a
    second message or none is INVALID_ARGUMENT, an answer that raises is INTERNAL, the server goes on."""

    def answer(data: bytes) -> tuple[int, bytes | None, str]:
        if data == b"boom":
            raise RuntimeError("a bug")
        return (h2.OK, data.upper(), "") if data != b"missing" else (h2.NOT_FOUND, None, "no such thing")

    srv = h2.H2Server({"/test.Unary/Ask": h2.Unary.of(answer)}, max_message=1 << 20)
    port = srv.bind("127.0.0.1", 0)
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            ask = ch.unary_unary("/test.Unary/Ask", request_serializer=_raw, response_deserializer=_raw)
            many = ch.stream_unary("/test.Unary/Ask", request_serializer=_raw, response_deserializer=_raw)
            assert await ask(b"hello", timeout=5) == b"HELLO"
            for request, code, detail in ((b"missing", grpc.StatusCode.NOT_FOUND, "no such thing"),
                                          (b"boom", grpc.StatusCode.INTERNAL, "internal error")):  # fmt: skip
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await ask(request, timeout=5)
                assert (e.value.code(), e.value.details()) == (code, detail)
            for requests in ([b"a", b"b"], []):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await many(iter(requests), timeout=5)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert await ask(b"again", timeout=5) == b"AGAIN"
    finally:
        await srv.stop(0)


# -- frame by frame -------------------------------------------------------------------------------------


class Raw:
    """A hand-driven HTTP/2 client: frames out as given, frames in as parsed."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.r, self.w = reader, writer
        self.enc = hpack.Encoder()
        self.dec = hpack.Decoder()

    @classmethod
    async def connect(cls, port: int, settings: dict[int, int] | None = None, preface: bytes = h2.PREFACE) -> "Raw":
        r, w = await asyncio.open_connection("127.0.0.1", port)
        c = cls(r, w)
        body = b"".join(struct.pack(">HI", k, v) for k, v in (settings or {}).items())
        w.write(preface + h2.frame(h2.SETTINGS, 0, 0, body))
        return c

    def send(self, kind: int, flags: int, sid: int, payload: bytes = b"") -> None:
        self.w.write(h2.frame(kind, flags, sid, payload))

    def open(self, sid: int, path: str = METHOD, end: bool = False) -> None:
        block = self.enc.encode([(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "x"),
                                 ("content-type", "application/grpc"), ("te", "trailers")])  # fmt: skip
        self.send(h2.HEADERS, h2.END_HEADERS | (h2.END_STREAM if end else 0), sid, block)

    def message(self, sid: int, data: bytes, end: bool = False, compressed: bool = False) -> None:
        self.send(h2.DATA, h2.END_STREAM if end else 0, sid, bytes([compressed]) + struct.pack(">I", len(data)) + data)

    async def frame(self) -> tuple[int, int, int, bytes]:
        head = await asyncio.wait_for(self.r.readexactly(9), 5)
        n = int.from_bytes(head[:3], "big")
        payload = await asyncio.wait_for(self.r.readexactly(n), 5)
        return head[3], head[4], struct.unpack(">I", head[5:9])[0] & h2.MAX_WINDOW, payload

    async def until(self, kind: int, sid: int | None = None) -> tuple[int, int, int, bytes]:
        """The next frame of ``kind`` (on ``sid``), skipping SETTINGS, WINDOW_UPDATE and the like."""
        while True:
            f = await self.frame()
            if f[0] == kind and (sid is None or f[2] == sid):
                return f

    def headers(self, payload: bytes) -> dict[str, str]:
        return dict(self.dec.decode(payload))

    def close(self) -> None:
        self.w.close()


async def test_settings_acked_and_ping_answered(server):
    c = await Raw.connect(server.port)
    _, flags, _, _ = await c.until(h2.SETTINGS)
    assert not flags & h2.ACK  # the server's own first
    assert (await c.until(h2.SETTINGS))[1] & h2.ACK  # then its ack of ours
    c.send(h2.PING, 0, 0, b"12345678")
    _, flags, sid, payload = await c.until(h2.PING)
    assert flags & h2.ACK and sid == 0 and payload == b"12345678"
    c.close()


async def test_a_bad_preface_gets_goaway_protocol_error(server):
    c = await Raw.connect(server.port, preface=b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b" " * 10)
    _, _, _, payload = await c.until(h2.GOAWAY)
    assert struct.unpack(">I", payload[4:8])[0] == h2.PROTOCOL_ERROR
    assert await asyncio.wait_for(c.r.read(), 5) == b""  # and the connection closed
    c.close()


async def test_messages_split_and_joined_across_frames_padding_and_continuation(server):
    c = await Raw.connect(server.port)
    block = c.enc.encode([(":method", "POST"), (":scheme", "http"), (":path", METHOD), (":authority", "x"),
                          ("content-type", "application/grpc")])  # fmt: skip
    # HEADERS padded (3 bytes) and with a priority field, its block split over a CONTINUATION.
    c.send(h2.HEADERS, h2.PADDED | h2.PRIORITY_FLAG, 1, bytes([3]) + b"\x00\x00\x00\x00\x10" + block[:5] + b"\x00" * 3)
    c.send(h2.CONTINUATION, h2.END_HEADERS, 1, block[5:])
    framed = b"".join(b"\x00" + struct.pack(">I", len(m)) + m for m in (b"a" * 3, b"b" * 700, b""))
    c.send(h2.DATA, 0, 1, framed[:4])  # inside the first length prefix
    c.send(h2.DATA, h2.PADDED, 1, bytes([2]) + framed[4:300] + b"\x00\x00")
    c.send(h2.DATA, h2.END_STREAM, 1, framed[300:])  # the rest: two messages and the end
    _, _, _, payload = await c.until(h2.HEADERS, 1)
    assert c.headers(payload) == {":status": "200", "content-type": "application/grpc"}
    got = b""
    while True:
        kind, flags, _, payload = await c.frame()
        if kind == h2.DATA:
            got += payload
        elif kind == h2.HEADERS:
            assert flags & h2.END_STREAM and c.headers(payload)["grpc-status"] == "0"
            break
    assert got == framed
    assert server.log == ["message 3", "message 700", "message 0", "end"]
    c.close()


async def test_answers_wait_for_the_clients_window(server):
    """A client window of 100 bytes: the 1,000-byte answer comes 100 bytes at a time, as the client opens
    its windows, and its trailers only after all of it."""
    c = await Raw.connect(server.port, {h2.INITIAL_WINDOW_SIZE: 100})
    c.open(1)
    c.message(1, b"z" * 995, end=True)  # answered with 1,000 bytes of DATA (5 of them the prefix)
    await c.until(h2.HEADERS, 1)
    _, _, _, first = await c.until(h2.DATA, 1)
    assert len(first) == 100
    got = len(first)
    while got < 1000:
        c.send(h2.WINDOW_UPDATE, 0, 1, struct.pack(">I", 300))
        kind, flags, _, payload = await c.frame()
        while kind != h2.DATA:
            assert kind != h2.HEADERS, "trailers before the whole answer"
            kind, flags, _, payload = await c.frame()
        assert len(payload) <= 300
        got += len(payload)
    assert got == 1000
    _, flags, _, payload = await c.until(h2.HEADERS, 1)
    assert flags & h2.END_STREAM and c.headers(payload)["grpc-status"] == "0"
    c.close()


async def test_a_reset_stream_tells_its_handler_and_late_data_is_ignored(server):
    c = await Raw.connect(server.port)
    c.open(1)
    c.message(1, b"q")
    await c.until(h2.DATA, 1)
    c.send(h2.RST_STREAM, 0, 1, struct.pack(">I", h2.CANCEL))
    c.message(1, b"late")  # in flight when the reset went: no error
    c.open(3, end=True)  # the connection still serves
    _, _, _, payload = await c.until(h2.HEADERS, 3)
    assert c.headers(payload)["grpc-status"] == "0"
    assert server.log == ["message 1", "reset", "end"]
    c.close()


async def test_unknown_method_and_oversized_message_are_refused(server):
    """Statuses a gRPC client reads (in the trailers), each call told to stop sending (RST_STREAM NO_ERROR)."""
    c = await Raw.connect(server.port)
    c.open(1, path="/test.Echo/Nope")
    _, flags, _, payload = await c.until(h2.HEADERS, 1)
    assert flags & h2.END_STREAM  # trailers-only: the status with the response headers
    assert c.headers(payload) == {":status": "200", "content-type": "application/grpc", "grpc-status":
                                  str(h2.UNIMPLEMENTED), "grpc-message": "unknown method /test.Echo/Nope"}  # fmt: skip
    _, _, _, payload = await c.until(h2.RST_STREAM, 1)
    assert struct.unpack(">I", payload)[0] == h2.NO_ERROR
    c.open(3)
    c.send(h2.DATA, 0, 3, b"\x00" + struct.pack(">I", 5 << 20) + b"x" * 1000)  # 5 MiB announced, over 4
    _, _, _, payload = await c.until(h2.HEADERS, 3)
    assert c.headers(payload)["grpc-status"] == str(h2.RESOURCE_EXHAUSTED)
    await c.until(h2.RST_STREAM, 3)
    c.message(3, b"more")  # the client's frames in flight: ignored
    c.open(5, end=True)
    _, _, _, payload = await c.until(h2.HEADERS, 5)
    assert c.headers(payload)["grpc-status"] == "0"
    assert server.log == ["reset", "end"]
    c.close()


async def test_a_lost_connection_resets_its_open_streams(server):
    c = await Raw.connect(server.port)
    c.open(1)
    c.message(1, b"w" * 10)
    c.send(h2.DATA, 0, 1, b"\x00" + struct.pack(">I", 100) + b"half")  # a message cut by the close
    await c.until(h2.DATA, 1)
    c.close()
    for _ in range(200):
        if "reset" in server.log:
            break
        await asyncio.sleep(0.01)
    assert server.log == ["message 10", "reset"]
    assert server.open_streams() == 0


async def test_compressed_message_and_non_grpc_content_type_are_refused(server):
    c = await Raw.connect(server.port)
    c.open(1)
    c.message(1, b"x", compressed=True)
    _, _, _, payload = await c.until(h2.HEADERS, 1)
    assert c.headers(payload)["grpc-status"] == str(h2.UNIMPLEMENTED)
    block = c.enc.encode([(":method", "POST"), (":path", METHOD), ("content-type", "text/plain")])
    c.send(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, 3, block)
    _, _, _, payload = await c.until(h2.HEADERS, 3)
    assert c.headers(payload)["grpc-status"] == str(h2.INVALID_ARGUMENT)
    c.close()


async def test_stop_drains_open_streams_and_refuses_new_ones():
    log: list[str] = []
    srv = h2.H2Server({METHOD: lambda s: Echo(s, log)}, max_message=1 << 20)
    port = srv.bind("127.0.0.1", 0)
    await srv.start()
    c = await Raw.connect(port)
    c.open(1)
    c.message(1, b"a")
    await c.until(h2.DATA, 1)
    stopping = asyncio.create_task(srv.stop(5))
    _, _, _, payload = await c.until(h2.GOAWAY)
    assert struct.unpack(">I", payload[4:8])[0] == h2.NO_ERROR and struct.unpack(">I", payload[:4])[0] == 1
    c.open(3)  # after GOAWAY: refused
    _, _, sid, payload = await c.until(h2.RST_STREAM)
    assert sid == 3 and struct.unpack(">I", payload)[0] == h2.REFUSED_STREAM
    assert not stopping.done()  # stream 1 is still open
    c.message(1, b"b", end=True)
    _, flags, _, payload = await c.until(h2.HEADERS, 1)
    assert flags & h2.END_STREAM and c.headers(payload)["grpc-status"] == "0"
    await asyncio.wait_for(stopping, 5)  # done as soon as the last stream is
    assert log == ["message 1", "message 1", "end"]
    c.close()


async def test_a_long_read_is_handled_in_slices():
    """Thirty messages read at once, each taking 1 ms to handle: the loop gets turns in between (h2.SLICE_S),
    so other work is not held behind the whole read."""
    handled: list[int] = []

    class Slow(Quiet):
        def on_message(self, data: bytes) -> None:
            t = time.perf_counter() + 0.001
            while time.perf_counter() < t:
                pass
            handled.append(len(data))

    srv, port = await _started(Slow)
    c = await Raw.connect(port)
    await c.until(h2.SETTINGS)
    seen: list[int] = []

    async def ticker() -> None:
        while len(handled) < 30:
            seen.append(len(handled))
            await asyncio.sleep(0)

    tick = asyncio.create_task(ticker())
    block = c.enc.encode([(":method", "POST"), (":path", METHOD), ("content-type", "application/grpc")])
    framed = b"".join(b"\x00" + struct.pack(">I", 4) + b"abcd" for _ in range(30))
    # One write (one read on the server): the headers, nine messages in one frame, the rest a frame each.
    frames = [h2.frame(h2.HEADERS, h2.END_HEADERS, 1, block), h2.frame(h2.DATA, 0, 1, framed[:45])]
    frames += [h2.frame(h2.DATA, h2.END_STREAM if i + 9 >= len(framed) else 0, 1, framed[i : i + 9])
               for i in range(45, len(framed), 9)]  # fmt: skip
    c.w.write(b"".join(frames))
    await asyncio.wait_for(tick, 5)
    _, flags, _, payload = await c.until(h2.HEADERS, 1)
    assert flags & h2.END_STREAM and c.headers(payload)["grpc-status"] == "0"
    assert handled == [4] * 30
    assert any(0 < n < 30 for n in seen), seen  # the loop ran between messages of the one read
    c.close()
    await srv.stop(0)


def _hpack_string(s: str) -> bytes:
    b = s.encode()
    assert len(b) < 127  # one length byte, no Huffman
    return bytes([len(b)]) + b


def _literal(name: str, value: str, indexed: bool = False) -> bytes:
    """An HPACK literal with a new name: added to the dynamic table (``indexed``) or not."""
    return (b"\x40" if indexed else b"\x00") + _hpack_string(name) + _hpack_string(value)


# A call's request headers as literals that leave the HPACK table as it is.
_BASE = b"".join(_literal(k, v) for k, v in ((":method", "POST"), (":scheme", "http"), (":path", METHOD),
                                             (":authority", "x"), ("content-type", "application/grpc")))  # fmt: skip


async def test_header_blocks_repeated_are_decoded_once_while_the_table_stands(monkeypatch):
    """Envoy opens every ext_proc stream with the same header block; it is decoded once, and decoded again
    as soon as the dynamic table it refers to changed, whether the table grew or an entry replaced another."""
    decoded: list[bytes] = []
    decode = hpack.Decoder.decode

    def counting(self: hpack.Decoder, data: bytes, raw: bool = False) -> object:
        decoded.append(bytes(data))
        return decode(self, data, raw)

    monkeypatch.setattr(hpack.Decoder, "decode", counting)
    seen: list[str | None] = []

    class Seen(Quiet):
        def __init__(self, stream: h2.GrpcStream) -> None:
            super().__init__(stream)
            seen.append(stream.headers.get("x-a"))

    srv, port = await _started(Seen)
    c = await Raw.connect(port)
    newest = _BASE + b"\xbe"  # the same bytes each time: x-a from the table's newest entry (index 62)
    blocks = [
        b"\x3f\x30" + _BASE + _literal("x-a", "1", indexed=True),  # the table cut to 79 bytes: two entries
        newest, newest, newest,  # "1": decoded once
        _BASE + _literal("x-a", "2", indexed=True),  # the table grows: ["2", "1"]
        newest,  # "2"
        _BASE + _literal("x-a", "3", indexed=True),  # "3" evicts "1": two entries as before, another newest
        newest, newest,  # "3"
    ]  # fmt: skip
    for i, block in enumerate(blocks):
        c.send(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, 2 * i + 1, block)
        await c.until(h2.HEADERS, 2 * i + 1)
    assert seen == ["1", "1", "1", "1", "2", "2", "3", "3", "3"]
    assert decoded.count(newest) == 3  # once per state of the table
    assert len(decoded) == 6
    c.close()
    await srv.stop(0)


async def test_a_repeated_block_that_resizes_the_table_is_decoded_each_time():
    """A block whose size update changes the table's limit without evicting leaves the entries as they
    were; replayed from a memo, the limit it sets would be lost and the next insertions would evict
    otherwise than the client's encoder does. Here the limit goes to 79 bytes (two entries), up to 4096,
    then the first block again: two insertions later, the third-newest entry is gone, as for the client."""
    srv, port = await _started(Quiet)
    c = await Raw.connect(port)
    small, large = b"\x3f\x30", b"\x3f\xe1\x1f"  # size updates to 79 and 4096 bytes
    blocks = [
        _BASE + _literal("x-a", "1", indexed=True),
        small + _BASE + b"\xbe", large + _BASE + b"\xbe", small + _BASE + b"\xbe",  # the limit 79, 4096, 79 again
        _BASE + _literal("x-a", "2", indexed=True),
        _BASE + _literal("x-a", "3", indexed=True),  # at 79 bytes: "1" evicted
    ]  # fmt: skip
    for i, block in enumerate(blocks):
        c.send(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, 2 * i + 1, block)
        await c.until(h2.HEADERS, 2 * i + 1)
    c.send(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, 2 * len(blocks) + 1, _BASE + b"\xc0")  # index 64: "1"
    _, _, _, payload = await c.until(h2.GOAWAY)
    assert struct.unpack(">I", payload[4:8])[0] == h2.COMPRESSION_ERROR
    c.close()
    await srv.stop(0)


async def test_answers_of_frames_read_together_are_written_together(monkeypatch):
    """Ten streams' messages in one read: their answers go in one socket write within COALESCE_S (a write per
    frame before: a third of kvroute's CPU when saturated), and with COALESCE_S 0 one write per frame."""
    writes: list[int] = []
    flush = h2._Connection._flush_out

    def counted(self: h2._Connection) -> None:
        if self._out and self.transport is not None:
            writes.append(len(self._out))
        flush(self)

    monkeypatch.setattr(h2._Connection, "_flush_out", counted)
    srv, port = await _started(lambda s: Echo(s, []))
    try:
        for coalesce, most in ((1.0, 2), (0.0, 10)):
            monkeypatch.setattr(h2, "COALESCE_S", coalesce)
            c = await Raw.connect(port)
            while not (await c.until(h2.SETTINGS))[1] & h2.ACK:  # the server's settings, then its ack of ours
                pass
            writes.clear()
            frames = []
            for sid in range(1, 21, 2):
                block = c.enc.encode([(":method", "POST"), (":path", METHOD), ("content-type", "application/grpc")])
                frames.append(h2.frame(h2.HEADERS, h2.END_HEADERS, sid, block))
                frames.append(h2.frame(h2.DATA, 0, sid, b"\x00" + struct.pack(">I", 2) + b"hi"))
            c.w.write(b"".join(frames))
            for sid in range(1, 21, 2):
                await c.until(h2.DATA, sid)
            # 10 answers (each its HEADERS and DATA frames) in at most `most` writes: with coalescing one,
            # or two where a host pause past SLICE_S cut the read's handling in two.
            assert sum(writes) == 10 and len(writes) <= most
            if coalesce == 0.0:
                assert len(writes) == 10  # one per message's frame, as the answers were written before
            c.close()
    finally:
        await srv.stop(0)
