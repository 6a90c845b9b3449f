"""Real ``redis-server`` processes on free loopback ports (tests, benchmarks): standalone (AUTH,
TLS), a 3-master Redis Cluster, and a master with a Sentinel. No persistence: a restart comes back
empty. Needs Debian's redis-server (``make test`` installs it)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import redis

from bench.envoy import free_port
from bench.procs import ProcessExited, die_with_parent, start_on_free_ports

PORT_TAKEN = "Address already in use"
T = TypeVar("T")


def redis_server_binary() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (apt-get install -y redis-server; make test does it)")
    return exe


def wait_for(condition: Callable[[], T], timeout: float, what: str, poll_s: float = 0.02) -> T:
    """Poll ``condition()`` until it returns something truthy (returned), or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll_s)


class RedisServer:
    """One redis-server on 127.0.0.1. ``extra`` are more ``--name value`` config arguments."""

    def __init__(
        self, *extra: str, password: str | None = None, tls: dict[str, Path] | None = None, sentinel_of: int = 0
    ) -> None:
        """``sentinel_of``: run as a Sentinel monitoring the master on that port instead."""
        self.exe = redis_server_binary()
        self._dir = tempfile.TemporaryDirectory(prefix="kvroute-redis-")
        self.dir = Path(self._dir.name)
        self.log_path = self.dir / "redis.log"
        self.extra = list(extra)
        self.password = password
        self.tls = tls
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.sentinel_of = sentinel_of

    def args(self) -> list[str]:
        if self.sentinel_of:
            # A Sentinel rewrites its config file: one of its own, first on the command line.
            conf = self.dir / "sentinel.conf"
            conf.write_text(f"sentinel monitor {RedisSentinel.MASTER} 127.0.0.1 {self.sentinel_of} 1\n")
            return [self.exe, str(conf), "--sentinel", "--bind", "127.0.0.1", "--port", str(self.port)]
        a = [self.exe, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.dir),
             "--enable-debug-command", "local"]  # fmt: skip
        if self.tls is not None:
            t = self.tls
            a += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(t["cert"]),
                  "--tls-key-file", str(t["key"]), "--tls-ca-cert-file", str(t["ca"]),
                  "--tls-auth-clients", "yes"]  # fmt: skip
        else:
            a += ["--port", str(self.port)]
        if self.password is not None:
            a += ["--requirepass", self.password]
        return [*a, *self.extra]

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        kw: dict[str, Any] = {"password": self.password, "socket_timeout": 5}
        if self.tls is not None:
            kw.update(ssl=True, ssl_ca_certs=str(self.tls["ca"]), ssl_certfile=str(self.tls["cert"]),
                      ssl_keyfile=str(self.tls["key"]), ssl_check_hostname=False)  # fmt: skip
        return redis.Redis(host="127.0.0.1", port=self.port, **kw)

    def ping(self) -> bool:
        try:
            with self.client() as c:
                return bool(c.ping())
        except (redis.RedisError, OSError):
            return False

    def start(self, timeout: float = 10.0, same_port: bool = False) -> RedisServer:
        """Start (again, on the same port with ``same_port``: a restart, empty)."""

        def repick() -> None:
            if same_port:
                raise RuntimeError(f"port {self.port} was taken while redis-server was down")
            self.port = free_port()

        try:
            ready = start_on_free_ports(self._launch, self.ping, port_taken=lambda _p: PORT_TAKEN in self.log(),
                                        repick=repick, timeout=timeout, poll_s=0.02)  # fmt: skip
        except ProcessExited as e:
            raise RuntimeError(f"redis-server exited {e.returncode}: {self.log()}") from None
        if not ready:
            raise RuntimeError(f"redis-server not answering after {timeout}s: {self.log()}")
        return self

    def _launch(self) -> subprocess.Popen[bytes]:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(die_with_parent(self.args()), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self.proc

    def kill(self) -> None:
        """SIGKILL: no goodbye to its clients, nothing saved."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start(same_port=True)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        self.kill()
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisCluster:
    """Three masters (no replicas) with every slot assigned: ``redis-cli --cluster create``."""

    def __init__(self, masters: int = 3) -> None:
        self.nodes: list[RedisServer] = []
        for _ in range(masters):
            bus = free_port()
            # cluster-port: the bus port is picked free too (the default, port + 10000, may not be).
            self.nodes.append(RedisServer("--cluster-enabled", "yes", "--cluster-port", str(bus),
                                          "--cluster-config-file", "nodes.conf",
                                          "--cluster-node-timeout", "2000"))  # fmt: skip

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisCluster:
        for n in self.nodes:
            n.start()
        cli = shutil.which("redis-cli") or "redis-cli"
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        r = subprocess.run([cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr

        def ok() -> bool:
            for n in self.nodes:
                with n.client() as c:
                    if c.execute_command("CLUSTER", "INFO").decode().find("cluster_state:ok") < 0:
                        return False
            return True

        wait_for(ok, 30, "cluster_state:ok on every node", poll_s=0.1)
        return self

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisSentinel:
    """A master and one Sentinel monitoring it as ``mymaster`` (quorum 1)."""

    MASTER = "mymaster"

    def __init__(self) -> None:
        self.master = RedisServer()
        self.sentinel: RedisServer | None = None

    def start(self) -> RedisSentinel:
        self.master.start()
        s = self.sentinel = RedisServer(sentinel_of=self.master.port).start()

        def knows_master() -> bool:
            with s.client() as c:
                return c.execute_command("SENTINEL", "get-master-addr-by-name", self.MASTER) is not None

        wait_for(knows_master, 10, "the sentinel to know its master")
        return self

    @property
    def url(self) -> str:
        assert self.sentinel is not None
        return f"redis://127.0.0.1:{self.sentinel.port}/0"

    def stop(self) -> None:
        if self.sentinel is not None:
            self.sentinel.stop()
        self.master.stop()

    def __enter__(self) -> RedisSentinel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
