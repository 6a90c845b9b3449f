"""A do-nothing ext_proc server: the floor of any Python (grpcio) external processor.

``python -m bench.noop_extproc --port P --target IP:PORT[,IP:PORT...] [--server aio|uvloop|sync] [--ready-file F]``
answers every message with an empty CONTINUE, except the request body, which it answers with the
routing header set to ``--target`` (so Envoy's epp.yaml still routes; several targets: each request the
next, round robin, from answers built at start). ``bench.overhead`` runs it beside kvroute: the
difference between the two is kvroute's own work; the rest is the price of gRPC in Python. The routing
benchmark runs it as the ``noop-extproc`` policy (bench/harness.py): the path of any Python ext_proc
router, without a decision, beside kvroute's. ``--server`` picks how grpcio serves it
(``bench.overhead --variants`` compares them): ``aio`` (grpc.aio on asyncio's loop, what kvroute
runs), ``uvloop`` (grpc.aio on uvloop), ``sync`` (grpcio's synchronous server: a thread per open
stream from a pool of ``--threads``), ``h2`` (not grpcio: kvroute's own HTTP/2 gRPC server, extproc/h2.py,
on uvloop; ext_proc only).
``--grpc-arg NAME=INT`` passes a channel argument to the server (e.g. ``grpc.http2.bdp_probe=0``).
When Envoy sends the body without waiting for the headers' answer (STREAMED with
``send_body_without_waiting_for_header_response``, or FULL_DUPLEX_STREAMED), it holds the headers' answer
until the body's end and routes there, as kvroute does: then one empty answer per held chunk (STREAMED) or
the body streamed back (full duplex).
The aio and uvloop servers also answer ext_authz's Check (``envoy/epp-authz.yaml``: one unary call per
request with the whole body) with the routing header, and take Envoy's gRPC access log stream (kvroute
learns each request's end there): the floor of the ext_authz transport, built the same way (answers
made once, translated from the ext_proc ones as kvroute's are). ``--authz-http`` also answers ext_authz
over HTTP/1.1 on a free port (kvroute's HTTP server, with a fixed answer; the ready file's
``http_port``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.auth.v3 import external_auth_pb2_grpc as authz_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc import envoy, h2
from extproc.authz import HttpAuthzServer

SERVERS = ("aio", "uvloop", "sync", "h2")


class _Answers:
    """The answers, built once: a do-nothing server's cost is gRPC's alone."""

    def __init__(self, target: str) -> None:
        route = {"x-gateway-destination-endpoint": target}
        self.by_kind = {
            "request_headers": envoy.request_headers_response(),
            "request_body": envoy.request_body_response(set_headers=route, clear_route_cache=True),
            "response_headers": envoy.response_headers_response(),
            "response_body": envoy.response_body_response(),
            "request_trailers": envoy.request_trailers_response(),
            "response_trailers": envoy.response_trailers_response(),
        }
        # A held headers answer routes.
        self.route_headers = envoy.request_headers_response(set_headers=route, clear_route_cache=True)
        self.check = envoy.check_answer([self.by_kind["request_body"]])  # ext_authz: the same route
        self.http = envoy.http_answer([self.by_kind["request_body"]])  # and over HTTP
        self.chunk = envoy.request_body_response()  # a held chunk's answer: the headers' answer routed


class _RoundRobin:
    """Each request's answers routed to the next of several targets (answers built once per target)."""

    def __init__(self, targets: str) -> None:
        names = [t.strip() for t in targets.split(",")]
        if not all(names):
            raise ValueError(f"--target: an empty address in {targets!r}")
        self._next = itertools.cycle([_Answers(t) for t in names]).__next__

    def __call__(self) -> _Answers:
        return self._next()


class _Stream:
    """One request's stream: what is held while Envoy sends the body without waiting for the headers' answer."""

    def __init__(self, answers: _Answers) -> None:
        self.answers = answers
        self.hold = self.full_duplex = False
        self.held = 0  # STREAMED chunks whose answers wait for the body's end
        self.body = bytearray()  # full duplex: the body, streamed back at its end

    def answer(self, msg: envoy.ProcessingRequest) -> list[envoy.ProcessingResponse]:
        a = self.answers
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            self.full_duplex, no_wait = envoy.body_modes(msg)
            self.hold = (self.full_duplex or no_wait) and not msg.request_headers.end_of_stream
            if self.hold:
                return []
        elif kind == "request_body" and self.hold:
            if self.full_duplex:
                self.body += msg.request_body.body
            else:
                self.held += 1
            if not msg.request_body.end_of_stream:
                return []
            self.hold = False
            if self.full_duplex:
                return [a.route_headers, *envoy.streamed_body(bytes(self.body))]
            return [a.route_headers, *[a.chunk] * self.held]
        resp = a.by_kind.get(kind) if kind is not None else None
        return [resp] if resp is not None else []


