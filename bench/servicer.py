"""kvroute's own CPU per request over the do-nothing ext_proc servicer, in-process (no gRPC, no Envoy).

    python -m bench.servicer [--sizes 1k,8k] [--requests 400] [--rounds 7] [--loop uvloop|asyncio]
                             [--servers kvroute,noop] [--evict-mib 0]

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
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from bench.noop_extproc import Noop
from bench.overhead import DEFAULT_SIZES, SIZES, chat_bodies, parse_sizes
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


async def exchange(servicer: Any, messages: Sequence[bytes], context: Any) -> int:
    """One stream through ``servicer.Process``: messages parsed, answers serialized; the answers' count."""
    n = 0
    async for resp in servicer.Process(incoming(messages), context):
        resp.SerializeToString()
        n += 1
    return n


async def routed(servicer: Any, messages: Sequence[bytes]) -> str:
    """The pod ``servicer`` routes a request to (its body answer's destination header); RuntimeError
    if it answers otherwise (an error, no override): the bench would time the wrong path."""
    answers = [resp async for resp in servicer.Process(incoming(messages), StreamContext())]
    kinds = [a.WhichOneof("response") for a in answers]
    if kinds != ["request_headers", "request_body"]:
        raise RuntimeError(f"expected a headers and a body answer, got {kinds}")
    sets = answers[1].request_body.response.header_mutation.set_headers
    dest = [h.header.raw_value.decode() for h in sets if h.header.key == DESTINATION]
    if not dest:
        raise RuntimeError(f"the body answer sets no {DESTINATION}: {answers[1]}")
    return dest[0]


def make_servicers() -> dict[str, Any]:
    """kvroute as ``kvroute serve --endpoints`` runs it (EPP mode, defaults) over 4 pods, and the floor."""
    cfg = build_config({"pools": {"default": {"endpoints": [{"address": a} for a in PODS]}}})
    return {"kvroute": ExternalProcessor(Router(cfg, Metrics())), "noop": Noop(PODS[0])}


class Evictor:
    """Pushes what a request left in the CPU's caches out: one copy between two ``mib`` MiB buffers."""

    def __init__(self, mib: int) -> None:
        self._src = bytearray(b"\x01") * (mib << 20)
        self._dst = bytearray(len(self._src))

    def __call__(self) -> None:
        self._dst[:] = self._src


async def batch_cpu(
    servicer: Any, requests: Sequence[tuple[bytes, bytes]], evict: Callable[[], None] | None = None
) -> float:
    """CPU seconds of this process for ``requests`` through ``servicer``, one stream after another;
    with ``evict``, the caches are evicted before each request and only the requests are timed."""
    ctx = StreamContext()
    if evict is None:
        c0 = time.process_time()
        for messages in requests:
            await exchange(servicer, messages, ctx)
        return time.process_time() - c0
    spent = 0.0
    for messages in requests:
        evict()
        c0 = time.process_time()
        await exchange(servicer, messages, ctx)
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
    size: str, requests: int, rounds: int, servers: Sequence[str] = SERVERS, evict_mib: int = 0
) -> Figures:
    """``rounds`` interleaved rounds of ``requests`` requests of ``size`` chats through each servicer,
    after a warm-up round (every document seen once: the index is warm, as after bench.overhead's);
    ``evict_mib``: the CPU's caches evicted before each request (``Evictor``)."""
    evict = Evictor(evict_mib) if evict_mib > 0 else None
    servicers = make_servicers()
    batch = [request_messages(b) for b in chat_bodies(SIZES[size], requests)]
    for name in servers:
        await routed(servicers[name], batch[0])
        await batch_cpu(servicers[name], batch[:DOCS])
    got: dict[str, list[float]] = {name: [] for name in servers}
    for _ in range(rounds):
        for name in servers:
            got[name].append(1e6 * await batch_cpu(servicers[name], batch, evict) / len(batch))
    return Figures(size, got)


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
    a = ap.parse_args()
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
    print(
        f"CPU us per request ({a.requests} requests x {a.rounds} rounds, {a.loop}, {caches}; min / median of rounds)\n"
    )
    print("| chat | kvroute | noop | kvroute own |")
    print("|---|---|---|---|")
    for size in sizes:
        s = run_loop(a.loop, measure(size, a.requests, a.rounds, servers, a.evict_mib)).summary()

        def cell(name: str, s: dict[str, float] = s) -> str:
            return f"{s[name + '_min_us']:.1f} / {s[name + '_median_us']:.1f}" if name + "_min_us" in s else "-"

        print(f"| {size} | {cell('kvroute')} | {cell('noop')} | {cell('own')} |")


if __name__ == "__main__":
    main()
