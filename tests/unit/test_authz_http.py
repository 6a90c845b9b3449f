"""ext_authz over HTTP/1.1 (extproc/authz.py's HttpAuthorizer): requests parsed, answered with the decision
as headers, refusals and malformed input answered with their status, connections kept alive."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine

import orjson
import pytest

from extproc import envoy
from extproc.authz import (
    HTTP_HEAD_MAX,
    HttpAuthorizer,
    HttpAuthzServer,
    Pending,
    _BadRequest,
    _HttpConnection,
    _parse_head,
)
from extproc.config import build_config
from extproc.observability import Metrics
from extproc.router import Router
from extproc.server import ExternalProcessor, Stream
from tests.certs import make_certs
from tests.polling import eventually

PODS = ["127.0.1.1:8000", "127.0.1.2:8000"]
DEST = "x-gateway-destination-endpoint"


def test_heads_parse_and_repeats_join():
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-A: 1\r\nx-a: 2\r\nContent-Length: 5\r\n\r\n"
    assert _parse_head(head) == ("POST", "/v1/chat/completions", {"host": "x", "x-a": "1, 2", "content-length": "5"})


@pytest.mark.parametrize(
    "head,needle",
    [
        (b"POST /\r\n\r\n", "malformed request line"),
        (b"POST / SPDY/3\r\n\r\n", "unsupported protocol"),
        (b"POST / HTTP/1.1\r\nno-colon\r\n\r\n", "malformed header line"),
        (b"POST / HTTP/1.1\r\n x: folded\r\n\r\n", "malformed header line"),
    ],
)
def test_bad_heads_are_400(head, needle):
    with pytest.raises(_BadRequest, match=needle) as e:
        _parse_head(head)
    assert e.value.status == 400


def test_http_answer_carries_the_pick_and_the_fallbacks():
    resp = envoy.request_body_response(set_headers={DEST: PODS[0]}, metadata={DEST: ",".join(PODS)})
    raw = envoy.http_answer([resp])
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 200 OK" and body == b""
    assert f"{DEST}: {PODS[0]}" in lines and f"{envoy.HTTP_FALLBACKS_HEADER}: {','.join(PODS)}" in lines
    refused = envoy.http_answer([envoy.immediate(404, "model 'x' does not exist", "model_not_found")])
    head, _, body = refused.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404 Not Found") and b"content-type: application/json" in head
    assert orjson.loads(body)["error"]["code"] == 404


async def _server() -> tuple[HttpAuthorizer, int, Pending]:
    cfg = build_config({"pools": {"default": {"endpoints": [{"address": a} for a in PODS]}},
                        "server": {"max_body_bytes": 4096}})  # fmt: skip
    ep = ExternalProcessor(Router(cfg, Metrics()))
    pending = Pending(ep)
    srv = HttpAuthorizer(ep, pending)
    return srv, await srv.start("127.0.0.1", 0), pending


async def _exchange(port: int, raw: bytes, answers: int = 1) -> list[bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    out = []
    for _ in range(answers):
        head = await reader.readuntil(b"\r\n\r\n")
        n = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        out.append(head + await reader.readexactly(n))
    writer.close()
    return out


def _request(body: bytes, rid: str, extra: str = "") -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\n"
            f"x-request-id: {rid}\r\ncontent-length: {len(body)}\r\n{extra}\r\n").encode() + body  # fmt: skip


def test_requests_on_one_connection_are_routed_and_held_until_logged():
    async def go() -> None:
        srv, port, pending = await _server()
        chat = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]})
        a, b = await _exchange(port, _request(chat, "r1") + _request(chat, "r2"), answers=2)
        for answer in (a, b):
            assert answer.startswith(b"HTTP/1.1 200 OK") and DEST.encode() in answer
        assert len(pending) == 2 and pending.done("r1") and pending.done("r2")
        (bad,) = await _exchange(port, _request(b'{"model": "m", "messages": [', "r3"))
        assert bad.startswith(b"HTTP/1.1 400") and b"not valid JSON" in bad and len(pending) == 0
        await srv.stop()

    asyncio.run(go())


def test_a_request_in_pieces_is_answered_once_whole():
    async def go() -> None:
        srv, port, pending = await _server()
        chat = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]})
        raw = _request(chat, "r1") + _request(chat, "r2")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        cut = raw.index(b"\r\n\r\n") + 4
        for piece in (raw[:7], raw[7 : cut - 1], raw[cut - 1 : cut + 10], raw[cut + 10 :]):  # head, body, next request
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.01)  # each piece its own read on the server's side
        for _ in range(2):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200 OK") and DEST.encode() in head
        assert len(pending) == 2
        writer.close()
        await srv.stop()

    asyncio.run(go())


def test_an_answer_that_fails_closes_its_connection_and_the_server_serves_on(caplog):
    class Failing(HttpAuthzServer):
        calls = 0

        async def answer(self, method: str, target: str, headers: dict[str, str], body: bytes) -> bytes:
            Failing.calls += 1
            if Failing.calls == 1:
                raise RuntimeError("a bug")
            return envoy.http_response(200, {})

    async def go() -> None:
        srv = Failing(lambda: 1 << 20)
        port = await srv.start("127.0.0.1", 0)
        for expect in (b"", b"HTTP/1.1 200 OK"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_request(b"{}", "r"))
            got = await asyncio.wait_for(reader.read(), 5) if not expect else await reader.readuntil(b"\r\n\r\n")
            assert got.startswith(expect) and (expect or got == b"")
            writer.close()
        await srv.stop()

    asyncio.run(go())
    assert "ext_authz HTTP answer failed" in caplog.text


def test_bytes_behind_an_answer_being_decided_pause_reading_until_it_is_written():
    class Slow(HttpAuthzServer):
        async def answer(self, method: str, target: str, headers: dict[str, str], body: bytes) -> bytes:
            await release.wait()
            return envoy.http_response(200, {})

    class Transport:
        def __init__(self) -> None:
            self.calls: list[str] = []
            self.written = b""

        def pause_reading(self) -> None:
            self.calls.append("pause")

        def resume_reading(self) -> None:
            self.calls.append("resume")

        def write(self, data: bytes) -> None:
            self.written += data

    async def go() -> None:
        conn = _HttpConnection(Slow(lambda: 1 << 20))
        t = Transport()
        conn.connection_made(t)  # type: ignore[arg-type]
        conn.data_received(_request(b"{}", "r1"))
        await asyncio.sleep(0)  # the answer is being decided
        conn.data_received(b"x" * 1000)
        assert t.calls == []  # a little behind it is read on
        conn.data_received(b"x" * HTTP_HEAD_MAX)
        assert t.calls == ["pause"]
        release.set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert t.written.startswith(b"HTTP/1.1 200 OK") and t.calls == ["pause", "resume"]

    release = asyncio.Event()
    asyncio.run(go())


async def _whole(ep: ExternalProcessor, st: Stream, body: bytes) -> list[envoy.ProcessingResponse]:
    got = ep.decide_whole(st, body)
    return await got if isinstance(got, Coroutine) else got


def test_a_routed_whole_request_keeps_its_override_and_a_refused_or_rewritten_one_does_not(tmp_path):
    async def go() -> None:
        pool = {"default": {"endpoints": [{"address": a} for a in PODS]}}
        ep = ExternalProcessor(Router(build_config({"pools": pool}), Metrics()))
        chat = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]})
        head = {":method": "POST", ":path": "/v1/chat/completions", "x-request-id": "r", DEST: "spoofed"}
        st = ep.whole_request(dict(head), chat, None)
        answers = await _whole(ep, st, chat)
        assert st.routing is not None and st.routing["set_headers"][DEST] in PODS and st.routing["remove"] == []
        assert envoy.http_answer(answers, st.routing) == envoy.http_answer(answers)
        ep.release(st)
        refused = ep.whole_request(dict(head), b"{", None)
        assert (await _whole(ep, refused, b"{"))[0].HasField("immediate_response") and refused.routing is None
        (tmp_path / "secret").write_text("authz-secret-0123456789")
        tenancy = {"cache_salt": "inject", "secret_file": str(tmp_path / "secret")}
        ep = ExternalProcessor(Router(build_config({"pools": pool, "tenancy": tenancy}), Metrics()))
        salted = ep.whole_request({**head, "x-tenant-id": "acme"}, chat, None)  # the body is rewritten (cache_salt)
        answers = await _whole(ep, salted, chat)
        assert salted.routing is None
        with pytest.raises(envoy.BodyRewriteNeeded):
            envoy.http_answer(answers, salted.routing)
        ep.release(salted)

    asyncio.run(go())


@pytest.mark.parametrize(
    "raw,status",
    [
        (_request(b"x" * 5000, "big"), b"413"),
        (b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", b"501"),
        (b"POST / HTTP/1.1\r\ncontent-length: lots\r\n\r\n", b"400"),
        (b"POST / HTTP/1.1\r\nx-big: " + b"y" * 70_000 + b"\r\n\r\n", b"431"),
    ],
    ids=["body-too-large", "chunked", "bad-length", "head-too-large"],
)
def test_what_cannot_be_read_is_answered_and_closed(raw, status):
    async def go() -> None:
        srv, port, pending = await _server()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        answer = await reader.read()  # the server closes the connection after answering
        assert answer.startswith(b"HTTP/1.1 " + status), answer[:60]
        assert len(pending) == 0
        writer.close()
        await srv.stop()

    asyncio.run(go())


@pytest.mark.parametrize("tls", [False, True], ids=["workers", "tls"])
def test_the_http_port_refuses_workers_and_tls(tls, tmp_path):
    from extproc.errors import ConfigError

    server: dict = {"authz_http_port": 9010, "workers": 2}
    if tls:
        make_certs(tmp_path, {"kvroute": "DNS:kvroute"})
        server = {"authz_http_port": 9010, "tls": {"cert_file": str(tmp_path / "kvroute.crt"),
                                                   "key_file": str(tmp_path / "kvroute.key")}}  # fmt: skip
    with pytest.raises(ConfigError, match="plain HTTP" if tls else "one process only"):
        build_config({"pools": {"default": {"endpoints": [{"address": PODS[0]}]}}, "server": server})


class _Recorder:
    """A transport that keeps what is written (and whether it was closed)."""

    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def test_answers_given_at_once_are_written_in_the_read_callback_in_order_with_awaited_ones_between():
    """A decision that waits for nothing is written before data_received returns (no task); one that waits
    holds the requests behind it until it is written, then they are taken up in order."""

    class Mixed(HttpAuthzServer):
        def answer(self, method, target, headers, body):
            rid = headers["x-request-id"]
            out = envoy.http_response(200, {"x-id": rid})
            if rid != "slow":
                return out

            async def later() -> bytes:
                await release.wait()
                return out

            return later()

    async def go() -> None:
        conn = _HttpConnection(Mixed(lambda: 1 << 20))
        t = _Recorder()
        conn.connection_made(t)  # type: ignore[arg-type]
        conn.data_received(_request(b"{}", "a") + _request(b"{}", "b"))  # two in one read
        assert t.written.count(b"HTTP/1.1 200 OK") == 2 and t.written.index(b"x-id: a") < t.written.index(b"x-id: b")
        t.written = b""
        conn.data_received(_request(b"{}", "slow") + _request(b"{}", "c"))
        assert t.written == b""  # c waits behind the awaited answer
        release.set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert t.written.index(b"x-id: slow") < t.written.index(b"x-id: c") and not t.closed

    release = asyncio.Event()
    asyncio.run(go())


def test_an_answer_failing_at_once_closes_its_connection(caplog):
    class Broken(HttpAuthzServer):
        def answer(self, method, target, headers, body):
            raise RuntimeError("a bug")

    conn = _HttpConnection(Broken(lambda: 1 << 20))
    t = _Recorder()
    conn.connection_made(t)  # type: ignore[arg-type]
    conn.data_received(_request(b"{}", "a") + _request(b"{}", "b"))
    assert t.closed and t.written == b"" and "ext_authz HTTP answer failed" in caplog.text


def test_kvroute_answers_an_approximate_decision_at_once_and_holds_its_pod_slot():
    async def go() -> None:
        pool = {"default": {"endpoints": [{"address": a} for a in PODS]}}
        ep = ExternalProcessor(Router(build_config({"pools": pool}), Metrics()))
        pending = Pending(ep)
        chat = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]})
        headers = {"content-length": str(len(chat)), "x-request-id": "r1", "host": "h"}
        got = HttpAuthorizer(ep, pending).answer("POST", "/v1/chat/completions", headers, chat)
        assert isinstance(got, bytes) and got.startswith(b"HTTP/1.1 200 OK") and DEST.encode() in got
        assert len(pending) == 1 and pending.done("r1") and len(pending) == 0

    asyncio.run(go())


def test_a_decision_that_waits_is_answered_when_it_is_done_and_holds_its_pod_slot():
    """What waits after the decision (a precise prompt's deferred tokens, ``st.after``) makes the answer an
    awaitable: the HTTP connection runs it as a task, and its slot is held only once it is decided."""

    async def go() -> None:
        pool = {"default": {"endpoints": [{"address": a} for a in PODS]}}
        ep = ExternalProcessor(Router(build_config({"pools": pool}), Metrics()))
        decide, waited = ep._decide, asyncio.Event()

        def deciding(st, body, as_headers):  # type: ignore[no-untyped-def]
            out = decide(st, body, as_headers=as_headers)

            async def rest() -> list[envoy.ProcessingResponse]:
                await waited.wait()
                return []

            st.after = rest()
            return out

        ep._decide = deciding  # type: ignore[method-assign]
        pending = Pending(ep)
        chat = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]})
        headers = {"content-length": str(len(chat)), "x-request-id": "r1"}
        got = HttpAuthorizer(ep, pending).answer("POST", "/v1/chat/completions", headers, chat)
        assert not isinstance(got, bytes) and len(pending) == 0
        task = asyncio.ensure_future(got)  # type: ignore[arg-type]
        await asyncio.sleep(0)
        assert not task.done() and len(pending) == 0
        waited.set()
        out = await task
        assert out.startswith(b"HTTP/1.1 200 OK") and DEST.encode() in out and len(pending) == 1

    asyncio.run(go())


def test_a_held_check_whose_connection_closes_frees_its_pod():
    """routing.hold over ext_authz HTTP: Envoy gives up (its Check's connection closes) while the answer is
    held; the awaited answer is cancelled, the pod's slot and reservation given back, nothing left pending."""

    async def go() -> None:
        cfg = build_config({"pools": {"default": {"endpoints": [{"address": a} for a in PODS]}},
                            "routing": {"hold": {"enabled": True, "max_s": 5}}})  # fmt: skip
        ep = ExternalProcessor(Router(cfg, Metrics()))
        pods = ep.router.registry.pools["default"].endpoints
        for e in pods:
            e.prefills.add(30.0, time.monotonic())  # long prefills queued everywhere: a long prompt is held
        pending = Pending(ep)
        srv = HttpAuthorizer(ep, pending)
        port = await srv.start("127.0.0.1", 0)
        chat = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "lorem ipsum " * 2000}]})
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_request(chat, "r1"))
        (pod,) = await eventually(lambda: [e for e in pods if e.inflight], "the request held on a pod")
        assert pod.long_prefill_until > time.monotonic() + 4  # held (max_s 5), the pod reserved behind it
        writer.close()
        await eventually(lambda: not pod.inflight, "the pod's slot given back")
        assert pod.inflight == 0 and pod.long_prefill_until == 0.0 and len(pending) == 0
        assert await reader.read() == b""  # nothing was answered
        await srv.stop()

    asyncio.run(go())
