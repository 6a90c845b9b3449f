"""Router overhead: Envoy alone vs Envoy + kvroute over the same instant backends, one run.

    python -m bench.overhead [--rates 100,300] [--duration 8] [--rounds 2] [--variants product]
                             [--profile DIR] [--out bench/out/overhead]

For each rate and body size (``--sizes``: 1k- and 8k-token chats, or 32k), rounds alternate the routers over the same
instant backends at the same open-loop Poisson rate: plain Envoy (round robin, no ext_proc), Envoy +
a do-nothing Python ext_proc server (``bench.noop_extproc``: the floor of any grpcio processor), and
Envoy + kvroute. Reported: latency p50/p99 of each, the latency each adds over plain Envoy, and the
CPU milliseconds per request of Envoy and of the ext_proc server (from /proc); for kvroute, its
``own`` CPU and p50 over the do-nothing server with the same options. Side by side in one run
because this machine is noisy: compare the differences and ratios, not absolute numbers; CPU per
request is far steadier than latency when other work shares the cores.

``--variants`` lists the ext_proc routers, each ``SERVER[/OPT...]`` with its own Envoy (and server
process): SERVER ``noop`` or ``kvroute``; OPT ``uvloop`` (grpc.aio on uvloop; kvroute: ``--event-loop
uvloop``), ``sync`` (noop only: grpcio's synchronous server, a thread per stream), ``h2`` (not grpcio:
kvroute's own HTTP/2 gRPC server, extproc/h2.py, on uvloop; kvroute: its ``server.h2_port``), ``google_grpc``
(Envoy's Google gRPC client instead of its own), ``body-only`` (noop only: request_header_mode SKIP),
``partial`` (noop only: BUFFERED_PARTIAL), ``nobdp`` (noop only: grpc.http2.bdp_probe=0), ``streamed``
(STREAMED with send_body_without_waiting_for_header_response: Envoy sends the body right behind the
headers, the server answers the headers at the body's end with the route), ``duplex``
(FULL_DUPLEX_STREAMED: the same, and the server streams the body back), ``uds`` (noop only, not with
``sync``: Envoy dials the server on a Unix socket, a pipe address, instead of loopback TCP), ``authz``
(Envoy's ext_authz filter instead of ext_proc, envoy/epp-authz.yaml: one unary Check per request with
the whole body, and Envoy's gRPC access log reporting each finished request), ``authz_http`` (the same
Check as an HTTP/1.1 request, envoy/epp-authz-http.yaml). Without an
option a server runs as kvroute used to: grpc.aio on asyncio, Envoy's own client, headers + BUFFERED
body. Presets: ``floor`` (every ext_proc variant but ``uds``, as in bench/RESULTS.md's table), ``product``
(the default: the old and the current defaults, each beside its floor; kvroute as it runs out of the
box is ``envoy+kvroute/uvloop``), ``authz`` (the transports: ext_proc over grpcio and over extproc/h2.py, ext_authz
over gRPC and over HTTP, each beside its floor).
``--profile DIR`` has py-spy sample each kvroute (raw collapsed stacks, for flamegraphs; it skews that run);
``--profile-native`` adds C frames (the event loop's syscalls, protobuf, hpack's callers), pausing kvroute at
each sample (it skews the run more).
``--peers sglang-router,vllm-router`` adds each peer router (``cache_aware``, from ``make peers``' venv) as a
full proxy over the same instant backends, no Envoy in front: a row per peer beside Envoy alone, its CPU in
the proxy column and its latency over Envoy alone's as "added" (the routing benchmark's path, kvroute's
Envoy and hop against a peer's own proxy, without the pods and the load generator sharing the cores).

What was tried (short runs at 200-300 req/s on this 2-core machine while other work loaded it: CPU ms
per request of the ext_proc server, side by side in each run; the latencies were noise). The figures
of record are one quiet run of every variant side by side (``--variants floor``, bench/RESULTS.md's
Router overhead table):
- uvloop: kvroute 1.30-1.33 vs 1.51-1.53 on asyncio; the do-nothing server 0.80-0.98 vs 0.90-0.92:
  kept, kvroute's default (``server.event_loop: uvloop``).
- grpcio's synchronous server with a thread pool: 0.80-1.11 vs 0.90-1.01, no steady gain; not kept
  (and kvroute's router, P/D legs and shared state are asyncio).
- Envoy's Google gRPC client: the server no cheaper (1.02-1.24 vs 0.92-1.01), Envoy +0.4 ms CPU per
  request (1.0-1.2 vs 0.6-0.7); not kept (envoy_grpc stays).
- HTTP/2: the server's BDP probe off: 1.10-1.13 vs 0.96-1.01, no gain. Envoy's windows (256 MiB) and
  grpc's (64 KiB, growing) already hold an 8k-token body; keepalive pings (not measured) only act on
  idle connections.
- Fewer messages: headers skipped (body-only) cost the do-nothing server 0.62-1.01 vs 0.90-1.01, but it
  cannot route: with request_header_mode SKIP Envoy's router picks the upstream at the headers, before
  the body reaches the processor ("Response had header mutations but headers aren't available"; the
  envoy.lb metadata is ignored too), so kvroute keeps SEND. BUFFERED_PARTIAL sends the same single
  message as BUFFERED below the buffer limit, and past it kvroute would route on a truncated prompt
  without ever seeing end_of_stream. allow_mode_override would let the headers answer drop the body
  message, but every inference request needs its body.
- Transport: the do-nothing server on a Unix socket (``noop/uvloop/uds``) against loopback TCP
  (``noop/uvloop``), two quiet runs of 4 rounds (``--rates 300`` and ``--rates 100,300``, ``--duration 5
  --rounds 4``): added p50 +1.52 to +2.27 ms against +1.49 to +2.21, the server's CPU 0.96-1.22 ms per
  request against 0.95-1.18, Envoy's alike: loopback TCP costs nothing HTTP/2 and grpcio do not already,
  so kvroute gained no Unix-socket listener.
- grpc's core polling: the do-nothing server with GRPC_POLL_STRATEGY=poll instead of epoll1 (a variant
  added for one quiet run of 4 rounds at 300 req/s, not kept): CPU 1.07-1.10 ms per request against
  1.02-1.04, added p50 +1.97 / +2.24 ms against +2.19 / +2.10: no gain.
- protobuf: the upb backend was already in use; answers are filled field by field (extproc/envoy.py),
  not through keyword constructors and Struct.update (17 vs 5 us per routing answer).
- Where the floor goes: a loopback client opening one stream per request with two messages (headers,
  then a 32 KB body), as Envoy does, costs a do-nothing grpc.aio server on uvloop 0.99-1.01 ms of CPU
  per request (p50 1.7 ms round trip); the same two messages on one long-lived stream cost 0.22-0.25 ms
  each (p50 0.38 ms): opening and closing the stream is half the floor, and Envoy opens one per
  request. grpclib 0.4.9 (pure-Python HTTP/2 on the same event loop) in the same test: 0.99-1.16 ms per
  request, p50 1.9-2.2 ms; no gain, not kept.
- ``streamed`` and ``duplex`` (the headers' answer routes after the body, one round trip less to wait
  for; ``--variants`` below): see bench/RESULTS.md's Router overhead table.
- gRPC core's experiments (``GRPC_EXPERIMENTS`` on the do-nothing server, grpcio 1.85, a loopback
  client opening a stream per 8k-token request at 300 req/s, two rounds each, quiet machine):
  tcp_rcv_lowat, tcp_frame_size_tuning, ph2_server, fuse_filters, pollset_alternative and
  event_engine_callback_cq on or off all cost 0.80-0.98 ms of CPU per request against 0.88-0.98
  without: within the rounds' spread; none kept.
- Why kvroute's own part costs three to four times its in-process CPU: the CPU's caches. Between two
  requests grpcio's own work and the other processes evict kvroute's code and data. Over loopback
  gRPC (as above) kvroute's decision (``kvroute_decision_seconds``) took 290-300 us per 8k request
  at 300 req/s and 370-380 us at 30 req/s, against ~120 us in-process on a warm cache;
  ``python -m bench.servicer --evict-mib 48`` (the caches evicted before each request) puts kvroute's
  own CPU at 530-560 us per 8k request against 122-126 us warm. Pinning kvroute to one core and the
  client to the other changed nothing (1.28-1.57 vs 1.46-1.62 ms per request). What would lower it
  is less code and data touched per request, not fewer instructions on a warm path.
  Nor is it kvroute's I/O or the harness around it (over kvroute's own HTTP/2 server, ``--rates 300 --variants
  noop/h2,kvroute/h2``): ``strace -c -f`` on both servers through a 100 req/s round counted the same reads
  (1471 / 1464), writes (1669 / 1652) and epoll waits (1496 / 1467) for kvroute as for the do-nothing server;
  and instant backends on a bare asyncio.Protocol server on uvloop in place of aiohttp's (a scratch change,
  ``--sizes 1k,8k --duration 5 --rounds 2``, two runs each, alternating) left kvroute's own CPU where it was:
  +0.34 to +0.44 ms per request against +0.33 to +0.40. Nor background work: kvroute as this bench starts it
  (4 pods, no scraping, ``server.h2_port`` on), idle for 20 s, used no CPU that /proc's 10 ms ticks could count,
  so its CPU per request is the requests' own.
- Native code for the decision's modules: mypyc (mypy 2.4, -O3) compiling keys, hashing, request,
  router, capacity, endpoints/pool, index/approx, index/ends and scheduling/* (server.py, envoy.py and the
  pydantic config stay Python; a scratch build, two pairs of ``python -m bench.servicer --rounds 5``
  each beside the plain modules): warm own CPU 69-79 against 77-82 us per 1k-token chat and 102-109
  against 107-122 per 8k (5-15 %), with ``--evict-mib 48`` 259-307 against 273-364 us, inside the pairs'
  spread: the compiled modules still trade in Python objects (dicts, dataclasses, the config), so the
  memory a request touches barely shrinks. Not kept (a C build step, and compiled classes cannot be
  patched in tests). CPython 3.12.1 and 3.13.0 (a venv each, the same bench, two interleaved passes):
  own CPU 75-81 / 76-78 us per 1k-token chat against 77-80 on 3.11, 106-115 / 108-109 per 8k against
  109-113: no gain.
- Calls per request: cProfile over 200 1k-token chats through kvroute's servicer (bench.servicer's setup, warm)
  counts ~407 function calls per request, builtins included (dict.get 62, xxhash 19, len 19): no layer of
  indirection left to strip; what behind-gRPC pays over in-process is the cold cache (``--evict-mib``).
- Envoy's ext_authz filter instead of ext_proc (one unary Check per request with the whole body): a scratch
  do-nothing Check server on uvloop, without the access log, beside the do-nothing ext_proc server (one quiet
  run, 300 req/s, two rounds of 5 s): added p50 +0.61 / +0.87 ms against +1.26 / +1.24 (1k / 8k-token chats),
  the server's CPU 0.47 ms per request against 0.85. With the access log kvroute needs to learn each
  request's end (``authz``, the ``noop/authz`` rows) part of that goes (0.54-0.86 ms of CPU). Kept as an
  option: ``kvroute envoy-config --api ext_authz`` (bench/RESULTS.md, The transports).
- ext_authz's HTTP service instead of its gRPC one: the same scratch setup with a do-nothing HTTP/1.1
  server on uvloop (asyncio.Protocol) added +0.26 / +0.21 ms p50 against +0.96 / +1.00 for the gRPC Check
  and +1.58 / +1.80 for ext_proc, at 0.07 ms of the server's CPU per request against 0.53-0.56 and 0.90-0.96:
  grpcio's machinery, not the exchange, was the floor. Kept: ``--api ext_authz_http`` (``authz_http``).
- kvroute's HTTP authorization server on asyncio streams, then on asyncio.Protocol (a request parsed in the
  callback its bytes arrive in, not copied when it comes in one read), and its answers translated from the
  routing override instead of read back from ext_proc protos: at 100-300 req/s through Envoy the
  do-nothing server's CPU per request is alike (0.12-0.32 ms streams, 0.14-0.28 Protocol: the ``authz``
  preset's table before and after); saturated (``python -m bench.workers --api ext_authz_http``) kvroute's
  decisions per core rose from 4163 to 5003 (single runs between the steps: 4577-4726 with the
  translation, 5020-5075 with the Protocol server, 5156-5505 without the copy). Kept.
- An answer decided without waiting written in the read callback its request came in (no task, no
  coroutine per level: ``HttpAuthzServer.answer`` gives bytes or an awaitable; every approximate decision
  is the former), and ``Pending`` keeping its loop (``asyncio.get_running_loop`` checks the process id,
  a system call): ``python -m bench.workers --workers 1 --api ext_authz_http --duration 10 --warmup 3
  --peers ''`` three times each, alternating with the code before it (a git worktree), quiet host:
  5265 / 5235 / 5341 decisions/s per core against 5183 / 5477 / 5149 (no change beyond the spread),
  p99 19.1-21.5 ms against 22.3-23.7. Kept for the tail; the throughput is within the runs' spread.
- Envoy's access log off (a scratch copy of envoy/epp-authz-http.yaml without it, so kvroute releases no pod
  slot; the do-nothing server and kvroute over HTTP, 300 req/s, 1k and 8k-token chats, three rounds of 6 s, one
  quiet run beside one with it): kvroute's CPU 0.29 / 0.40 ms per request against 0.28 / 0.35 with the log,
  Envoy's 0.37 / 0.44 against 0.36 / 0.40: at these rates the gRPC access log costs nothing measurable, so a
  cheaper carrier for it (Envoy's fluentd logger: msgpack over TCP, no gRPC) would not lower the hop.
- kvroute's own HTTP/2 gRPC server for the ext_proc stream (extproc/h2.py, ``server.h2_port``; ``h2`` above): frames
  parsed in the read callback they arrive in (HPACK by the ``hpack`` package), the messages handed to the ext_proc state
  machine as bytes and its answers written at once, no task, coroutine or call object per stream (what grpclib's pure
  Python HTTP/2 state machine did not spare). The do-nothing server on it spends 0.21-0.29 ms of CPU per request
  against grpc.aio's 0.66-0.81 and adds +0.39 to +0.59 ms p50 against +0.83 to +1.04; kvroute on it 0.41-0.63 ms
  against 0.89-1.20, +0.67 to +0.95 p50 against +1.12 to +1.43 (``--variants authz``, bench/RESULTS.md, The
  transports); saturated (``python -m bench.workers --api ext_proc_h2``) 3709 decisions/s per core against 1327 at the
  time (4596 against 1474 now, the answers of frames read together written together: bench/RESULTS.md, Workers).
  Kept, as an option beside grpcio (``server.h2_port``): the same answers, TLS, workers, P/D.
- The index's record of a decision's pick after the answer (``Scheduler.settle`` once the loop turns; the next
  decision settles what is pending first, so each decision still sees every one before it): a scratch replay of
  the grid's multi-turn and shared-prefix requests through kvroute's servicer in-process on uvloop (the loop
  turning between requests; best of three replays, two passes alternating with the code before): the exchange's
  p50 0.119-0.122 / 0.159-0.170 ms approximate against 0.128-0.136 / 0.184-0.237, precise 0.42-0.48 / 0.58-0.77
  against 0.46-0.62 / 0.63-0.79; with the caches evicted before each request (``bench.servicer``'s Evictor)
  approximate 0.34-0.42 / 0.49-0.56 against 0.44-0.49 / 0.60-0.66. The same CPU, moved off the answer's path.
  Through Envoy (``--rates 300 --sizes 1k,8k --duration 5 --rounds 3 --variants
  noop/h2,kvroute/h2,noop/authz_http/uvloop,kvroute/authz_http/uvloop``, two runs each alternating) kvroute's own
  p50 read +0.13 to +0.46 ms against +0.17 to +0.54 and its own CPU +0.18 to +0.30 against +0.22 to +0.36: the
  tens of microseconds are inside this host's run-to-run spread. Kept: it costs nothing and takes nothing from the
  decision. The decision's metrics and autoscaling demand (``CapacityTracker.observe``) went the same way
  (``Router.settle``), the same scratch replay two passes each alternating with the code before: approximate
  multi-turn / shared-prefix p50 0.116-0.118 / 0.163-0.164 ms against 0.118-0.122 / 0.158-0.171 warm, and 0.473-0.497
  / 0.611-0.655 against 0.514-0.535 / 0.626-0.645 with the caches evicted: a few percent of the cold exchange.
- A leaner Envoy in front (a scratch patch of every run's config: ``stats_config`` rejecting every stat, the router's
  ``dynamic_stats`` off and ``suppress_envoy_headers`` on, no ``x-request-id`` generated; two pairs of ``--rates 300
  --sizes 1k,8k --duration 5 --rounds 2 --variants noop/h2,kvroute/h2`` alternating with the configs as shipped):
  Envoy alone 0.26-0.31 ms of CPU per request against 0.30-0.32, with the ext_proc filter 0.52-0.61 against
  0.54-0.60, the added p50 within the runs' spread. Not kept: Envoy's own bookkeeping is not what the hop costs.
- Envoy with two worker threads (``--concurrency 2`` by a temporary change; the bench runs one) in front of kvroute, on
  the grid's multi-turn, shared-prefix and Mooncake conversation head cells (4 pods, load 0.7, two
  rounds alternating): the path (client TTFT - the pods' own) 6.2-7.0 vs 5.8-8.1 ms, 9.2-10.8 vs
  6.9-8.1 ms and 44.3-45.3 vs 39.8-45.2 ms: no gain; one worker kept.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from tqdm import tqdm

from bench import loadgen
from bench.envoy import AUTHZ_CONFIGS, EnvoyProcess, body_mode_patch
from bench.kvroute import KVRouteProcess
from bench.peers import PEERS, PeerRouter
from bench.procs import cpu_seconds, python_module, ready_process, start_with_ready_file, stop

SIZES = {"1k": 1_000, "8k": 8_000, "32k": 32_000}  # prompt tokens (≈ 4 characters each)
DEFAULT_SIZES = ("1k", "8k")
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta", "lambda", "zeta"]


def parse_sizes(spec: str) -> tuple[str, ...]:
    """``--sizes``: a comma list of ``SIZES``' names, in order, repeats dropped."""
    sizes = tuple(dict.fromkeys(s.strip() for s in spec.split(",") if s.strip()))
    if not sizes:
        raise ValueError(f"--sizes: no size given (of {', '.join(SIZES)})")
    if bad := [s for s in sizes if s not in SIZES]:
        raise ValueError(f"--sizes: unknown size(s) {bad} (of {', '.join(SIZES)})")
    return sizes


