"""A YAML/JSON endpoints file, re-read when it changes: for standalone Envoy setups (a ConfigMap or
a file that a deploy script rewrites) and for tests.

The file holds the same ``pools`` mapping as the config: ``{pools: {<name>: {endpoints: [...]}}}``.
It is polled (content hash): a ConfigMap update swaps a symlink, which inotify on the file misses.
A file that turns invalid keeps the last good endpoints, with a log line and a counter."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path

import yaml
from pydantic import ValidationError

from extproc.config import FileDiscoveryConfig, PoolConfig, _format_validation_error, _Strict
from extproc.discovery.base import DiscoveryError, Publish
from extproc.tasks import cancel_and_wait

log = logging.getLogger("kvroute.discovery")


class _EndpointsFile(_Strict):
    pools: dict[str, PoolConfig]


class FileProvider:
    name = "file"

    def __init__(self, cfg: FileDiscoveryConfig) -> None:
        self.path = Path(cfg.path)
        self.interval_s = cfg.poll_interval_s
        self._digest: bytes | None = None
        self._pools: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._valid = True
        self._why = ""
        self.counters = {"reloads": 0, "errors": 0}

    async def start(self, publish: Publish) -> None:
        if not self._load(publish):
            raise DiscoveryError(self._why)
        self._task = asyncio.get_running_loop().create_task(self._watch(publish), name="discovery:file")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait([task])

    def stats(self) -> dict[str, float]:
        return {**self.counters, "valid": float(self._valid)}

    def retarget(self, cfg: FileDiscoveryConfig, publish: Publish) -> None:
        """Follow ``cfg`` from now on (a config reload): the new file is read and published at once. An
        unusable one raises DiscoveryError, and the current file stays followed as it was."""
        kept = (self.path, self.interval_s, self._digest, self._valid, self._why)
        self.path, self.interval_s, self._digest = Path(cfg.path), cfg.poll_interval_s, None
        if not self._load(publish):
            why = self._why
            self.path, self.interval_s, self._digest, self._valid, self._why = kept
            raise DiscoveryError(why)

    async def _watch(self, publish: Publish) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self._load(publish)

    def _load(self, publish: Publish) -> bool:
        """Read the file; publish every pool if it changed. False (and ``_why``) if it is unusable."""
        try:
            raw = self.path.read_bytes()
        except OSError as e:
            return self._invalid(f"discovery.file: cannot read {self.path}: {e.strerror}")
        digest = hashlib.blake2b(raw, digest_size=16).digest()
        if digest == self._digest:
            return True
        try:
            data = yaml.safe_load(raw)  # JSON is YAML
            parsed = _EndpointsFile.model_validate(data if data is not None else {"pools": {}})
        except yaml.YAMLError as e:
            return self._invalid(f"discovery.file: {self.path} is not valid YAML/JSON: {e}")
        except ValidationError as e:
            return self._invalid(_format_validation_error(e, f"discovery.file {self.path}"))
        self._digest = digest
        if not self._valid:
            log.info("endpoints file valid again", extra={"fields": {"path": str(self.path)}})
        self._valid = True
        self.counters["reloads"] += 1
        # A pool dropped from the file loses its endpoints (it is published empty).
        for name in sorted(self._pools - parsed.pools.keys()):
            publish(name, [])
        for name, pool in parsed.pools.items():
            publish(name, pool.endpoints)
        self._pools = set(parsed.pools)
        return True

    def _invalid(self, why: str) -> bool:
        self._why = why
        self.counters["errors"] += 1
        if self._valid:
            log.warning("endpoints file unusable, keeping the last endpoints", extra={"fields": {"error": why}})
        self._valid = False
        return False
