"""Hot reload of ``kvroute serve --config FILE``: the file is polled (its content hash, every second:
a ConfigMap update swaps a symlink, which inotify on the file would miss) and SIGHUP reloads it at once.

A reload reads the file with the same command-line flags on top as at start (flags keep overriding
it), validates it, and then:

* invalid: refused. The running config stays; a warning and ``kvroute_config_refused_fields``
  name the field(s), ``kvroute_config_valid`` drops to 0.
* a setting only a restart can apply changed (listen address and ports, TLS, mode, discovery
  provider, KV events, scraping, Redis, table sizes): refused whole, naming those settings. All or
  nothing, so what runs is always one config validated as a whole, the one ``kvroute_config_info``
  names: a mix of the old and the new file never was (the old discovery provider with the new
  file's pools can be invalid; the old mode with the new cluster names routes nowhere).
* otherwise applied in one step on the event loop (``KVRouteServer.reconfigure``): routing weights,
  thresholds and cost, P/D, headers, models, static endpoints, the endpoints file. No decision sees
  half of it; open streams, the prefix index, route pins and in-flight counts carry on.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import signal
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from extproc.config import Config, load_config
from extproc.discovery import DiscoveryError
from extproc.errors import ConfigError
from extproc.observability import Metrics

log = logging.getLogger("kvroute.reload")

POLL_INTERVAL_S = 1.0

# Settings read once at start: a change to any of these (or below them) needs a restart.
RESTART_REQUIRED = (
    "mode",  # Envoy's config must change with it
    "server.listen",
    "server.grpc_port",
    "server.health_port",
    "server.metrics_port",
    "server.admin_port",
    "server.admin_listen",
    "server.max_body_bytes",  # the gRPC server's message size limit
    "server.tls",
    "server.workers",
    "server.event_loop",
    "discovery.provider",
    "discovery.kubernetes",
    "kv_events",  # the precise index and the subscriptions are built at start
    "scrape",
    "redis",
    "tenancy",  # the salt secret is read at start
    "pods",  # TLS to the pods: the client context is built at start
    "routing.index_capacity_blocks",
    "routing.route_table_size",
)

FILE_ERROR = "(file)"  # the field named when the file itself is unreadable or not YAML
_FIELD = re.compile(r"^[\w][\w.\-/]*$")
_MISSING = object()


def changed_fields(old: Config, new: Config) -> list[str]:
    """Dotted paths of the settings that differ (mappings such as pools and models are followed by
    key; lists compare whole: ``pools.default.endpoints``)."""
    return sorted(_diff(old.model_dump(), new.model_dump(), ""))


def _diff(old: Any, new: Any, path: str) -> Iterator[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in old.keys() | new.keys():
            yield from _diff(old.get(key, _MISSING), new.get(key, _MISSING), f"{path}.{key}" if path else str(key))
    elif old != new:
        yield path


def requires_restart(field: str) -> bool:
    return any(field == p or field.startswith(p + ".") for p in RESTART_REQUIRED)


def error_fields(message: str, source: str) -> list[str]:
    """The fields a ConfigError's lines (``<source>: <field>: <why>``) name; FILE_ERROR for a file
    that cannot be read or parsed. A check across fields names its field first in ``<why>``."""
    fields: list[str] = []
    for line in message.splitlines():
        rest = line.removeprefix(f"{source}: ")
        field, _, why = rest.partition(": ")
        if field == "(top level)":
            field = why.partition(": ")[0]
        field = field if _FIELD.match(field) else FILE_ERROR
        if field not in fields:
            fields.append(field)
    return fields or [FILE_ERROR]


def config_hash(config: Config) -> str:
    """A short hash of the effective settings (secrets masked), for kvroute_config_info."""
    return hashlib.sha256(config.model_dump_json().encode()).hexdigest()[:12]


def record_running(metrics: Metrics, config: Config) -> None:
    """The metrics that name the running config: its hash and when it was applied."""
    metrics.config_info.clear()
    metrics.config_info.labels(config_hash(config)).set(1)
    metrics.config_last_reload.set(time.time())


class ConfigReloader:
    """Watches ``path`` and hands each valid, live-applicable new config to ``apply``."""

    def __init__(
        self,
        path: str | Path,
        overrides: Mapping[str, Any],
        config: Config,
        apply: Callable[[Config], Awaitable[None]],
        metrics: Metrics,
        interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        self.path = Path(path)
        self.overrides = dict(overrides)
        self.config = config  # the running one
        self._apply = apply
        self.metrics = metrics
        self.interval_s = interval_s
        self._digest = self._read_digest()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[str]] = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._watch(), name="config:watch")
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)

    async def aclose(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closing
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        tasks = [t for t in (self._task, *self._pending) if t is not None]
        self._task = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _on_sighup(self) -> None:
        task = asyncio.get_running_loop().create_task(self.reload("SIGHUP"))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self._read_digest() != self._digest:
                await self.reload("file changed")

    def _read_digest(self) -> bytes:
        try:
            return hashlib.blake2b(self.path.read_bytes(), digest_size=16).digest()
        except OSError as e:  # reported by the reload that follows
            return f"unreadable: {e.errno}".encode()

    async def reload(self, trigger: str = "reload") -> str:
        """Read the file now; applied, unchanged, invalid or restart_required (kvroute_config_reloads_total)."""
        async with self._lock:
            self._digest = self._read_digest()
            try:
                new = load_config(self.path, self.overrides)
            except ConfigError as e:
                return self._refused("invalid", error_fields(str(e), str(self.path)), trigger, error=str(e))
            changed = changed_fields(self.config, new)
            restart = [f for f in changed if requires_restart(f)]
            if restart:
                why = "needs a restart to apply; nothing applied"
                return self._refused("restart_required", restart, trigger, changed=changed, why=why)
            if not changed:
                self._settle("unchanged")
                return "unchanged"
            try:
                await self._apply(new)
            except ConfigError as e:  # a tokenizer that cannot be loaded
                return self._refused("invalid", error_fields(str(e), str(self.path)), trigger, error=str(e))
            except DiscoveryError as e:  # the new endpoints file cannot be used
                return self._refused("invalid", ["discovery.file.path"], trigger, error=str(e))
            self.config = new
            self._settle("applied")
            record_running(self.metrics, new)
            log.info("config reloaded", extra={"fields": {"trigger": trigger, "changed": changed}})
            return "applied"

    def _settle(self, result: str) -> None:
        m = self.metrics
        m.config_reloads.labels(result).inc()
        m.config_valid.set(0 if result == "invalid" else 1)
        m.config_refused.clear()

    def _refused(self, result: str, fields: list[str], trigger: str, **extra: Any) -> str:
        self._settle(result)
        for field in fields:
            self.metrics.config_refused.labels(field, result).set(1)
        what = "config invalid, keeping the running one" if result == "invalid" else "config change refused"
        log.warning(what, extra={"fields": {"trigger": trigger, "path": str(self.path), "fields": fields, **extra}})
        return result
