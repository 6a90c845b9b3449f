"""``kvroute serve --workers N``: N worker processes on one ext_proc port, under one supervisor.

One Python process decides on one core. The supervisor starts N ``kvroute serve`` processes (the
same command line, with ``--workers 1`` and the resolved ports) that all bind the ext_proc port
with SO_REUSEPORT: the kernel spreads *connections* over them (a gRPC connection carries many
streams, so Envoy's connections to kvroute are what get balanced: one per Envoy worker thread).

What the supervisor does:
- binds first what it serves itself: it reserves the ext_proc port (a bound, not listening
  SO_REUSEPORT socket, so port 0 resolves to one port for all workers and another program cannot
  take it), the health port (``server.health_port``: SERVING while at least one worker serves) and
  the metrics port (one ``/metrics`` for the whole server: each worker's registry, fetched over its
  control socket at scrape time, merged by ``observability.merge_metrics``; plus
  ``kvroute_workers``, ``kvroute_worker_pid``, ``kvroute_worker_restarts_total`` and
  ``kvroute_worker_decisions_total`` per worker). Workers keep their own custom collectors this
  way, which prometheus_client's multiprocess mode would drop.
- shares state: with ``redis.url`` each worker is a Redis replica like any other; without it, it
  relays the workers' shared-state entries (extproc/state/relay.py says why a relay).
- restarts a worker that dies (backoff from ``RESTART_MIN_S`` doubling to ``RESTART_MAX_S``, reset
  once a worker has served for ``STABLE_S``), forwards SIGTERM/SIGINT (workers drain for
  ``server.grace_period_s``) and SIGHUP (config reload), and exits 3 naming the worker when one
  exits before it ever served at start (its own error is on stderr just before).
A worker stops when its control socket closes: a supervisor killed outright leaves no workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import msgpack
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from extproc.config import Config
from extproc.errors import StartupError
from extproc.observability import WORKER_ENV, merge_metrics
from extproc.state.relay import FAULTS, RELAY_ENV, frame, read_frame

log = logging.getLogger("kvroute.workers")

CONTROL_ENV = "KVROUTE_SUPERVISOR_SOCKET"  # the supervisor's socket, named to its workers
EXIT_STARTUP = 3  # extproc.cli.EXIT_STARTUP
RESTART_MIN_S = 0.5
RESTART_MAX_S = 30.0
STABLE_S = 30.0  # a worker that served this long had no start problem: the next restart is quick again
SCRAPE_TIMEOUT_S = 2.0  # a worker's metrics answer; past it the scrape goes on without that worker
STOP_MARGIN_S = 5.0  # past the grace period, a worker still running is killed
RELAY_BUFFER_BYTES = 64 << 20  # a worker this far behind the relay is cut off (it reconnects and replays)
HEALTH_SERVICES = ("", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")


def is_worker() -> bool:
    """This process is one of a supervisor's workers."""
    return WORKER_ENV in os.environ


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity, capped by a cgroup v2 quota (containers)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    return max(1, n)


def worker_count(setting: int | str) -> int:
    return usable_cpus() if setting == "auto" else int(setting)