def documents(tokens: int, docs: int = 32, seed: int = 0) -> list[str]:
    """``docs`` distinct documents of about ``tokens`` tokens each (what ``chat_bodies`` sends)."""
    rng = random.Random(seed)
    return [" ".join(f"{rng.choice(WORDS)}{rng.randrange(1000)}" for _ in range(tokens * 4 // 9)) for _ in range(docs)]


def chat_bodies(tokens: int, n: int, docs: int = 32, seed: int = 0) -> list[bytes]:
    corpus = documents(tokens, docs, seed)
    return [
        orjson.dumps(
            {
                "model": "bench",
                "max_tokens": 1,
                "messages": [
                    {"role": "system", "content": corpus[i % docs]},
                    {"role": "user", "content": f"question {i}: what does it say?"},
                ],
            }
        )
        for i in range(n)
    ]


def _round(url: str, bodies: list[bytes], rate: float, seed: int) -> list[loadgen.Record]:
    arrivals = loadgen.poisson_arrivals(len(bodies), rate, seed)
    specs = [loadgen.RequestSpec(body=b, at=t) for b, t in zip(bodies, arrivals, strict=True)]
    return asyncio.run(loadgen.run(url, specs, timeout=30))


PLAIN = "envoy"
NOOP = "envoy+noop-extproc"
KVROUTE = "envoy+kvroute"
ROUTERS = (PLAIN, NOOP, KVROUTE)  # the rows bench/results.py imports (every preset has them)

# Options of a variant, ``SERVER/OPT/OPT`` (SERVER: noop or kvroute); see the module docstring.
SERVER_OPTS = {"uvloop", "sync", "h2"}  # how grpcio serves (default grpc.aio on asyncio)
OPTS = {
    *SERVER_OPTS,
    "google_grpc",  # Envoy's Google gRPC client (C++ gRPC) for the ext_proc stream, not its own (envoy_grpc)
    "body-only",  # request_header_mode SKIP: the body's message alone (Envoy routes before it: floor only)
    "partial",  # request_body_mode BUFFERED_PARTIAL (the same message as BUFFERED under the buffer limit)
    "nobdp",  # the server's HTTP/2 BDP probe off (a PING per data burst otherwise)
    "streamed",  # STREAMED + send_body_without_waiting_for_header_response: the headers' answer routes
    "duplex",  # FULL_DUPLEX_STREAMED: the headers' answer routes, the body streamed back
    "uds",  # Envoy dials the ext_proc server on a Unix socket, not loopback TCP (noop only)
    "authz",  # Envoy's ext_authz filter (envoy/epp-authz.yaml): one Check per request + the gRPC access log
    "authz_http",  # the same over HTTP/1.1 (envoy/epp-authz-http.yaml): no gRPC on the request's path
}
BODY_OPTS = {"partial", "streamed", "duplex"}  # the request body mode (BUFFERED without one)
# What kvroute can run with (server.event_loop; Envoy's ext_proc client, set here): it serves on an event
# loop, decides at the body's end (not BUFFERED_PARTIAL's), and Envoy picks the pod at the headers.
KVROUTE_OPTS = {"uvloop", "h2", "google_grpc", "streamed", "duplex", "authz", "authz_http"}
# ext_authz has no processing modes or per-filter gRPC client choice here, and no synchronous noop server.
AUTHZ_EXCLUDES = {"sync", "h2", "google_grpc", "body-only", "partial", "streamed", "duplex", "uds", "nobdp"}
AUTHZ_OPTS = {"authz", "authz_http"}
PRESETS = {
    # Every floor variant, and kvroute on each transport it can use; kvroute/uvloop is today's default.
    "floor": "noop,noop/uvloop,noop/sync,noop/google_grpc,noop/body-only,noop/nobdp,noop/partial,"
    "noop/uvloop/streamed,noop/uvloop/duplex,kvroute,kvroute/uvloop,kvroute/google_grpc,kvroute/uvloop/streamed,"
    "kvroute/uvloop/duplex",
    # The product's defaults (server.event_loop uvloop) beside the old ones, each on its floor.
    "product": "noop,kvroute,noop/uvloop,kvroute/uvloop",
    # The two transports, ext_proc (the default) and ext_authz, each on its floor.
    "authz": "noop/uvloop,kvroute/uvloop,noop/h2,kvroute/h2,noop/authz/uvloop,kvroute/authz/uvloop,"
    "noop/authz_http/uvloop,kvroute/authz_http/uvloop",
}


@dataclass(frozen=True)
class Variant:
    """One router of the run: Envoy alone, or Envoy with an ext_proc server and these options."""

    server: str | None  # None: Envoy alone; else "noop" or "kvroute"
    opts: frozenset[str] = frozenset()

    @property
    def name(self) -> str:
        if self.server is None:
            return PLAIN
        base = NOOP if self.server == "noop" else KVROUTE
        return "/".join([base, *sorted(self.opts)])

    @property
    def floor(self) -> str:
        """The do-nothing server with the same options: the floor this variant's own work sits on."""
        return Variant("noop", self.opts).name


def parse_variants(spec: str) -> list[Variant]:
    """``noop,kvroute,noop/sync,...`` (names in PRESETS stand for theirs) → Envoy alone first, then each;
    ValueError naming a bad one."""
    out = [Variant(None)]
    for item in (x for part in spec.split(",") for x in PRESETS.get(part.strip(), part).split(",")):
        server, *opts = item.strip().split("/")
        if server not in ("noop", "kvroute"):
            raise ValueError(f"variant {item!r}: the server is noop or kvroute")
        unknown = set(opts) - OPTS
        if unknown:
            raise ValueError(f"variant {item!r}: unknown option(s) {sorted(unknown)} (known: {sorted(OPTS)})")
        if server == "kvroute" and set(opts) - KVROUTE_OPTS:
            raise ValueError(f"variant {item!r}: kvroute cannot run with {sorted(set(opts) - KVROUTE_OPTS)}")
        if "uds" in opts and "sync" in opts:
            raise ValueError(f"variant {item!r}: uds needs the aio or uvloop server")
        if set(opts) & AUTHZ_OPTS and set(opts) & AUTHZ_EXCLUDES:
            raise ValueError(f"variant {item!r}: authz cannot run with {sorted(set(opts) & AUTHZ_EXCLUDES)}")
        if len(set(opts) & AUTHZ_OPTS) > 1:
            raise ValueError(f"variant {item!r}: one of {sorted(AUTHZ_OPTS)} at most")
        for group in (SERVER_OPTS, BODY_OPTS):
            if len(set(opts) & group) > 1:
                raise ValueError(f"variant {item!r}: one of {sorted(group)} at most")
        v = Variant(server, frozenset(opts))
        if v not in out:
            out.append(v)
    return out


def _envoy_patch(v: Variant, port: int) -> dict[str, Any]:
    """The ext_proc filter settings of ``v`` (bench.envoy.config_for_run's processing_mode / ext_proc)."""
    mode: dict[str, str] = {}
    ext: dict[str, Any] = {}
    if "body-only" in v.opts:
        mode["request_header_mode"] = "SKIP"
    if "partial" in v.opts:
        mode["request_body_mode"] = "BUFFERED_PARTIAL"
    # The streamed modes as kvroute envoy-config sets them: STREAMED without waiting for the headers' answer,
    # full duplex with trailers both ways and no fail-open (Envoy refuses it); both keep the stream to the end.
    for opt, body in (("streamed", "STREAMED"), ("duplex", "FULL_DUPLEX_STREAMED")):
        if opt in v.opts:
            patch = body_mode_patch(body)
            mode |= patch["processing_mode"]
            ext |= patch["ext_proc"]
    if "google_grpc" in v.opts:
        ext["grpc_service"] = {"google_grpc": {"target_uri": f"127.0.0.1:{port}", "stat_prefix": "ext_proc"},
                               "timeout": "5s"}  # fmt: skip
    return {"processing_mode": mode, "ext_proc": ext}


def _server_args(v: Variant, unix: str | None = None) -> list[str]:
    """Command-line options of ``v``'s ext_proc server (bench.noop_extproc's, or kvroute serve's);
    ``unix``: the socket a ``uds`` variant listens on."""
    if v.server == "noop":
        server = next((o for o in ("sync", "h2", "uvloop") if o in v.opts), "aio")
        return ["--server", server, *(["--grpc-arg", "grpc.http2.bdp_probe=0"] if "nobdp" in v.opts else []),
                *(["--unix", unix] if unix else []), *(["--authz-http"] if "authz_http" in v.opts else [])]  # fmt: skip
    return ["--event-loop", "uvloop" if {"uvloop", "h2"} & v.opts else "asyncio"]


@dataclass(frozen=True)
class _Router:
    """One row's router as the rounds drive it: its URL, the proxy's pid (Envoy, or a peer router) and
    the ext_proc server's (None: Envoy alone, or a peer)."""

    url: str
    proxy_pid: int
    server_pid: int | None = None


def _profilers(routers: dict[str, _Router], out: Path, native: bool = False) -> list[subprocess.Popen[bytes]]:
    """py-spy sampling every kvroute of the run into ``out/<router>.txt`` (raw, collapsed stacks)."""
    exe = shutil.which("py-spy", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if exe is None:
        raise RuntimeError("py-spy not found: install the test extra (pip install -e '.[test]')")
    out.mkdir(parents=True, exist_ok=True)
    spies = []
    for name, r in routers.items():
        pid = r.server_pid
        if pid is not None and name.startswith(KVROUTE):
            # py-spy reads native stacks only from a stopped process: --native cannot be --nonblocking
            args = ["record", "--pid", str(pid), "--rate", "200", "--format", "raw",
                    "--native" if native else "--nonblocking"]  # fmt: skip
            dest = out / f"{name.replace('/', '_')}.txt"
            spies.append(subprocess.Popen([exe, *args, "--output", str(dest)], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))  # fmt: skip
    return spies


def measure(
    rates: list[float],
    duration: float,
    rounds: int,
    pods: int = 4,
    variants: list[Variant] | None = None,
    profile: Path | None = None,
    sizes: tuple[str, ...] = DEFAULT_SIZES,
    peers: tuple[str, ...] = (),
    native: bool = False,
) -> dict[str, Any]:
    """Rounds alternate the routers over the same backends; see the module docstring. ``profile``: a
    directory for py-spy's samples of each kvroute (the sampler's CPU skews that run's figures); ``native``:
    with C frames.
    ``peers``: peer routers (``bench.peers.PEERS``) as full proxies over the same backends, a row each."""
    variants = variants or [Variant(None), Variant("noop"), Variant("kvroute")]
    backends, addrs = start_with_ready_file(python_module("bench.instant", "--ports", ",".join(["0"] * pods)))
    assert isinstance(addrs, list)
    names = [v.name for v in variants] + list(peers)
    results: dict[str, Any] = {"rates": rates, "duration_s": duration, "rounds": rounds, "routers": names,
                               "peers": list(peers), "sizes": {}}  # fmt: skip
    spies: list[subprocess.Popen[bytes]] = []
    try:
        with contextlib.ExitStack() as stack:
            sockets = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvroute-uds-")))
            routers: dict[str, _Router] = {}
            for v in variants:
                pid: int | None = None
                port: int | None = None
                http_port: int | None = None  # authz_http: the server's HTTP authorization port
                unix = str(sockets / f"{len(routers)}.sock") if "uds" in v.opts else None
                if v.server == "noop":
                    proc, ready = stack.enter_context(
                        ready_process(python_module("bench.noop_extproc", "--target", addrs[0], *_server_args(v, unix)))
                    )
                    assert isinstance(ready, dict)
                    pid, port, http_port = proc.pid, ready["port"], ready.get("http_port")
                elif v.server == "kvroute":
                    kv = stack.enter_context(KVRouteProcess(addrs, extra_args=["--log-level", "warning",
                                                                               *_server_args(v)],
                                                            authz_http="authz_http" in v.opts,
                                                            h2="h2" in v.opts))  # fmt: skip
                    assert kv.proc is not None
                    pid, port, http_port = kv.proc.pid, kv.ext_proc_port, kv.authz_http_port or None
                patch = _envoy_patch(v, port) if port is not None else {}
                if unix is not None:
                    patch["kvroute_pipe"] = unix
                name = next((AUTHZ_CONFIGS[o] for o in v.opts if o in AUTHZ_CONFIGS), "epp.yaml")
                env = stack.enter_context(EnvoyProcess(name, kvroute_port=port, pods=addrs, kvroute_http_port=http_port,
                                                       without_ext_proc=v.server is None, **patch))  # fmt: skip
                assert env.proc is not None
                routers[v.name] = _Router(env.url, env.proc.pid, pid)
            for name in peers:
                peer = stack.enter_context(PeerRouter(name, "cache_aware", [f"http://{a}" for a in addrs]))
                assert peer.proc is not None
                routers[name] = _Router(peer.url, peer.proc.pid)
            spies = _profilers(routers, profile, native) if profile is not None else []
            bar = tqdm(total=len(rates) * len(sizes) * rounds * len(routers), desc="overhead", unit="round")
            for rate, (size, tokens) in ((r, (s, SIZES[s])) for r in rates for s in sizes):
                bodies = chat_bodies(tokens, int(rate * duration))
                lat: dict[str, list[float]] = {n: [] for n in routers}
                errors = dict.fromkeys(routers, 0)
                cpu_envoy = dict.fromkeys(routers, 0.0)
                cpu_proc = dict.fromkeys(routers, 0.0)
                sent = dict.fromkeys(routers, 0)
                for router in routers.values():
                    _round(router.url, bodies[:50], rate, 99)  # warm connections and the index
                for r in range(rounds):
                    for name, router in routers.items():
                        pid = router.server_pid
                        e0, p0 = cpu_seconds(router.proxy_pid), cpu_seconds(pid) if pid else 0.0
                        recs = _round(router.url, bodies, rate, seed=r)
                        cpu_envoy[name] += cpu_seconds(router.proxy_pid) - e0
                        cpu_proc[name] += (cpu_seconds(pid) - p0) if pid else 0.0
                        sent[name] += len(recs)
                        lat[name] += [x.e2e for x in recs if x.ok and x.e2e is not None]
                        errors[name] += sum(not x.ok for x in recs)
                        bar.update()
                row: dict[str, Any] = {
                    "rate": rate,
                    "body": size,
                    "requests_per_router": sent[PLAIN],
                    "errors": errors,
                }
                for name, got in lat.items():
                    row[name] = {
                        "p50_ms": 1e3 * (loadgen.percentile(got, 0.5) or 0),
                        "p99_ms": 1e3 * (loadgen.percentile(got, 0.99) or 0),
                        "envoy_cpu_ms_per_req": 1e3 * cpu_envoy[name] / max(1, sent[name]),
                        "extproc_cpu_ms_per_req": 1e3 * cpu_proc[name] / max(1, sent[name]),
                    }
                for name in names[1:]:  # each over Envoy alone (a peer: in Envoy's place)
                    row[name]["added_p50_ms"] = row[name]["p50_ms"] - row[PLAIN]["p50_ms"]
                    row[name]["added_p99_ms"] = row[name]["p99_ms"] - row[PLAIN]["p99_ms"]
                for v in variants[1:]:
                    r = row[v.name]
                    floor = row.get(v.floor) or row.get(NOOP)
                    if v.server == "kvroute" and floor is not None:
                        r["own_cpu_ms_per_req"] = r["extproc_cpu_ms_per_req"] - floor["extproc_cpu_ms_per_req"]
                        r["own_p50_ms"] = r["p50_ms"] - floor["p50_ms"]
                row["latencies_ms"] = {k: [1e3 * x for x in v] for k, v in lat.items()}
                results["sizes"][f"{size}@{rate:.0f}"] = row
            bar.close()
    finally:
        for spy in spies:  # SIGINT: py-spy writes what it sampled and exits
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
        stop(backends)
    return results


def report(res: dict[str, Any]) -> str:
    lines = [
        f"Open-loop Poisson arrivals, {res['duration_s']:.0f} s x {res['rounds']} alternating rounds per router, "
        "4 instant backends. own: a kvroute row over the do-nothing server with the same options (or plain noop).",
        "",
        "| req/s | body | router | p50 ms | p99 ms | added p50 ms | added p99 ms | proxy CPU ms/req "
        "| ext_proc CPU ms/req | own CPU ms/req | own p50 ms | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in res["sizes"].values():
        for name in res.get("routers", ROUTERS):
            r = row[name]
            added = f"**{r['added_p50_ms']:+.2f}** | **{r['added_p99_ms']:+.2f}**" if "added_p50_ms" in r else "- | -"
            proc = f"{r['extproc_cpu_ms_per_req']:.2f}" if name != PLAIN and name not in res.get("peers", ()) else "-"
            own = (f"{r['own_cpu_ms_per_req']:+.2f} | {r['own_p50_ms']:+.2f}" if "own_cpu_ms_per_req" in r
                   else "- | -")  # fmt: skip
            lines.append(
                f"| {row['rate']:.0f} | {row['body']}-token chat | {name} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                f"{added} | {r['envoy_cpu_ms_per_req']:.2f} | {proc} | {own} | {row['errors'][name]} |"
            )
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(res["sizes"])
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4), squeeze=False)
    axes = axes[0]
    for ax, row in zip(axes, res["sizes"].values(), strict=True):
        for name, v in row["latencies_ms"].items():
            v = sorted(v)
            ax.plot(v, [i / len(v) for i in range(len(v))], label=name)
        ax.set_xscale("log")
        ax.set_xlabel("end-to-end latency (ms, log)")
        ax.set_ylabel("CDF")
        ax.set_title(f"{row['body']}-token chat @ {row['rate']:.0f} req/s")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rates", default="100,300", help="comma-separated request rates (req/s, open loop, Poisson)")
    ap.add_argument("--duration", type=float, default=8, help="seconds per round")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per router and size")
    ap.add_argument("--sizes", default=",".join(DEFAULT_SIZES), help=f"chat sizes, of {', '.join(SIZES)}")
    ap.add_argument("--out", default="bench/out/overhead", help="directory for results.json, table.md, overhead.png")
    ap.add_argument("--variants", default="product",
                    help="ext_proc routers beside Envoy alone: SERVER[/OPT...] comma-separated (SERVER noop or "
                         f"kvroute; OPT {', '.join(sorted(OPTS))}), or a preset: "
                         + "; ".join(f"{k}: {v}" for k, v in PRESETS.items()))  # fmt: skip
    ap.add_argument("--profile", metavar="DIR", help="sample each kvroute with py-spy into DIR (skews the figures)")
    ap.add_argument("--profile-native", action="store_true",
                    help="with --profile: C frames too (kvroute paused at each sample: skews it more)")  # fmt: skip
    ap.add_argument("--peers", default="",
                    help=f"peer routers as full proxies beside Envoy alone, comma-separated (of {', '.join(PEERS)}; "
                         "cache_aware; needs `make peers`)")  # fmt: skip
    a = ap.parse_args()
    peers = tuple(dict.fromkeys(p.strip() for p in a.peers.split(",") if p.strip()))
    if bad := [p for p in peers if p not in PEERS]:
        ap.error(f"--peers: unknown peer(s) {bad} (of {', '.join(PEERS)})")
    try:
        variants = parse_variants(a.variants)
    except ValueError as e:
        ap.error(str(e))
    try:
        sizes = parse_sizes(a.sizes)
    except ValueError as e:
        ap.error(str(e))
    res = measure([float(r) for r in a.rates.split(",")], a.duration, a.rounds, variants=variants,
                  profile=Path(a.profile) if a.profile else None, sizes=sizes, peers=peers,
                  native=a.profile_native)  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    table = report(res)
    (out / "table.md").write_text(table + "\n")
    slim = {
        **res,
        "sizes": {k: {kk: vv for kk, vv in v.items() if kk != "latencies_ms"} for k, v in res["sizes"].items()},
    }
    (out / "results.json").write_text(json.dumps(slim, indent=2))
    plot(res, out / "overhead.png")
    print(table)
    print(f"\nwrote {out}/results.json, table.md, overhead.png")


if __name__ == "__main__":
    main()
