"""Decisions per second at saturation: ``kvroute serve --workers 1`` beside ``--workers 2`` (and more).

    python -m bench.workers [--workers 1,2] [--duration 10] [--clients 2] [--connections 8]
                            [--concurrency 64] [--tokens 8000] [--sharing relay,redis]
                            [--api ext_proc,ext_proc_h2,ext_authz_http]

Drives kvroute's ext_proc port directly (no Envoy, no pods: the pods' addresses are never dialed):
``--clients`` load processes each hold ``--connections`` gRPC connections (separate ones, so the
kernel's SO_REUSEPORT spreads them over the workers, as it spreads Envoy's) and keep
``--concurrency`` streams in flight in all, each one request (headers, then an OpenAI chat body of
about ``--tokens`` tokens over a set of shared documents, as bench.overhead's) answered with kvroute's
routing decision. Closed loop: a stream starts when another ends, so kvroute is saturated.
``--api ext_proc_h2`` drives the same streams into kvroute's own HTTP/2 server (``server.h2_port``) instead
of grpcio's. ``--api ext_authz_http`` runs (one worker: the HTTP port serves one process) drive kvroute's ext_authz
HTTP port instead, as ``kvroute envoy-config --api ext_authz_http``'s Envoy does: ``--concurrency``
keep-alive connections, one Check at a time each, every answered request reported finished on a gRPC
access log stream every 20 ms, so kvroute releases its pod slot as it does behind Envoy (the run fails
if it released fewer than it answered).
Reported per run: decisions/s, stream latency p50/p99 (ms) and kvroute's CPU (all its processes:
``cpu`` cores busy). ``--sharing``: how the workers share state (relay: the supervisor relays, the
default without Redis; redis: a redis-server on loopback) and ``lag_ms``, the median time a record
took from one worker to the other (kvroute_<relay|redis>{stat="lag_ms"}). The load processes share
the machine's cores with kvroute: their CPU is reported too (``client_cpu``). ``per_core``:
decisions/s over the cores kvroute kept busy.

``--peers sglang-router`` (the default; ``--peers ''`` for none) adds each peer router's row beside
kvroute's: the peer as the full HTTP proxy it is, over instant backends (bench.instant, one per pod
address), saturated the same way by HTTP load processes (the same bodies, ``--connections`` and
``--concurrency``); its requests/s stand in the decisions/s column, its CPU (the router process
alone) in ``cpu``, the backends' in ``backend_cpu``. Needs ``make peers``; a peer not installed is
skipped with a note.

    python -m bench.workers --transport [--entries 2000] [--flush-interval 0.005] [--poll 0.001,0.0001]

The measurement behind the relay (extproc/state/relay.py): shared-state entries from one process to
another every ``--flush-interval``, through the supervisor's relay and through a shared-memory ring
polled every ``--poll`` seconds; lag p50/p99, the reader's CPU and the relay hop's CPU (cores).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import re
import struct
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import msgpack
from envoy.config.core.v3 import address_pb2, base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from bench.kvroute import KVRouteProcess
from bench.loadgen import percentile
from bench.overhead import chat_bodies
from bench.peers import PeerRouter, PeerUnavailable
from bench.procs import cpu_seconds, python_module, start_with_ready_file, stop
from bench.redis_server import RedisServer
from extproc.state.relay import frame, read_frame

PODS = [f"127.0.1.{i}:8000" for i in range(1, 9)]  # never dialed
DEST = "x-gateway-destination-endpoint"


def request_messages(body: bytes, headers: dict[str, str] | None = None) -> list[pb.ProcessingRequest]:
    """One OpenAI request as Envoy sends it in BUFFERED mode: the headers, then the whole body."""
    hs = {":path": "/v1/chat/completions", ":method": "POST", "content-type": "application/json", **(headers or {})}
    head = pb.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()]))  # fmt: skip
    return [pb.ProcessingRequest(request_headers=head),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]  # fmt: skip


def channel(port: int) -> grpc.aio.Channel:
    """A channel with a connection of its own (grpc shares subchannels between alike channels)."""
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])


async def decide(stub: pb_grpc.ExternalProcessorStub, body: bytes, headers: dict[str, str] | None = None) -> str:
    """One ext_proc stream: the pod kvroute picked (the header it set on the body's answer)."""
    async for resp in stub.Process(iter(request_messages(body, headers)), timeout=10):
        if resp.HasField("immediate_response"):
            raise RuntimeError(f"kvroute answered {resp.immediate_response.status.code}")
        if resp.HasField("request_body"):
            for h in resp.request_body.response.header_mutation.set_headers:
                if h.header.key == DEST:
                    return h.header.raw_value.decode() or h.header.value
            raise RuntimeError("kvroute's answer names no pod")
    raise RuntimeError("the stream ended without an answer")


async def _load(port: int, bodies: list[bytes], connections: int, concurrency: int, until: float) -> list[float]:
    chans = [channel(port) for _ in range(connections)]
    stubs = [pb_grpc.ExternalProcessorStub(c) for c in chans]
    latencies: list[float] = []
    next_body = iter(range(10**9))

    async def one(slot: int) -> None:
        stub = stubs[slot % len(stubs)]
        while time.monotonic() < until:
            body = bodies[next(next_body) % len(bodies)]
            t0 = time.perf_counter()
            await decide(stub, body)
            latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(one(i) for i in range(concurrency)))
    for c in chans:
        await c.close()
    return latencies


