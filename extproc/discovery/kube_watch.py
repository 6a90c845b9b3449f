"""List+watch of one Kubernetes collection, the protocol client-go's reflector speaks.

List (which gives a resourceVersion), then watch from it with bookmarks; every event and bookmark
moves the resourceVersion on, so a watch that ends (its timeoutSeconds) or drops resumes where it
was without losing or repeating events. A 410 (history compacted) relists. Failures back off
exponentially; whether the API server answers is shared by all collections and logged once an outage.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson

from extproc.config import KubernetesDiscoveryConfig

log = logging.getLogger("kvroute.discovery")

Obj = dict[str, Any]
Fetch = Callable[..., Awaitable[Any]]
"""A generated ``list_*`` call with its fixed arguments bound; with ``_preload_content=False`` it returns
the raw ``aiohttp.ClientResponse`` (its annotation says the model it would otherwise build)."""

EVENT_TYPES = ("ADDED", "MODIFIED", "DELETED")


class Gone(Exception):
    """The resourceVersion is older than the API server's history (410): only a relist can catch up."""


class Unreachable(Exception):
    """No answer from the API server: refused, reset, timed out."""


class APIError(Exception):
    """The API server answered a request (or a watch) with an error status."""

    def __init__(self, verb: str, status: int, message: str) -> None:
        super().__init__(f"{verb}: HTTP {status}: {message}")
        self.verb, self.status, self.message = verb, status, message


