"""Several kvroute replicas behind one Envoy: its ``kvroute`` cluster lists every replica and each
ext_proc stream (one per request) goes to the next, round robin; optionally sharing state through a
redis-server of their own on loopback."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from bench.envoy import EnvoyProcess
from bench.kvroute import KVRouteProcess
from bench.redis_server import RedisServer


class ReplicatedEnvoy(EnvoyProcess):
    """``EnvoyProcess`` pointed at several kvroute replicas. bench/envoy.py writes a kvroute cluster
    of one; this puts every replica in the config it wrote (and again on a port retry)."""

    def __init__(self, config: str | Path, replicas: Sequence[int], **patch: Any) -> None:
        self._replicas = list(replicas)
        super().__init__(config, kvroute_port=self._replicas[0], **patch)

    def _pick_ports(self) -> None:
        super()._pick_ports()
        cfg = yaml.safe_load(self.config_path.read_text())
        for c in cfg["static_resources"]["clusters"]:
            if c["name"] == "kvroute":
                c["lb_policy"] = "ROUND_ROBIN"
                c["load_assignment"]["endpoints"] = [{"lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
                    for p in self._replicas]}]  # fmt: skip
        self.config_path.write_text(yaml.safe_dump(cfg))


class KVRouteReplicas:
    """``n`` ``kvroute serve`` processes with the same arguments; with ``redis`` they share state
    through a redis-server started for them (``--redis-url``); ``authz_http``: each serves ext_authz over
    HTTP too, ``h2``: ext_proc on its own HTTP/2 server (KVRouteProcess's; ``ports`` are then those)."""

    def __init__(self, n: int, endpoints: Sequence[str] = (), extra_args: Sequence[str] = (),
                 config: str | None = None, redis: bool = False, authz_http: bool = False,
                 h2: bool = False) -> None:  # fmt: skip
        self.n, self.endpoints, self.extra_args, self.config = n, endpoints, list(extra_args), config
        self.authz_http, self.h2 = authz_http, h2
        self.redis: RedisServer | None = RedisServer() if redis else None
        self.replicas: list[KVRouteProcess] = []
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> KVRouteReplicas:
        try:
            args = self.extra_args
            if self.redis is not None:
                self._stack.enter_context(self.redis)
                args = [*args, "--redis-url", self.redis.url]
            for _ in range(self.n):
                kv = KVRouteProcess(self.endpoints, args, config=self.config, authz_http=self.authz_http, h2=self.h2)
                self.replicas.append(self._stack.enter_context(kv))
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @property
    def ports(self) -> list[int]:
        return [k.ext_proc_port for k in self.replicas]

    def pids(self) -> dict[str, int]:
        out = {("kvroute" if i == 0 else f"kvroute-{i + 1}"): k.proc.pid
               for i, k in enumerate(self.replicas) if k.proc is not None}  # fmt: skip
        if self.redis is not None and self.redis.proc is not None:
            out["redis"] = self.redis.proc.pid
        return out

    def metrics(self) -> str:
        """Every replica's /metrics, one after another."""
        return "\n".join(k.metrics() for k in self.replicas)
