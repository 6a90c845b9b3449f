"""A redis-py asyncio client for the ``redis`` config section: standalone, cluster or sentinel; AUTH
(ACL user, password from the config, the url or an environment variable) and TLS."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

from extproc.config import RedisConfig, parse_host_port

RedisClient = Redis | RedisCluster


def password(cfg: RedisConfig) -> str | None:
    """The config's password, else the environment variable's (the url's, if any, wins in redis-py)."""
    if cfg.password is not None:
        return cfg.password.get_secret_value()
    return os.environ.get(cfg.password_env) or None


def safe_url(cfg: RedisConfig) -> str:
    """The url without credentials, for logs."""
    u = urlsplit(cfg.url or "")
    return f"{u.scheme}://{u.hostname}:{u.port or 6379}{u.path}"


def _options(cfg: RedisConfig, socket_timeout: float) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": cfg.timeout_s,
        # kvroute's own loops retry (with backoff) and degrade to local state meanwhile: a command
        # retried inside redis-py would only wait longer than timeout_s.
        "retry": Retry(NoBackoff(), 0),
        "decode_responses": False,
    }
    if cfg.username:
        opts["username"] = cfg.username
    pw = password(cfg)
    if pw:
        opts["password"] = pw
    if (cfg.url or "").startswith("rediss://"):
        tls = cfg.tls
        opts["ssl_check_hostname"] = tls.check_hostname if tls else True
        if tls is not None:
            if tls.ca_file is not None:
                opts["ssl_ca_certs"] = str(tls.ca_file)
            if tls.cert_file is not None and tls.key_file is not None:
                opts["ssl_certfile"], opts["ssl_keyfile"] = str(tls.cert_file), str(tls.key_file)
    return opts


def make_client(cfg: RedisConfig, socket_timeout: float) -> RedisClient:
    """A client whose every socket operation gives up after ``socket_timeout`` seconds."""
    assert cfg.url is not None
    opts = _options(cfg, socket_timeout)
    if cfg.mode == "cluster":
        return RedisCluster.from_url(cfg.url, **opts)
    if cfg.mode == "sentinel":
        u = urlsplit(cfg.url)
        first = (u.hostname or "", u.port or 26379)
        sentinels = [first, *(parse_host_port(s, 26379) for s in cfg.sentinels)]
        if u.username and "username" not in opts:
            opts["username"] = u.username
        if u.password and "password" not in opts:
            opts["password"] = u.password
        db = int(u.path.strip("/") or 0)
        if u.scheme == "rediss":
            opts["ssl"] = True
        sentinel = Sentinel(
            sentinels,
            sentinel_kwargs={"socket_timeout": socket_timeout, "socket_connect_timeout": cfg.timeout_s},
            **opts,
        )
        assert cfg.sentinel_master is not None
        return sentinel.master_for(cfg.sentinel_master, db=db)
    return Redis.from_url(cfg.url, **opts)