class Health:
    """The provider's counters, and whether the API server answers (a warning per outage, an info at its end)."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.reachable = True
        self.counts = dict.fromkeys(("relists", "watch_restarts", "errors", "events", "bookmarks"), 0)

    def up(self) -> None:
        if not self.reachable:
            self.reachable = True
            log.info("kubernetes API server reachable again", extra={"fields": {"server": self.server}})

    def down(self, error: Exception) -> None:
        self.counts["errors"] += 1
        if self.reachable:
            self.reachable = False
            log.warning(
                "kubernetes API server unreachable: keeping the last endpoints",
                extra={"fields": {"server": self.server, "error": str(error)}},
            )


class Reflector:
    """One collection (``resource`` in ``namespace``, narrowed by ``detail``: a selector or a name)."""

    def __init__(
        self,
        resource: str,
        namespace: str,
        detail: str,
        fetch: Fetch,
        cfg: KubernetesDiscoveryConfig,
        health: Health,
        on_list: Callable[[list[Obj]], None],
        on_event: Callable[[str, Obj], None],
    ) -> None:
        self.resource, self.namespace, self.detail = resource, namespace, detail
        self.resource_version: str | None = None
        self._fetch, self._cfg, self._health = fetch, cfg, health
        self._on_list, self._on_event = on_list, on_event

    @property
    def what(self) -> str:
        return f'{self.resource} in namespace "{self.namespace}"'

    async def _request(
        self, verb: str, timeout: float | None, client_timeout: aiohttp.ClientTimeout, **params: Any
    ) -> aiohttp.ClientResponse:
        """Send; a 200 response comes back unread, anything else raises (410 → Gone)."""
        try:
            resp: aiohttp.ClientResponse = await asyncio.wait_for(
                self._fetch(_preload_content=False, _request_timeout=client_timeout, **params),
                timeout or self._cfg.request_timeout_s,
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise Unreachable(f"{type(e).__name__}: {e}".removesuffix(": ")) from e
        self._health.up()
        if resp.status == 200:
            return resp
        try:
            status = orjson.loads(await asyncio.wait_for(resp.read(), self._cfg.request_timeout_s))
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
            status = {}
        finally:
            resp.release()
        message = (status.get("message") if isinstance(status, dict) else None) or resp.reason or ""
        if resp.status == 410:
            raise Gone(message)
        raise APIError(verb, resp.status, message)

    async def list(self, timeout: float | None = None) -> None:
        """Replace the collection's contents (``on_list``) and take its resourceVersion."""
        resp = await self._request("list", timeout, aiohttp.ClientTimeout(total=timeout or self._cfg.request_timeout_s))
        try:
            body = orjson.loads(await resp.read())
        except (aiohttp.ClientError, TimeoutError) as e:
            raise Unreachable(f"list cut off: {type(e).__name__}: {e}") from e
        except orjson.JSONDecodeError as e:
            raise APIError("list", 200, f"not JSON: {e}") from e
        finally:
            resp.release()
        self._on_list(body.get("items") or [])
        self.resource_version = body["metadata"]["resourceVersion"]

    async def open_watch(self, timeout: float | None = None) -> aiohttp.ClientResponse:
        rt, wt = self._cfg.request_timeout_s, self._cfg.watch_timeout_s
        # The server ends the watch after wt s; nothing at all for wt + rt s is a dead connection.
        return await self._request(
            "watch",
            timeout,
            aiohttp.ClientTimeout(sock_connect=rt, sock_read=wt + rt),
            watch=True,
            resource_version=self.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=wt,
        )

    async def _stream(self, resp: aiohttp.ClientResponse) -> int:
        """Apply a watch's events until it ends or drops; returns how many lines it carried."""
        lines = 0
        try:
            async for line in resp.content:
                if line.strip():
                    lines += 1
                    self._handle(orjson.loads(line))
        except (aiohttp.ClientError, TimeoutError) as e:  # dropped or silent: resume from resource_version
            log.debug("watch ended", extra={"fields": {"watch": self.what, "error": f"{type(e).__name__}: {e}"}})
        except orjson.JSONDecodeError as e:
            raise APIError("watch", 200, f"event is not JSON: {e}") from e
        finally:
            resp.release()
        return lines

    def _handle(self, event: Obj) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone(obj.get("message") or "resource version too old")
            raise APIError("watch", int(obj.get("code") or 500), obj.get("message") or "error event")
        if kind == "BOOKMARK":
            self._health.counts["bookmarks"] += 1
        elif kind in EVENT_TYPES:
            self._health.counts["events"] += 1
            self._on_event(kind, obj)
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if rv:
            self.resource_version = rv

    async def run(self, first: aiohttp.ClientResponse | None = None) -> None:
        """Keep the collection current until cancelled: watch (``first`` if already open), relist when needed."""
        initial, cap = self._cfg.backoff_initial_s, self._cfg.backoff_max_s
        delay, complained = initial, False
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    if self.resource_version is None:
                        await self.list()
                    if first is None:
                        self._health.counts["watch_restarts"] += 1
                        first = await self.open_watch()
                    resp, first = first, None
                    started = loop.time()
                    # A watch that carried something or lasted is a success: watch on at once. One that
                    # ended empty right away (a proxy closing it) backs off like a failure, or we would spin.
                    if await self._stream(resp) or loop.time() - started >= 1.0:
                        delay, complained = initial, False
                        continue
                except Gone as e:
                    self._health.counts["relists"] += 1
                    log.info(
                        "watch history expired: relisting", extra={"fields": {"watch": self.what, "error": str(e)}}
                    )
                    self.resource_version = None
                    continue
                except Unreachable as e:
                    self._health.down(e)
                except APIError as e:
                    self._health.counts["errors"] += 1
                    if not complained:
                        complained = True
                        log.warning(
                            "kubernetes watch failed: retrying", extra={"fields": {"watch": self.what, "error": str(e)}}
                        )
                except Exception:  # a bug or an object we cannot read: start over from a list, later
                    self._health.counts["errors"] += 1
                    log.exception("kubernetes watch failed: relisting", extra={"fields": {"watch": self.what}})
                    self.resource_version = None
                await asyncio.sleep(delay * random.uniform(0.8, 1.0))
                delay = min(delay * 2, cap)
        finally:
            if first is not None:
                first.release()