@dataclass(frozen=True)
class AuthzHttp:
    """kvroute's ext_authz HTTP port and its gRPC port (for the access log), driven as Envoy's
    ext_authz filter would (``kvroute envoy-config --api ext_authz_http``)."""

    http_port: int
    grpc_port: int


def _log_entry(rid: str, body_bytes: int) -> al.HTTPAccessLogEntry:
    """Envoy's access log entry of one finished chat request (the fields its http_grpc logger fills)."""

    def addr(port: int) -> address_pb2.Address:
        return address_pb2.Address(socket_address=address_pb2.SocketAddress(address="127.0.0.1", port_value=port))

    common = al.AccessLogCommon(
        downstream_remote_address=addr(40000), downstream_local_address=addr(10000),
        upstream_remote_address=addr(8000), upstream_cluster="pool", route_name="inference",
    )  # fmt: skip
    common.start_time.GetCurrentTime()
    common.duration.FromMilliseconds(40)
    request = al.HTTPRequestProperties(request_method=base_pb2.POST,
                                       scheme="http", authority="127.0.0.1:10000", path="/v1/chat/completions",
                                       user_agent="python-httpx/0.28.1", request_id=rid, request_headers_bytes=180,
                                       request_body_bytes=body_bytes)  # fmt: skip
    response = al.HTTPResponseProperties(response_code={"value": 200}, response_headers_bytes=120,
                                         response_body_bytes=800)  # fmt: skip
    return al.HTTPAccessLogEntry(common_properties=common, request=request, response=response)


async def _authz_http_load(target: AuthzHttp, bodies: list[bytes], connections: int, concurrency: int,
                           until: float) -> list[float]:  # fmt: skip
    """kvroute's ext_authz HTTP port kept saturated as Envoy's ext_authz filter keeps it: ``concurrency``
    keep-alive connections, one request at a time each (Envoy does not pipeline), every answered
    request reported finished on one access log stream every 20 ms (Envoy's buffer_flush_interval in
    envoy/epp-authz-http.yaml), so kvroute releases its pod slot as it does behind Envoy."""
    latencies: list[float] = []
    finished: list[al.HTTPAccessLogEntry] = []
    next_body = itertools.count()
    prefix = f"{os.getpid()}-{time.monotonic_ns()}-"  # ids unique across load processes and runs
    chan = channel(target.grpc_port)
    log = als_pb2_grpc.AccessLogServiceStub(chan).StreamAccessLogs()
    first = als_pb2.StreamAccessLogsMessage.Identifier(log_name="kvroute_finished")
    first.node.id = "bench"

    async def flush() -> None:
        nonlocal first
        while time.monotonic() < until or finished:
            await asyncio.sleep(0.02)
            if finished:
                msg = als_pb2.StreamAccessLogsMessage(http_logs={"log_entry": finished[:]})
                if first is not None:
                    msg.identifier.CopyFrom(first)
                    first = None
                finished.clear()
                await log.write(msg)

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", target.http_port)
        try:
            while time.monotonic() < until:
                n = next(next_body)
                body, rid = bodies[n % len(bodies)], f"{prefix}{n}"
                head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:10000\r\n"
                        f"content-type: application/json\r\nx-request-id: {rid}\r\n"
                        f"content-length: {len(body)}\r\n\r\n")  # fmt: skip
                t0 = time.perf_counter()
                writer.write(head.encode() + body)
                answer = await reader.readuntil(b"\r\n\r\n")
                if not answer.startswith(b"HTTP/1.1 200") or DEST.encode() not in answer:
                    raise RuntimeError(f"kvroute answered {answer[:200]!r}")
                length = re.search(rb"content-length: (\d+)", answer, re.I)
                if length and int(length[1]):
                    await reader.readexactly(int(length[1]))
                latencies.append(time.perf_counter() - t0)
                finished.append(_log_entry(rid, len(body)))
        finally:
            writer.close()

    flusher = asyncio.create_task(flush())
    await asyncio.gather(*(one() for _ in range(concurrency)))
    await flusher
    await log.done_writing()
    await log
    await chan.close()
    return latencies


