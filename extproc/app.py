"""Process wiring: the gRPC server(s), health, metrics, graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from extproc import authz
from extproc.config import Config
from extproc.discovery import DiscoveryError
from extproc.errors import StartupError
from extproc.h2 import EXT_PROC_PATH, INVALID_ARGUMENT, NOT_FOUND, OK, GrpcStream, H2Server, Handler, Unary
from extproc.heap import settle
from extproc.listen import bind_or_explain as _bind
from extproc.observability import Metrics
from extproc.reload import ConfigReloader, record_running
from extproc.router import Router
from extproc.server import ExternalProcessor

log = logging.getLogger("kvroute")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
HEALTH_CHECK_PATH = "/grpc.health.v1.Health/Check"


class Health(health_aio.HealthServicer):
    """grpcio's health service, whose statuses kvroute's own HTTP/2 server answers too: Envoy's cluster
    and a gateway health-check the ext_proc port, whichever server holds it. The statuses are kept here as
    they are set (grpcio's own table is private), with grpcio's rules: "" serving from the start, nothing
    set after a graceful shutdown began, which turns every service NOT_SERVING."""

    def __init__(self) -> None:
        super().__init__()
        self._statuses: dict[str, int] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._final = False

    async def set(self, service: str, status: int) -> None:
        if not self._final:
            self._statuses[service] = status
        await super().set(service, status)

    async def enter_graceful_shutdown(self) -> None:
        self._final = True
        self._statuses = dict.fromkeys(self._statuses, health_pb2.HealthCheckResponse.NOT_SERVING)
        await super().enter_graceful_shutdown()

    def check(self, data: bytes) -> tuple[int, bytes | None, str]:
        """Health/Check over extproc/h2.py (``Unary``): the same answers as grpcio's Check."""
        try:
            service = health_pb2.HealthCheckRequest.FromString(data).service
        except DecodeError:
            return INVALID_ARGUMENT, None, "not a HealthCheckRequest"
        status = self._statuses.get(service)
        if status is None:
            return NOT_FOUND, None, ""
        return OK, health_pb2.HealthCheckResponse(status=status).SerializeToString(), ""


@dataclass
class Ports:
    grpc: int
    health: int
    admin: int = 0  # 0: off
    h2: int = 0  # ext_proc over extproc/h2.py (server.h2_port); 0: off


class KVRouteServer:
    """``await start()``, then ``await wait()`` until SIGTERM/SIGINT (or ``await stop()``).

    ``config_path``: the config file it came from (with ``overrides``, the command-line flags on top),
    reloaded when it changes or on SIGHUP (extproc/reload.py). ``reuse_port``: one of several workers
    on the same ports (extproc/workers.py)."""

    def __init__(
        self,
        config: Config,
        config_path: str | Path | None = None,
        overrides: Mapping[str, Any] | None = None,
        reuse_port: bool = False,
    ) -> None:
        self.config = config
        # grpc's default on Linux is SO_REUSEPORT on; workers depend on it, so they say so.
        self._grpc_options = [("grpc.so_reuseport", 1)] if reuse_port else []
        self.metrics = Metrics()
        self.router = Router(config, self.metrics)
        self.reloader = (
            None
            if config_path is None
            else ConfigReloader(config_path, overrides or {}, config, self.reconfigure, self.metrics)
        )
        self.health = Health()
        self._servers: list[grpc.aio.Server] = []
        self.ext_proc: ExternalProcessor | None = None  # the ext_proc servicer, once started
        self.authz_pending: authz.Pending | None = None  # requests routed over ext_authz, not yet logged done
        self.authz_http: authz.HttpAuthorizer | None = None  # ext_authz over HTTP (server.authz_http_port)
        self.h2: H2Server | None = None  # ext_proc over kvroute's own HTTP/2 server (server.h2_port)
        self._reuse_port = reuse_port
        self._stopped = asyncio.Event()
        self.ports = Ports(0, 0)
        self._close_metrics: Callable[[], None] | None = None

    def _credentials(self) -> grpc.ServerCredentials | None:
        tls = self.config.server.tls
        if tls is None:
            return None
        ca = tls.client_ca_file.read_bytes() if tls.client_ca_file else None
        return grpc.ssl_server_credentials(
            [(tls.key_file.read_bytes(), tls.cert_file.read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )

    async def start(self, before_serving: Callable[[], object] | None = None) -> Ports:
        """Bind every port, start the router and the servers, then report SERVING. ``before_serving``
        runs once everything listens and the router has its endpoints, before the health services (the
        readiness probe, Envoy's health check) say SERVING: ``serve`` freezes startup's heap there, a
        full collection that stops the event loop for ~0.1 s, which a request let in by the report
        would otherwise wait out."""
        s = self.config.server
        creds = self._credentials()
        try:
            # Every port is bound before anything starts: a taken one stops kvroute with its name.
            if s.metrics_port:
                self._close_metrics = _bind("server.metrics_port", s.listen, s.metrics_port,
                                            lambda: self.metrics.serve(s.metrics_port, s.listen))  # fmt: skip
            main = grpc.aio.server(
                options=[("grpc.max_receive_message_length", s.max_body_bytes + (1 << 20)), *self._grpc_options]
            )
            self._servers.append(main)
            self.ext_proc = ExternalProcessor(self.router)
            pb_grpc.add_ExternalProcessorServicer_to_server(self.ext_proc, main)
            # The ext_authz transport on the same port (kvroute envoy-config --api ext_authz picks one).
            self.authz_pending = authz.add_to_server(self.ext_proc, main)
            if s.authz_http_port:  # and over HTTP on its own (ext_authz_http); started with the gRPC servers
                self.authz_http = authz.HttpAuthorizer(self.ext_proc, self.authz_pending)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, main)
            addr = f"{s.listen}:{s.grpc_port}"
            grpc_port = _bind("server.grpc_port", s.listen, s.grpc_port, lambda: (
                main.add_secure_port(addr, creds) if creds else main.add_insecure_port(addr)))  # fmt: skip
            health_port = grpc_port
            if s.health_port and s.health_port != s.grpc_port:
                hs = grpc.aio.server()
                self._servers.append(hs)
                health_pb2_grpc.add_HealthServicer_to_server(self.health, hs)
                health_port = _bind("server.health_port", s.listen, s.health_port,
                                    lambda: hs.add_insecure_port(f"{s.listen}:{s.health_port}"))  # fmt: skip
            h2_port = 0
            if s.h2_port:  # ext_proc over kvroute's own HTTP/2 server (extproc/h2.py), beside grpcio's
                limit = s.max_body_bytes + (1 << 20)
                handlers: dict[str, Callable[[GrpcStream], Handler]] = {
                    EXT_PROC_PATH: self.ext_proc.h2_call,
                    HEALTH_CHECK_PATH: Unary.of(self.health.check),  # Envoy's and a gateway's health checks
                }
                self.h2 = h2 = H2Server(handlers, max_message=limit, max_streams=s.max_streams)
                h2_port = _bind("server.h2_port", s.listen, s.h2_port,
                                lambda: h2.bind(s.listen, s.h2_port, self._reuse_port))  # fmt: skip
            admin_port = 0
            if s.admin_port:
                from extproc.admin.service import add_to_server

                admin = grpc.aio.server(options=self._grpc_options)
                self._servers.append(admin)
                add_to_server(self.router, admin)
                admin_port = _bind("server.admin_port", s.admin_listen, s.admin_port,
                                   lambda: admin.add_insecure_port(f"{s.admin_listen}:{s.admin_port}"))  # fmt: skip
        except StartupError:
            await self._release()
            raise
        try:
            # Discovery's first endpoint sets (a Kubernetes list, the endpoints file) before serving.
            await self.router.start()
        except DiscoveryError as e:
            await self.router.aclose()
            await self._release()
            raise StartupError(str(e)) from None
        for srv in self._servers:
            await srv.start()
        if self.h2 is not None:
            await self.h2.start(s.tls.ssl_context() if s.tls else None)
        authz_http_port = 0
        if self.authz_http is not None:
            try:
                authz_http_port = await self.authz_http.start(s.listen, s.authz_http_port)
            except OSError as e:
                await self.stop()
                raise StartupError(f"server.authz_http_port {s.authz_http_port}: cannot bind {s.listen}: "
                                   f"{e.strerror or e}") from None  # fmt: skip
        if before_serving is not None:
            before_serving()
        for name in HEALTH_SERVICES:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.ports = Ports(grpc_port, health_port, admin_port, h2_port)
        record_running(self.metrics, self.config)
        if self.reloader is not None:
            await self.reloader.start()
        log.info(
            "kvroute serving",
            extra={
                "fields": {
                    "mode": self.config.mode,
                    "grpc_port": grpc_port,
                    "health_port": health_port,
                    "metrics_port": s.metrics_port,
                    "admin_port": admin_port or None,
                    "authz_http_port": authz_http_port or None,
                    "h2_port": h2_port or None,
                    "tls": creds is not None,
                    "discovery": self.config.discovery.provider,
                    "pools": {n: [e.address for e in p.endpoints] for n, p in self.router.registry.pools.items()},
                }
            },
        )
        return self.ports

    async def _release(self) -> None:
        """Give back what a failed start bound. grpc frees a bound port only when a started server
        stops, so each is started and stopped at once, every health status NOT_SERVING first."""
        await self.health.enter_graceful_shutdown()
        for srv in self._servers:
            await srv.start()
            await srv.stop(None)
        self._servers.clear()
        if self.h2 is not None:
            self.h2.close()
            self.h2 = None
        if self._close_metrics is not None:
            self._close_metrics()
            self._close_metrics = None

    async def stop(self) -> None:
        """Stop accepting, let open streams finish (up to the grace period), then exit."""
        if self._stopped.is_set():
            return
        log.info("kvroute draining", extra={"fields": {"grace_s": self.config.server.grace_period_s}})
        if self.reloader is not None:
            await self.reloader.aclose()
        for name in ("readiness", EXT_PROC_SERVICE, ""):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.authz_http is not None:
            await self.authz_http.stop()
        grace = self.config.server.grace_period_s
        await asyncio.gather(*(srv.stop(grace) for srv in self._servers),
                             *([self.h2.stop(grace)] if self.h2 is not None else []))  # fmt: skip
        if self.ext_proc is not None:
            self.ext_proc.close()
        if self.authz_pending is not None:
            self.authz_pending.release_all()
        await self.router.aclose()
        if self._close_metrics is not None:
            self._close_metrics()
        self._stopped.set()
        log.info("kvroute stopped")

    async def reconfigure(self, config: Config) -> None:
        """Apply a reloaded config (what changed applies live: ConfigReloader checked). Tokenizers load
        off the event loop; the rest is one synchronous step."""
        tokenizers = await asyncio.to_thread(self.router.load_tokenizers, config)
        self.router.reconfigure(config, tokenizers)
        if config.server.log_level != self.config.server.log_level:
            logging.getLogger().setLevel(config.server.log_level.upper())
        self.config = config

    async def wait(self) -> None:
        await self._stopped.wait()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.stop()))


def run_loop(loop: str, main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on ``server.event_loop``'s loop (grpc.aio serves on either)."""
    if loop == "uvloop":
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)


async def serve(
    config: Config, config_path: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> None:
    from extproc.workers import WorkerLink

    link = WorkerLink.from_env()  # a worker of ``--workers N``: its supervisor's control connection
    server = KVRouteServer(config, config_path, overrides, reuse_port=link is not None)
    # Startup's objects out of the collector's way for the process's life, before kvroute reports SERVING.
    await server.start(before_serving=lambda: settle(server.metrics))
    server.install_signal_handlers()
    if link is not None:
        try:
            await link.serving(server.metrics.registry, server.stop)
        except StartupError:
            await server.stop()
            raise
    await server.wait()
    if link is not None:
        await link.aclose()