class Noop(pb_grpc.ExternalProcessorServicer):
    def __init__(self, target: str) -> None:
        self.answers = _RoundRobin(target)

    async def Process(
        self, request_iterator: AsyncIterator[envoy.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[envoy.ProcessingResponse]:
        st = _Stream(self.answers())
        async for msg in request_iterator:
            for resp in st.answer(msg):
                yield resp


class NoopCheck(authz_grpc.AuthorizationServicer):
    def __init__(self, target: str) -> None:
        self.answers = _RoundRobin(target)

    async def Check(self, request: envoy.CheckRequest, context: grpc.aio.ServicerContext) -> envoy.CheckResponse:
        return self.answers().check


class NoopHttpCheck(HttpAuthzServer):
    def __init__(self, target: str) -> None:
        super().__init__(lambda: 1 << 30)
        self.answers = _RoundRobin(target)

    def answer(self, method: str, target: str, headers: dict[str, str], body: bytes) -> bytes:
        return self.answers().http  # given at once, as kvroute's decisions are (no task)


class NoopAccessLog(als_pb2_grpc.AccessLogServiceServicer):
    """Reads Envoy's access log stream to its end (each entry's id, as kvroute does), keeps nothing."""

    async def StreamAccessLogs(
        self, request_iterator: AsyncIterator[envoy.AccessLogs], context: grpc.aio.ServicerContext
    ) -> envoy.AccessLogsResponse:
        async for msg in request_iterator:
            envoy.finished_request_ids(msg)
        return envoy.AccessLogsResponse()


class SyncNoop(pb_grpc.ExternalProcessorServicer):
    def __init__(self, target: str) -> None:
        self.answers = _RoundRobin(target)  # the cycle's next is one C call under the GIL: safe across threads

    def Process(
        self, request_iterator: Iterator[envoy.ProcessingRequest], context: grpc.ServicerContext
    ) -> Iterator[envoy.ProcessingResponse]:
        st = _Stream(self.answers())
        for msg in request_iterator:
            yield from st.answer(msg)


class NoopH2:
    """The do-nothing answers over kvroute's own HTTP/2 gRPC server (extproc/h2.py), on uvloop."""

    def __init__(self, stream: h2.GrpcStream, answers: _Answers) -> None:
        self.stream = stream
        self.st = _Stream(answers)

    def on_message(self, data: bytes) -> None:
        for resp in self.st.answer(envoy.ProcessingRequest.FromString(data)):
            self.stream.send(resp.SerializeToString())

    def on_end(self) -> None:
        self.stream.finish()

    def on_reset(self) -> None:
        pass


async def serve_h2(port: int, target: str, ready_file: str | None) -> None:
    answers = _RoundRobin(target)
    server = h2.H2Server({h2.EXT_PROC_PATH: lambda stream: NoopH2(stream, answers())}, max_message=1 << 30)
    bound = server.bind("127.0.0.1", port)
    await server.start()
    _ready(ready_file, bound)
    await asyncio.Event().wait()


def _ready(ready_file: str | None, port: int, http_port: int | None = None) -> None:
    if ready_file:
        Path(ready_file).write_text(json.dumps({"port": port, **({"http_port": http_port} if http_port else {})}))


async def serve_aio(
    port: int, target: str, ready_file: str | None, options: list[tuple[str, Any]], unix: str | None = None,
    authz_http: bool = False,
) -> None:  # fmt: skip
    server = grpc.aio.server(options=options)
    pb_grpc.add_ExternalProcessorServicer_to_server(Noop(target), server)
    authz_grpc.add_AuthorizationServicer_to_server(NoopCheck(target), server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(NoopAccessLog(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    if unix:  # Envoy dials this one (``--unix``); the port stays for whoever asks the ready file
        server.add_insecure_port(f"unix:{unix}")
    await server.start()
    http_port = await NoopHttpCheck(target).start("127.0.0.1", 0) if authz_http else None
    _ready(ready_file, bound, http_port)
    await server.wait_for_termination()


def serve_sync(port: int, target: str, ready_file: str | None, options: list[tuple[str, Any]], threads: int) -> None:
    # A stream holds its thread until it ends: the pool bounds the open streams (concurrent requests).
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=options,
                         maximum_concurrent_rpcs=threads)  # fmt: skip
    pb_grpc.add_ExternalProcessorServicer_to_server(SyncNoop(target), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    _ready(ready_file, bound)
    server.wait_for_termination()


def parse_grpc_arg(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=INT, got {text!r}")
    try:
        return name, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}: {value!r} is not an integer") from None


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.noop_extproc", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--target", required=True,
                    help="ip:port every request is routed to; a comma list: round robin over them")  # fmt: skip
    ap.add_argument("--server", choices=SERVERS, default="aio", help="how grpcio serves (default aio)")
    ap.add_argument("--threads", type=int, default=64, help="--server sync: the thread pool (open streams)")
    ap.add_argument("--grpc-arg", type=parse_grpc_arg, action="append", default=[], metavar="NAME=INT",
                    help="a gRPC server channel argument (repeatable)")  # fmt: skip
    ap.add_argument("--unix", metavar="PATH", help="also listen on this Unix socket (aio and uvloop servers)")
    ap.add_argument("--authz-http", action="store_true",
                    help="also answer ext_authz over HTTP on a free port (aio and uvloop servers)")  # fmt: skip
    ap.add_argument("--ready-file")
    a = ap.parse_args()
    if a.server == "sync":
        if a.unix or a.authz_http:
            ap.error("--unix, --authz-http: with --server aio or uvloop")
        serve_sync(a.port, a.target, a.ready_file, a.grpc_arg, a.threads)
    elif a.server == "h2":
        if a.unix or a.authz_http or a.grpc_arg:
            ap.error("--unix, --authz-http, --grpc-arg: with --server aio or uvloop")
        import uvloop

        uvloop.run(serve_h2(a.port, a.target, a.ready_file))
    elif a.server == "uvloop":
        import uvloop

        uvloop.run(serve_aio(a.port, a.target, a.ready_file, a.grpc_arg, a.unix, a.authz_http))
    else:
        asyncio.run(serve_aio(a.port, a.target, a.ready_file, a.grpc_arg, a.unix, a.authz_http))


if __name__ == "__main__":
    main()