async def _http_load(url: str, bodies: list[bytes], connections: int, concurrency: int, until: float) -> list[float]:
    """A peer router (a full HTTP proxy) kept saturated: ``concurrency`` chat requests in flight over
    at most ``connections`` connections; latency of each answered one (any other answer: an error)."""
    latencies: list[float] = []
    next_body = itertools.count()
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections), timeout=timeout) as session:

        async def one() -> None:
            while time.monotonic() < until:
                body = bodies[next(next_body) % len(bodies)]
                t0 = time.perf_counter()
                async with session.post(url + "/v1/chat/completions", data=body,
                                        headers={"content-type": "application/json"}) as r:  # fmt: skip
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{url} answered {r.status}")
                latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(one() for _ in range(concurrency)))
    return latencies


def _load_for(target: int | str | AuthzHttp) -> Any:
    """kvroute's ext_proc port (gRPC streams), its ext_authz HTTP port or a peer's URL (HTTP requests)."""
    if isinstance(target, AuthzHttp):
        return _authz_http_load
    return _load if isinstance(target, int) else _http_load


def _client(target: int | str | AuthzHttp, bodies: list[bytes], connections: int, concurrency: int, start: float,
            until: float, out: Any) -> None:  # fmt: skip
    time.sleep(max(0.0, start - time.time()))
    t = time.process_time()
    load = _load_for(target)
    try:
        lat = asyncio.run(load(target, bodies, connections, concurrency, time.monotonic() + (until - start)))
    except Exception as e:  # the parent says what failed, rather than waiting for an answer that never comes
        out.put(f"load on {target} failed: {e!r}")
        return
    out.put((lat, time.process_time() - t))


