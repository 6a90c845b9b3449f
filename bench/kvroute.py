"""Run ``kvroute serve`` as a real subprocess on free loopback ports (tests, demo, benchmarks)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.envoy import free_port
from bench.procs import ProcessExited, die_with_parent, start_on_free_ports, stop

# ``kvroute serve``'s exit status when a port it must listen on is taken (extproc.cli.EXIT_STARTUP).
EXIT_STARTUP = 3


class KVRouteProcess:
    def __init__(
        self,
        endpoints: Sequence[str] = (),
        extra_args: Sequence[str] = (),
        config: str | None = None,
        launcher: Sequence[str] = (),
        admin: bool = False,
        authz_http: bool = False,
        h2: bool = False,
    ):
        """``launcher``: interpreter arguments before ``-m extproc.cli`` (e.g. bench.memtrace's);
        ``admin``: serve the admin service too (``explain``) on a free loopback port; ``authz_http``: serve
        ext_authz over HTTP too (``authz_http_port``, for an ``--api ext_authz_http`` Envoy); ``h2``: serve
        ext_proc on kvroute's own HTTP/2 server too (``h2_port``: point Envoy's ext_proc cluster there)."""
        self._launcher = [*launcher]
        self._admin = admin
        self.admin_port = 0
        self._authz_http = authz_http
        self.authz_http_port = 0
        self._h2 = h2
        self.h2_port = 0
        self._dir = tempfile.TemporaryDirectory(prefix="kvroute-")
        self.log_path = Path(self._dir.name) / "kvroute.log"
        self._tail = [*extra_args]
        if endpoints:
            self._tail += ["--endpoints", ",".join(endpoints)]
        if config:
            self._tail += ["--config", config]
        self._pick_ports()
        self.proc: subprocess.Popen[bytes] | None = None

    def _pick_ports(self) -> None:
        self.grpc_port, self.health_port, self.metrics_port = free_port(), free_port(), free_port()
        ports = ["--grpc-port", str(self.grpc_port), "--health-port", str(self.health_port)]
        if self._admin:
            self.admin_port = free_port()
            ports += ["--admin-port", str(self.admin_port)]
        if self._authz_http:
            self.authz_http_port = free_port()
            ports += ["--authz-http-port", str(self.authz_http_port)]
        if self._h2:
            self.h2_port = free_port()
            ports += ["--h2-port", str(self.h2_port)]
        self.args = [sys.executable, *self._launcher, "-m", "extproc.cli", "serve", "--listen", "127.0.0.1", *ports,
                     "--metrics-port", str(self.metrics_port), *self._tail]  # fmt: skip

    @property
    def ext_proc_port(self) -> int:
        """Where Envoy's ext_proc stream goes: kvroute's own HTTP/2 server when it has one, else grpcio's."""
        return self.h2_port or self.grpc_port

    def start(self, timeout: float = 20) -> KVRouteProcess:
        try:
            ready = start_on_free_ports(self._launch, lambda: self.health() == "SERVING",
                                        port_taken=lambda p: p.returncode == EXIT_STARTUP,
                                        repick=self._repick, timeout=timeout, poll_s=0.1)  # fmt: skip
        except ProcessExited as e:
            raise RuntimeError(f"kvroute exited {e.returncode}: {self.log()}") from None
        if not ready:
            raise RuntimeError(f"kvroute not healthy after {timeout}s: {self.log()}")
        return self

    def _launch(self) -> subprocess.Popen[bytes]:
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            die_with_parent(self.args), stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ}
        )
        return self.proc

    def _repick(self) -> None:
        self._log.close()
        self._pick_ports()

    def health(self, service: str = "envoy.service.ext_proc.v3.ExternalProcessor") -> str:
        try:
            with grpc.insecure_channel(f"127.0.0.1:{self.health_port}") as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
        except grpc.RpcError as e:
            return f"error:{e.code().name}"

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as r:
            return r.read().decode()

    def precise_stat(self, stat: str) -> int:
        """One of the precise index's counters (``kvroute_precise_index{stat=...}``), 0 if absent."""
        m = re.search(rf'^kvroute_precise_index\{{stat="{re.escape(stat)}"\}} (\S+)$', self.metrics(), re.M)
        return int(float(m[1])) if m else 0

    def wait_precise_stat(self, stat: str, at_least: int, timeout: float = 10.0) -> None:
        """Until the counter reaches ``at_least`` (e.g. the blocks a request stored, as KV events that
        arrive a moment after its response): a condition, not a guessed sleep."""
        deadline = time.monotonic() + timeout
        while (now := self.precise_stat(stat)) < at_least:
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvroute_precise_index{{stat={stat!r}}} is {now}, expected {at_least} by now")
            time.sleep(0.01)

    def decision(self, request_id: str, timeout: float = 2.0) -> dict[str, Any]:
        """The "routed" debug line kvroute logged for ``request_id`` (needs ``log_level: debug``)."""
        needle = f'"request_id":"{request_id}"'
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if needle in line and '"msg":"routed"' in line:
                    return dict(json.loads(line))
            time.sleep(0.02)
        raise LookupError(f"kvroute logged no decision for request {request_id}")

    def explain(self, body: dict[str, Any], headers: dict[str, str] | None = None, path: str = "") -> Any:
        """The admin service's Explain for a chat body (``path``: another API's, e.g. /v1/messages) — a dry run
        of the live decision: what kvroute would predict and pick for it now. Needs ``admin=True``."""
        from extproc.admin.proto import admin_pb2 as pb
        from extproc.admin.proto import admin_pb2_grpc as pb_grpc

        if not self.admin_port:
            raise RuntimeError("KVRouteProcess(admin=True) serves the admin service")
        with grpc.insecure_channel(f"127.0.0.1:{self.admin_port}") as channel:
            return pb_grpc.AdminStub(channel).Explain(
                pb.ExplainRequest(path=path, method="POST", body=json.dumps(body).encode(), headers=headers or {}),
                timeout=10,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        stop(self.proc, 15)
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self) -> KVRouteProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._dir.cleanup()