def _reserve(host: str, port: int, setting: str = "server.grpc_port") -> socket.socket:
    """Bind (not listen) host:port with SO_REUSEPORT: the workers' listeners join it, others can't."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StartupError(f"{setting}: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


# -- the worker's side ------------------------------------------------------------------------------


class WorkerLink:
    """A worker's control connection: says when it serves, answers metrics requests, and calls
    ``on_lost`` when the supervisor is gone."""

    def __init__(self, path: str, index: int) -> None:
        self.path, self.index = path, index
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def from_env(cls) -> WorkerLink | None:
        path = os.environ.get(CONTROL_ENV)
        return None if path is None else cls(path, int(os.environ.get(WORKER_ENV, "0")))

    async def serving(self, registry: CollectorRegistry, on_lost: Callable[[], Awaitable[None]]) -> None:
        try:
            reader, self._writer = await asyncio.open_unix_connection(self.path)
        except OSError as e:
            raise StartupError(f"worker {self.index}: cannot reach the supervisor: {e}") from None
        self._writer.write(frame({"t": "hello", "role": "control", "worker": self.index, "pid": os.getpid()}))
        self._writer.write(frame({"t": "serving"}))
        self._task = asyncio.create_task(self._serve(reader, registry, on_lost), name="kvroute-worker-link")

    async def _serve(
        self, reader: asyncio.StreamReader, registry: CollectorRegistry, on_lost: Callable[[], Awaitable[None]]
    ) -> None:
        assert self._writer is not None
        try:
            while True:
                msg = msgpack.unpackb(await read_frame(reader))
                if msg.get("t") == "metrics?":
                    self._writer.write(frame({"t": "metrics", "id": msg["id"], "text": generate_latest(registry)}))
        except FAULTS:
            log.warning("supervisor gone: this worker stops")
            await on_lost()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._writer is not None:
            self._writer.close()


# -- the supervisor ----------------------------------------------------------------------------------


@dataclass
class _Worker:
    index: int
    proc: asyncio.subprocess.Process | None = None
    control: asyncio.StreamWriter | None = None
    serving: bool = False
    served_at: float = 0.0
    restarts: int = 0
    failures: int = 0  # restarts since it last served STABLE_S
    waiting: dict[int, asyncio.Future[bytes]] = field(default_factory=dict)


class Supervisor:
    def __init__(self, config: Config, argv: list[str], n: int) -> None:
        self.config = config
        self.argv = argv
        self.workers = [_Worker(i) for i in range(n)]
        self.health = health_aio.HealthServicer()
        self._dir = tempfile.mkdtemp(prefix="kvroute-workers-")
        self.socket_path = os.path.join(self._dir, "control.sock")
        self._relay = not config.redis.enabled
        self._relays: set[asyncio.StreamWriter] = set()
        self._log: deque[bytes] = deque(maxlen=config.redis.log_maxlen)  # relayed entries, replayed to a newcomer
        self._stopping = False
        self._stop = asyncio.Event()
        self._changed = asyncio.Event()  # a worker began serving or exited
        self._startup_error: str | None = None
        self._next_id = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self.grpc_port = 0
        self._reserved: socket.socket | None = None
        self._reserved_h2: socket.socket | None = None
        self._health_server: grpc.aio.Server | None = None
        self._close_metrics: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- start and stop --------------------------------------------------------------------------

    async def run(self) -> int:
        self._loop = asyncio.get_running_loop()
        try:
            await self._bind()
            server = await asyncio.start_unix_server(self._accept, path=self.socket_path)
            try:
                return await self._supervise()
            finally:
                server.close()
                await self._shutdown()
        finally:
            await self._release()
            shutil.rmtree(self._dir, ignore_errors=True)

    async def _bind(self) -> None:
        from extproc.listen import bind_or_explain as _bind

        s = self.config.server
        self._reserved = _reserve(s.listen, s.grpc_port)
        self.grpc_port = self._reserved.getsockname()[1]
        if s.h2_port:  # ext_proc over extproc/h2.py: every worker listens there too
            self._reserved_h2 = _reserve(s.listen, s.h2_port, "server.h2_port")
        if s.metrics_port:
            registry = CollectorRegistry()
            registry.register(_WorkersCollector(self))
            httpd, _ = _bind("server.metrics_port", s.listen, s.metrics_port,
                             lambda: start_http_server(s.metrics_port, addr=s.listen, registry=registry))  # fmt: skip

            def close() -> None:
                httpd.shutdown()
                httpd.server_close()

            self._close_metrics = close
        if s.health_port and s.health_port != s.grpc_port:
            # Not SO_REUSEPORT: a health port taken by anything else must stop kvroute, not be shared.
            hs = self._health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, hs)
            addr = f"{s.listen}:{s.health_port}"
            _bind("server.health_port", s.listen, s.health_port, lambda: hs.add_insecure_port(addr))
            await hs.start()
            await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
            await self._set_health()

    async def _release(self) -> None:
        if self._health_server is not None:
            await self._health_server.stop(None)
        if self._close_metrics is not None:
            self._close_metrics()
        for sock in (self._reserved, self._reserved_h2):
            if sock is not None:
                sock.close()

    async def _supervise(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: self._signal_all(signal.SIGHUP))
        for w in self.workers:
            await self._spawn(w)
        # Start: every worker serves, or one exits first (then nothing serves: exit with its name).
        while not self._stop.is_set() and self._startup_error is None:
            if all(w.serving for w in self.workers):
                break
            self._changed.clear()
            await _first(self._changed.wait(), self._stop.wait())
        if self._startup_error is not None:
            print(f"kvroute: cannot start: {self._startup_error}", file=sys.stderr)
            return EXIT_STARTUP
        if not self._stop.is_set():
            s = self.config.server
            log.info("kvroute serving", extra={"fields": {
                "workers": len(self.workers), "pids": [w.proc.pid for w in self.workers if w.proc],
                "grpc_port": self.grpc_port, "health_port": s.health_port, "metrics_port": s.metrics_port,
                "shared_state": "relay" if self._relay else "redis"}})  # fmt: skip
        await self._stop.wait()
        return 0

    async def _shutdown(self) -> None:
        """Health says NOT_SERVING at once; workers drain (SIGTERM) for the grace period, then go."""
        self._stopping = True
        if self._startup_error is None:
            log.info("kvroute draining", extra={"fields": {"grace_s": self.config.server.grace_period_s}})
        await self._set_health()
        self._signal_all(signal.SIGTERM)
        procs = [w.proc for w in self.workers if w.proc is not None and w.proc.returncode is None]
        if procs:
            _, pending = await asyncio.wait(
                [asyncio.ensure_future(p.wait()) for p in procs],
                timeout=self.config.server.grace_period_s + STOP_MARGIN_S,
            )
            for p in procs:
                if p.returncode is None:
                    log.warning("worker did not stop in time: killed", extra={"fields": {"pid": p.pid}})
                    p.kill()
            if pending:
                await asyncio.wait(pending, timeout=STOP_MARGIN_S)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in [*self._relays, *(w.control for w in self.workers if w.control)]:
            writer.close()
        log.info("kvroute stopped")

    def _signal_all(self, sig: int) -> None:
        for w in self.workers:
            if w.proc is not None and w.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(sig)

    # -- workers -----------------------------------------------------------------------------------

    async def _spawn(self, w: _Worker) -> None:
        env = {**os.environ, WORKER_ENV: str(w.index), CONTROL_ENV: self.socket_path}
        if self._relay:
            env[RELAY_ENV] = self.socket_path
        else:
            env.pop(RELAY_ENV, None)
        # The same command, as one process on the reserved port; the supervisor serves health and metrics.
        port = str(self.grpc_port)
        args = [*self.argv, "--workers", "1", "--grpc-port", port, "--health-port", port, "--metrics-port", "0"]
        if self.config.server.h2_port:
            args += ["--h2-port", str(self.config.server.h2_port)]
        w.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "extproc.cli", *args, env=env, stdin=asyncio.subprocess.DEVNULL
        )
        self._spawned(self._watch(w, w.proc))

    def _spawned(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self, w: _Worker, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        served = w.serving
        w.serving = False
        self._changed.set()
        await self._set_health()
        if self._stopping or self._stop.is_set():
            return
        how = f"signal {-code}" if code < 0 else f"code {code}"
        if not served and w.restarts == 0:  # at start: the configuration or a port is wrong for every worker
            self._startup_error = f"worker {w.index} exited with {how} before serving (its error is above)"
            return
        if served and time.monotonic() - w.served_at >= STABLE_S:
            w.failures = 0
        delay = min(RESTART_MAX_S, RESTART_MIN_S * 2**w.failures)
        w.failures += 1
        w.restarts += 1
        fields = {"worker": w.index, "pid": proc.pid, "exit": how, "restart_in_s": delay, "restarts": w.restarts}
        log.warning("worker exited: restarting it", extra={"fields": fields})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), delay)
        if not self._stop.is_set():
            await self._spawn(w)

    async def _set_health(self) -> None:
        serving = not self._stopping and any(w.serving for w in self.workers)
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in HEALTH_SERVICES:
            await self.health.set(name, status)

    # -- the Unix socket: control connections and the relay ----------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = msgpack.unpackb(await read_frame(reader))
            if hello.get("role") == "relay":
                await self._relay_from(reader, writer)
            elif hello.get("role") == "control":
                await self._control(self.workers[int(hello["worker"])], reader, writer)
        except (*FAULTS, ValueError, IndexError, KeyError):
            pass
        finally:
            writer.close()

    async def _relay_from(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A worker's shared-state entries go to every other worker, unchanged; a newcomer first
        gets the log so far (as a Redis stream replays)."""
        if self._log:
            writer.write(b"".join(self._log))
        self._relays.add(writer)
        try:
            while True:
                entry = await read_frame(reader)
                out = len(entry).to_bytes(4, "big") + entry
                self._log.append(out)
                for other in list(self._relays):
                    if other is writer:
                        continue
                    if other.transport.get_write_buffer_size() > RELAY_BUFFER_BYTES:
                        log.warning("a worker fell behind the relay: cut off, it reconnects and replays")
                        self._relays.discard(other)
                        other.close()
                        continue
                    other.write(out)
        finally:
            self._relays.discard(writer)

    async def _control(self, w: _Worker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        w.control = writer
        try:
            while True:
                msg = msgpack.unpackb(await read_frame(reader))
                kind = msg.get("t")
                if kind == "serving":
                    w.serving, w.served_at = True, time.monotonic()
                    self._changed.set()
                    await self._set_health()
                elif kind == "metrics" and (fut := w.waiting.pop(msg["id"], None)) is not None:
                    fut.set_result(msg["text"])
        finally:
            if w.control is writer:
                w.control = None
            for fut in w.waiting.values():
                fut.cancel()
            w.waiting.clear()

    async def _metrics_of(self, w: _Worker) -> bytes | None:
        if w.control is None:
            return None
        self._next_id += 1
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        w.waiting[self._next_id] = fut
        w.control.write(frame({"t": "metrics?", "id": self._next_id}))
        try:
            return await asyncio.wait_for(fut, SCRAPE_TIMEOUT_S)
        except (TimeoutError, asyncio.CancelledError):
            return None

    async def scrape(self) -> list[tuple[_Worker, str]]:
        """Every serving worker's metrics text (those that do not answer in time are left out)."""
        texts = await asyncio.gather(*(self._metrics_of(w) for w in self.workers))
        return [(w, t.decode()) for w, t in zip(self.workers, texts, strict=True) if t is not None]


async def _first(*aws: Awaitable[Any]) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()


class _WorkersCollector(Collector):
    """The supervisor's /metrics: the workers' metrics merged, and the workers themselves."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup

    def collect(self) -> Iterator[Metric]:
        loop = self.sup._loop
        assert loop is not None
        try:  # the HTTP server's thread asks the event loop, which talks to the workers
            got = asyncio.run_coroutine_threadsafe(self.sup.scrape(), loop).result(SCRAPE_TIMEOUT_S + 1)
        except Exception:
            got = []
        yield from merge_metrics(text for _, text in got)
        state = GaugeMetricFamily("kvroute_workers", "Worker processes: configured, and serving now", labels=["state"])
        state.add_metric(["configured"], len(self.sup.workers))
        state.add_metric(["serving"], sum(w.serving for w in self.sup.workers))
        yield state
        pid = GaugeMetricFamily("kvroute_worker_pid", "Each worker's process id (changes when it is restarted)",
                                labels=["worker"])  # fmt: skip
        restarts = CounterMetricFamily("kvroute_worker_restarts", "Workers restarted after they exited",
                                       labels=["worker"])  # fmt: skip
        decisions = CounterMetricFamily(
            "kvroute_worker_decisions",
            "Routing decisions each worker made (in its process's life; kvroute_decisions_total sums them)",
            labels=["worker"],
        )
        for w in self.sup.workers:
            if w.proc is not None and w.proc.returncode is None:
                pid.add_metric([str(w.index)], w.proc.pid)
            restarts.add_metric([str(w.index)], w.restarts)
        for w, text in got:
            made = (s.value for fam in merge_metrics([text]) if fam.name == "kvroute_decisions" for s in fam.samples)
            decisions.add_metric([str(w.index)], sum(made))
        yield from (pid, restarts, decisions)


def supervise(config: Config, argv: list[str]) -> int:
    """Run ``kvroute serve`` as a supervisor of ``server.workers`` workers; the exit status."""
    n = worker_count(config.server.workers)
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(Supervisor(config, argv, n).run())
    return 0