def _saturate(
    target: int | str | AuthzHttp,
    pids: Sequence[int],
    bodies: list[bytes],
    a: argparse.Namespace,
    backends: Sequence[int] = (),
) -> dict[str, Any]:
    """Warm ``target`` up, then ``--clients`` load processes keep it saturated for ``--duration``:
    what it answered (latencies), its CPU (``pids``, cores busy), the clients' and the ``backends``'."""
    asyncio.run(_load_for(target)(target, bodies, a.connections, a.concurrency, time.monotonic() + a.warmup))
    cpu0 = sum(cpu_seconds(p) for p in pids)
    back0 = sum(cpu_seconds(p) for p in backends)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start = time.time() + 1.0  # the load processes start together, after their imports
    each = (target, bodies, max(1, a.connections // a.clients), max(1, a.concurrency // a.clients))
    procs = [ctx.Process(target=_client, args=(*each, start, start + a.duration, q)) for _ in range(a.clients)]
    for p in procs:
        p.start()
    got = [q.get(timeout=a.duration + 60) for _ in procs]
    for p in procs:
        p.join()
    if failed := [g for g in got if isinstance(g, str)]:
        raise RuntimeError("; ".join(failed))
    cpu = (sum(cpu_seconds(p) for p in pids) - cpu0) / a.duration
    backend_cpu = (sum(cpu_seconds(p) for p in backends) - back0) / a.duration
    lat = [x for lats, _ in got for x in lats]
    return {
        "decisions": len(lat),
        "decisions_per_s": round(len(lat) / a.duration, 1),
        "per_core": round(len(lat) / a.duration / cpu) if cpu > 0 else 0,
        "p50_ms": round(1e3 * (percentile(lat, 0.5) or 0), 2),
        "p99_ms": round(1e3 * (percentile(lat, 0.99) or 0), 2),
        "cpu": round(cpu, 2),
        "client_cpu": round(sum(c for _, c in got) / a.duration, 2),
        "backend_cpu": round(backend_cpu, 2) if backends else "",
    }


def _worker_pids(metrics: str) -> list[int]:
    return [int(float(v)) for v in re.findall(r"^kvroute_worker_pid\{[^}]*\} (\S+)$", metrics, re.M)]


def _stat(metrics: str, family: str, stat: str) -> float:
    m = re.search(rf'^{family}\{{stat="{stat}"\}} (\S+)$', metrics, re.M)
    return float(m[1]) if m else 0.0


def _released(metrics: str) -> float:
    m = re.search(r'^kvroute_authz_access_log_entries_total\{result="released"\} (\S+)$', metrics, re.M)
    return float(m[1]) if m else 0.0


def run_once(workers: int, sharing: str, bodies: list[bytes], a: argparse.Namespace,
             api: str = "ext_proc") -> dict[str, Any]:  # fmt: skip
    """kvroute with ``workers`` sharing state by ``sharing``, saturated on its ``api`` transport's port."""
    with contextlib.ExitStack() as stack:
        args = ["--workers", str(workers)]
        if sharing == "redis":
            redis = stack.enter_context(RedisServer())
            args += ["--redis-url", redis.url]
        kv = stack.enter_context(
            KVRouteProcess(PODS, args, authz_http=api == "ext_authz_http", h2=api == "ext_proc_h2")
        )
        assert kv.proc is not None
        pids = [kv.proc.pid, *(_worker_pids(kv.metrics()) if workers > 1 else [])]
        target = AuthzHttp(kv.authz_http_port, kv.grpc_port) if api == "ext_authz_http" else kv.ext_proc_port
        # The warm-up lets each worker's index learn the documents.
        got = _saturate(target, pids, bodies, a)
        metrics = kv.metrics()
    if api == "ext_authz_http" and (released := _released(metrics)) < got["decisions"]:
        # every request the load processes saw answered was reported finished: if kvroute did not release
        # them, its pods' in-flight counts grew through the run and this is not the path Envoy drives
        raise RuntimeError(f"kvroute released {released:.0f} pod slots for {got['decisions']} decisions")
    family = "kvroute_relay" if sharing == "relay" else "kvroute_redis"
    return {
        "router": f"kvroute ({api} decisions)",
        "workers": workers,
        "sharing": sharing if workers > 1 or sharing == "redis" else "none",
        **got,
        "lag_ms": round(_stat(metrics, family, "lag_ms"), 2),
    }


def run_peer(name: str, bodies: list[bytes], a: argparse.Namespace) -> dict[str, Any]:
    """``name`` (cache_aware) as a full proxy over instant backends, one per pod address kvroute gets."""
    backends, addrs = start_with_ready_file(python_module("bench.instant", "--ports", ",".join(["0"] * len(PODS))))
    assert isinstance(addrs, list)
    try:
        with PeerRouter(name, "cache_aware", [f"http://{x}" for x in addrs]) as peer:
            assert peer.proc is not None
            got = _saturate(peer.url, [peer.proc.pid], bodies, a, backends=[backends.pid])
    finally:
        stop(backends)
    return {"router": f"{name} (cache_aware, full proxy)", "workers": "", "sharing": "", **got, "lag_ms": ""}


APIS = ("ext_proc", "ext_proc_h2", "ext_authz_http")


def runs(a: argparse.Namespace) -> Iterator[tuple[int, str, str]]:
    """(workers, sharing, api) of each kvroute run: every api with one worker, ext_proc (over grpcio or
    kvroute's own HTTP/2 server) with more (the HTTP port serves one process: extproc/authz.py)."""
    for api in a.api.split(","):
        if api not in APIS:
            raise SystemExit(f"--api: {api!r} is not one of {', '.join(APIS)}")
        for sharing in a.sharing.split(","):
            for n in (int(x) for x in a.workers.split(",")):
                if (n == 1 and sharing != "relay") or (n > 1 and api == "ext_authz_http"):
                    continue  # one worker shares nothing: one run of it is enough
                yield n, sharing, api


# -- --transport: how workers could exchange shared-state entries on one host ------------------------

ENTRY_RECORDS = 16  # records per entry: a busy worker's 5 ms of decisions, 32 block keys each


def _entry() -> bytes:
    keys = array("Q", range(32)).tobytes()
    return msgpack.packb({"o": [["x", "approx", PODS[i % 8], keys] for i in range(ENTRY_RECORDS)],
                          "l": [[p, 3, 0.05] for p in PODS], "t": time.time()})  # fmt: skip


def _stamped(entry: bytes) -> bytes:
    """``entry`` with the time now (msgpack maps are re-packed: the cost a real writer pays too)."""
    d = msgpack.unpackb(entry)
    d["t"] = time.time()
    return msgpack.packb(d)


def _lag(m: bytes) -> float:
    return time.time() - float(msgpack.unpackb(m)["t"])


async def _relay_writer(path: str, n: int, gap_s: float) -> None:
    _, writer = await asyncio.open_unix_connection(path)
    writer.write(frame({"t": "hello", "role": "relay", "replica": "a"}))
    entry = _entry()
    for _ in range(n):
        writer.write(frame(["a", _stamped(entry)]))
        await writer.drain()
        await asyncio.sleep(gap_s)
    await asyncio.sleep(1.0)
    writer.close()


async def _relay_reader(path: str, n: int, out: Any) -> None:
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(frame({"t": "hello", "role": "relay", "replica": "b"}))
    out.put("ready")
    lags, cpu = [], time.process_time()
    for _ in range(n):
        _, m = msgpack.unpackb(await read_frame(reader))
        lags.append(_lag(m))
    out.put((lags, time.process_time() - cpu))
    writer.close()


def _relay_proc(role: str, path: str, n: int, gap_s: float, out: Any) -> None:
    asyncio.run(_relay_writer(path, n, gap_s) if role == "writer" else _relay_reader(path, n, out))


def _shm_proc(role: str, name: str, n: int, gap_s: float, poll_s: float, out: Any) -> None:
    """A single-writer ring in shared memory (no wrap-around needed for a bench): 8 bytes of write
    offset, then length-prefixed entries; the reader polls the offset every ``poll_s``."""
    shm = shared_memory.SharedMemory(name=name)
    buf = shm.buf
    assert buf is not None
    try:
        if role == "writer":
            pos, entry = 8, _entry()
            for _ in range(n):
                m = _stamped(entry)
                buf[pos + 4 : pos + 4 + len(m)] = m
                struct.pack_into("<I", buf, pos, len(m))
                pos += 4 + len(m)
                struct.pack_into("<Q", buf, 0, pos)  # published: the reader sees whole entries only
                time.sleep(gap_s)
            return
        out.put("ready")
        pos, cpu = 8, time.process_time()
        lags: list[float] = []
        while len(lags) < n:
            end = struct.unpack_from("<Q", buf, 0)[0]
            while pos < end:
                (size,) = struct.unpack_from("<I", buf, pos)
                lags.append(_lag(bytes(buf[pos + 4 : pos + 4 + size])))
                pos += 4 + size
            time.sleep(poll_s)
        out.put((lags, time.process_time() - cpu))
    finally:
        del buf
        shm.close()


def transport(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Entries from one process to another: the supervisor relay (extproc.workers' own code) beside
    a shared-memory ring polled at several intervals. Lag p50/p99 and the reader's CPU per second."""
    from extproc.config import build_config
    from extproc.workers import Supervisor

    n, gap = a.entries, a.flush_interval
    ctx = mp.get_context("spawn")
    rows = []

    def collect(option: str, writer: Any, reader: Any, q: Any) -> None:
        reader.start()
        assert q.get(timeout=30) == "ready"
        t0, hop0 = time.monotonic(), time.process_time()  # this process: the relay's hop (idle for shm)
        writer.start()
        lags, cpu = q.get(timeout=n * gap + 60)
        elapsed, hop = time.monotonic() - t0, time.process_time() - hop0
        writer.join()
        reader.join()
        rows.append({"option": option, "entries": len(lags), "lag_p50_ms": round(1e3 * (percentile(lags, 0.5) or 0), 3),
                     "lag_p99_ms": round(1e3 * (percentile(lags, 0.99) or 0), 3),
                     "reader_cpu": round(cpu / elapsed, 3), "hop_cpu": round(hop / elapsed, 3)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)

    async def relay() -> None:
        sup = Supervisor(build_config({"pools": {"p": {"endpoints": [{"address": PODS[0]}]}}}), [], 2)
        server = await asyncio.start_unix_server(sup._accept, path=sup.socket_path)
        q = ctx.Queue()
        w = ctx.Process(target=_relay_proc, args=("writer", sup.socket_path, n, gap, q))
        r = ctx.Process(target=_relay_proc, args=("reader", sup.socket_path, n, gap, q))
        await asyncio.to_thread(collect, "relay (supervisor, Unix sockets)", w, r, q)
        server.close()

    asyncio.run(relay())
    for poll in (float(x) for x in a.poll.split(",")):
        shm = shared_memory.SharedMemory(create=True, size=8 + n * (len(_entry()) + 64))
        try:
            q = ctx.Queue()
            w = ctx.Process(target=_shm_proc, args=("writer", shm.name, n, gap, poll, q))
            r = ctx.Process(target=_shm_proc, args=("reader", shm.name, n, gap, poll, q))
            collect(f"shared memory, polled every {poll * 1e3:g} ms", w, r, q)
        finally:
            shm.close()
            shm.unlink()
    return rows


def report(rows: Sequence[dict[str, Any]]) -> str:
    cols = list(rows[0]) if rows else []
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.workers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    ap.add_argument("--sharing", default="relay", help="relay and/or redis (comma-separated)")
    ap.add_argument("--duration", type=float, default=10, help="seconds measured per run")
    ap.add_argument("--warmup", type=float, default=2, help="seconds of load before measuring")
    ap.add_argument("--clients", type=int, default=2, help="load processes")
    ap.add_argument("--connections", type=int, default=8, help="gRPC connections in all")
    ap.add_argument("--concurrency", type=int, default=64, help="streams in flight in all")
    ap.add_argument("--api", default=",".join(APIS),
                    help="kvroute's transports to saturate (comma-separated): ext_proc (gRPC streams, as the "
                         "ext_proc filter sends them), ext_proc_h2 (the same into server.h2_port) and "
                         "ext_authz_http (HTTP/1.1 Checks and the gRPC access log, as --api ext_authz_http's "
                         "Envoy sends them; one worker)")  # fmt: skip
    ap.add_argument("--tokens", type=int, default=8000, help="prompt tokens per request (≈ 4 characters each)")
    ap.add_argument("--peers", default="sglang-router",
                    help="peer routers to saturate beside kvroute, as full proxies over instant backends "
                         "(comma-separated; '' for none)")  # fmt: skip
    ap.add_argument("--out", default=None, help="write results.json and table.md here")
    t = ap.add_argument_group("--transport: entries between two processes, no kvroute")
    t.add_argument("--transport", action="store_true", help="measure the ways workers could share state")
    t.add_argument("--entries", type=int, default=2000, help="entries sent")
    t.add_argument(
        "--flush-interval", type=float, default=0.005, help="seconds between entries (redis.flush_interval_s)"
    )
    t.add_argument("--poll", default="0.001,0.0001", help="shared memory: the reader's polling intervals (s)")
    a = ap.parse_args()
    rows = []
    if a.transport:
        rows = transport(a)
    else:
        bodies = chat_bodies(a.tokens, 256)
        for n, sharing, api in runs(a):
            rows.append(run_once(n, sharing, bodies, a, api))
            print(json.dumps(rows[-1]), flush=True)
        for name in filter(None, a.peers.split(",")):
            try:
                rows.append(run_peer(name, bodies, a))
            except PeerUnavailable as e:
                print(f"{name} skipped: {e}", flush=True)
                continue
            print(json.dumps(rows[-1]), flush=True)
    table = report(rows)
    print(table)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"args": vars(a), "runs": rows}, indent=2))
        (out / "table.md").write_text(table + "\n")
        (out / "headline.json").write_text(json.dumps(headline(rows), indent=1) + "\n")


def headline(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A ``table`` headline for bench/results.py (``python -m bench.results import OUT/headline.json --as workers``)."""
    from bench.results import table_headline

    cols = list(rows[0]) if rows else []
    title = "Decisions per second: workers, and a peer router as a full proxy"
    return table_headline(title, "bench.workers", cols, [[r[c] for c in cols] for r in rows])


if __name__ == "__main__":
    main()
