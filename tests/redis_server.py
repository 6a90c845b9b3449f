"""Real redis-server processes for tests (bench/redis_server.py), skipped without the binary, except
under CI (``CI=true``), where a missing redis-server fails the test: ``make test`` installs it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from typing import Any

import pytest

from bench import redis_server as _procs


def require_redis_server() -> None:
    if shutil.which("redis-server") is None:
        msg = "redis-server is not installed (make test installs it: apt-get install -y redis-server)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)


class RedisServer(_procs.RedisServer):
    def __init__(self, *extra: str, **kw: Any) -> None:
        require_redis_server()
        super().__init__(*extra, **kw)


class RedisCluster(_procs.RedisCluster):
    def __init__(self, masters: int = 3) -> None:
        require_redis_server()
        super().__init__(masters)


class RedisSentinel(_procs.RedisSentinel):
    MASTER = _procs.RedisSentinel.MASTER

    def __init__(self) -> None:
        require_redis_server()
        super().__init__()


def all_entries(servers: Sequence[RedisServer]) -> dict[bytes, object]:
    """Every key on ``servers`` with its type and value (streams as their entries)."""
    out: dict[bytes, object] = {}
    for s in servers:
        with s.client() as c:
            for key in c.scan_iter(count=1000):
                t = c.type(key).decode()
                if t == "stream":
                    out[key] = ("stream", c.xrange(key))
                elif t == "string":
                    out[key] = ("string", c.get(key))
                else:
                    out[key] = (t, None)
    return out
