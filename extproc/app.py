"""Process wiring: the gRPC server(s), health, metrics, graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from extproc.config import Config
from extproc.observability import Metrics
from extproc.router import Router
from extproc.server import ExternalProcessor

log = logging.getLogger("kvroute")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)


@dataclass
class Ports:
    grpc: int
    health: int


class KVRouteServer:
    """``await start()``, then ``await wait()`` until SIGTERM/SIGINT (or ``await stop()``)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics()
        self.router = Router(config, self.metrics)
        self.health = health_aio.HealthServicer()
        self._servers: list[grpc.aio.Server] = []
        self._stopped = asyncio.Event()
        self.ports = Ports(0, 0)

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

    async def start(self) -> Ports:
        s = self.config.server
        main = grpc.aio.server(options=[("grpc.max_receive_message_length", s.max_body_bytes + (1 << 20))])
        pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(self.router), main)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, main)
        creds = self._credentials()
        addr = f"{s.listen}:{s.grpc_port}"
        grpc_port = main.add_secure_port(addr, creds) if creds else main.add_insecure_port(addr)
        self._servers.append(main)
        health_port = grpc_port
        if s.health_port and s.health_port != s.grpc_port:
            hs = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, hs)
            health_port = hs.add_insecure_port(f"{s.listen}:{s.health_port}")
            self._servers.append(hs)
        await self.router.start()
        for srv in self._servers:
            await srv.start()
        if s.metrics_port:
            self.metrics.serve(s.metrics_port, s.listen)
        for name in HEALTH_SERVICES:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.ports = Ports(grpc_port, health_port)
        log.info(
            "kvroute serving",
            extra={
                "fields": {
                    "mode": self.config.mode,
                    "grpc_port": grpc_port,
                    "health_port": health_port,
                    "metrics_port": s.metrics_port,
                    "tls": creds is not None,
                    "pools": {n: [e.address for e in p.endpoints] for n, p in self.config.pools.items()},
                }
            },
        )
        return self.ports

    async def stop(self) -> None:
        """Stop accepting, let open streams finish (up to the grace period), then exit."""
        if self._stopped.is_set():
            return
        log.info("kvroute draining", extra={"fields": {"grace_s": self.config.server.grace_period_s}})
        for name in ("readiness", EXT_PROC_SERVICE, ""):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await asyncio.gather(*(srv.stop(self.config.server.grace_period_s) for srv in self._servers))
        await self.router.aclose()
        self._stopped.set()
        log.info("kvroute stopped")

    async def wait(self) -> None:
        await self._stopped.wait()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.stop()))


async def serve(config: Config) -> None:
    server = KVRouteServer(config)
    await server.start()
    server.install_signal_handlers()
    await server.wait()
