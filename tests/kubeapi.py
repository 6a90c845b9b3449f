"""A loopback stand-in for the Kubernetes API server: pods and InferencePools, get, list and watch.

It speaks the real wire format (PodList / InferencePoolList with metadata.resourceVersion, chunked
newline-delimited watch events with BOOKMARK and ERROR 410, Status objects on 401/403/404), so a real
client library talks to it, and it breaks the ways a real one does: expired history, dropped watches,
RBAC denials, outages. One resourceVersion counter across all objects, like etcd.

    async with KubeAPI() as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig", namespace="llm")
        api.add_pod("llm", "vllm-0", "10.0.0.1", {"app": "vllm"})
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import ssl
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

Obj = dict[str, Any]
_TRUE = {"1", "t", "T", "true", "True", "TRUE"}


@dataclass(frozen=True)
class _Kind:
    resource: str
    group: str  # "" for the core API
    version: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


PODS = _Kind("pods", "", "v1", "Pod")
POOLS = _Kind("inferencepools", "inference.networking.k8s.io", "v1", "InferencePool")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _selector(text: str | None) -> list[tuple[str, bool, str]]:
    """Equality-based selector ``a=b,c==d,e!=f`` → [(key, equal, value)]."""
    terms = []
    for part in filter(None, (text or "").split(",")):
        key, sep, value = part.partition("!=")
        if not sep:
            key, sep, value = part.replace("==", "=").partition("=")
        if not sep or not key.strip():
            raise ValueError(f"unable to parse requirement: {part!r}")
        terms.append((key.strip(), sep == "=", value.strip()))
    return terms


@dataclass(eq=False)
class _Watch:
    kind: _Kind
    namespace: str
    labels: list[tuple[str, bool, str]]
    fields: list[tuple[str, bool, str]]
    bookmarks: bool
    queue: asyncio.Queue[Obj | None] = field(default_factory=asyncio.Queue)  # None: drop the connection

    def matches(self, obj: Obj | None) -> bool:
        if obj is None or obj["metadata"]["namespace"] != self.namespace:
            return False
        meta = obj["metadata"]
        labels = meta.get("labels") or {}
        fields = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"]}
        return all((labels.get(k) == v) == eq for k, eq, v in self.labels) and all(
            (fields.get(k) == v) == eq for k, eq, v in self.fields
        )

    def event(self, change: _Change) -> Obj | None:
        """What this watch sees of a change: an object leaving the selector is DELETED for it."""
        if change.kind != self.kind:
            return None
        was, now = self.matches(change.before), self.matches(change.after)
        if now:
            return {"type": "MODIFIED" if was else "ADDED", "object": change.after}
        if was:
            assert change.before is not None
            gone = copy.deepcopy(change.before)
            gone["metadata"]["resourceVersion"] = str(change.rv)
            return {"type": "DELETED", "object": gone}
        return None


@dataclass
class _Change:
    rv: int
    kind: _Kind
    before: Obj | None
    after: Obj | None


class KubeAPI:
    """The API server. Mutations commit at once and reach open watches; controls break it on purpose."""

    def __init__(self, token: str | None = "kubeapi-test-token", tls: Path | None = None) -> None:
        """tls: a directory from ``tests.certs.make_certs(d, {"kubeapi": "IP:127.0.0.1"})``: https."""
        self.token = token
        self.tls = tls
        self.port = 0
        self.watch_log: list[dict[str, str]] = []  # each watch request's query, plus "resource"
        self._rv = 0
        self._oldest = 0  # watches from an older resourceVersion get 410 (expire_history)
        self._objects: dict[tuple[str, str, str], Obj] = {}
        self._history: list[_Change] = []
        self._watches: set[_Watch] = set()
        self._forbidden: dict[str, set[str]] = {}
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._watch_opened = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    async def __aenter__(self) -> KubeAPI:
        app = web.Application(middlewares=[self._gate])
        for kind, prefix in ((PODS, "/api/v1"), (POOLS, "/apis/inference.networking.k8s.io/v1")):
            app.router.add_get(f"{prefix}/namespaces/{{ns}}/{kind.resource}", partial(self._serve, kind))
            app.router.add_get(f"{prefix}/namespaces/{{ns}}/{kind.resource}/{{name}}", partial(self._serve, kind))
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await self._listen()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.resume()
        self.drop_watches()
        assert self._runner is not None
        await self._runner.cleanup()

    async def _listen(self) -> None:
        assert self._runner is not None
        ctx = None
        if self.tls:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(self.tls / "kubeapi.crt", self.tls / "kubeapi.key")
        self._site = web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=ctx)
        await self._site.start()
        self.port = self._runner.addresses[0][1]

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: Path, namespace: str | None = "default", token: str | None = None) -> Path:
        cluster: Obj = {"server": self.url}
        if self.tls:
            cluster["certificate-authority"] = str(self.tls / "ca.crt")
        context: Obj = {"cluster": "kubeapi", "user": "kubeapi"}
        if namespace:
            context["namespace"] = namespace
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kubeapi", "cluster": cluster}],
            "users": [{"name": "kubeapi", "user": {"token": token or self.token or "none"}}],
            "contexts": [{"name": "kubeapi", "context": context}],
            "current-context": "kubeapi",
        }
        path.write_text(yaml.safe_dump(doc))
        return path

    def write_service_account(self, directory: Path, namespace: str) -> dict[str, str]:
        """An in-cluster service-account dir (token, ca.crt, namespace); returns the env a pod would get."""
        assert self.tls, "in-cluster config is https only: KubeAPI(tls=make_certs(...))"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "token").write_text(self.token or "none")
        (directory / "ca.crt").write_text((self.tls / "ca.crt").read_text())
        (directory / "namespace").write_text(namespace)
        return {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(self.port)}

    # -- objects -------------------------------------------------------------------------------
    def add_pod(
        self,
        ns: str,
        name: str,
        ip: str | None,
        labels: dict[str, str],
        annotations: dict[str, str] | None = None,
        ready: bool = True,
        phase: str = "Running",
    ) -> Obj:
        status: Obj = {"phase": phase, "conditions": [], "startTime": _now()}
        if ip:
            status["podIP"], status["podIPs"] = ip, [{"ip": ip}]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": ns,
                "uid": str(uuid.uuid4()),
                "creationTimestamp": _now(),
                "labels": dict(labels),
                "annotations": dict(annotations or {}),
            },
            "spec": {
                "containers": [
                    {
                        "name": "vllm",
                        "image": "vllm/vllm-openai:latest",
                        "ports": [{"containerPort": 8000, "protocol": "TCP"}],
                    }
                ]
            },
            "status": status,
        }
        _set_ready(pod, ready)
        return self._commit(PODS, ns, name, pod)

    def set_ready(self, ns: str, name: str, ready: bool) -> Obj:
        return self._update(PODS, ns, name, lambda pod: _set_ready(pod, ready))

    def terminate(self, ns: str, name: str) -> Obj:
        """What `kubectl delete` does first: the pod stays, with a deletionTimestamp, until it exits."""

        def mark(pod: Obj) -> None:
            pod["metadata"]["deletionTimestamp"] = _now()
            pod["metadata"]["deletionGracePeriodSeconds"] = 30

        return self._update(PODS, ns, name, mark)

    def delete_pod(self, ns: str, name: str) -> None:
        self._commit(PODS, ns, name, None)

    def replace_pod(self, ns: str, name: str, ip: str, ready: bool = True) -> Obj:
        """A StatefulSet pod rebuilt: same name and labels, a new UID and IP."""
        old = self._objects[(PODS.resource, ns, name)]["metadata"]
        self.delete_pod(ns, name)
        return self.add_pod(ns, name, ip, old.get("labels") or {}, old.get("annotations"), ready=ready)

    def put_inference_pool(self, ns: str, name: str, selector: dict[str, str], ports: Iterable[int]) -> Obj:
        old = self._objects.get((POOLS.resource, ns, name))
        meta = old["metadata"] if old else {"uid": str(uuid.uuid4()), "creationTimestamp": _now(), "generation": 0}
        pool = {
            "apiVersion": POOLS.api_version,
            "kind": POOLS.kind,
            "metadata": {**meta, "name": name, "namespace": ns, "generation": meta["generation"] + 1},
            "spec": {
                "selector": {"matchLabels": dict(selector)},
                "targetPorts": [{"number": p} for p in ports],
                "endpointPickerRef": {"name": "kvroute", "port": {"number": 9002}},
            },
        }
        return self._commit(POOLS, ns, name, pool)

    def delete_inference_pool(self, ns: str, name: str) -> None:
        self._commit(POOLS, ns, name, None)

    def _update(self, kind: _Kind, ns: str, name: str, change: Any) -> Obj:
        obj = copy.deepcopy(self._objects[(kind.resource, ns, name)])
        change(obj)
        return self._commit(kind, ns, name, obj)

    def _commit(self, kind: _Kind, ns: str, name: str, after: Obj | None) -> Obj:
        self._rv += 1
        key = (kind.resource, ns, name)
        before = self._objects.pop(key, None)
        if after is not None:
            after = copy.deepcopy(after)
            after["metadata"]["resourceVersion"] = str(self._rv)
            self._objects[key] = after
        change = _Change(self._rv, kind, before, after)
        self._history.append(change)
        for w in self._watches:
            if (ev := w.event(change)) is not None:
                w.queue.put_nowait(ev)
        return copy.deepcopy(after or before or {})

    # -- controls ------------------------------------------------------------------------------
    def bookmark(self) -> int:
        """Send every watch that allows bookmarks a BOOKMARK at a new resourceVersion; returns it."""
        self._rv += 1
        for w in self._watches:
            if w.bookmarks:
                meta = {"resourceVersion": str(self._rv)}
                w.queue.put_nowait(
                    {
                        "type": "BOOKMARK",
                        "object": {"kind": w.kind.kind, "apiVersion": w.kind.api_version, "metadata": meta},
                    }
                )
        return self._rv

    def expire_history(self) -> None:
        """Compaction: watches in flight get ERROR 410, and so does any watch from an older version."""
        self._oldest = self._rv
        self._history.clear()
        for w in self._watches:
            w.queue.put_nowait(self._too_old(0))

    def drop_watches(self) -> int:
        """Close every open watch connection abruptly (no chunked terminator); returns how many."""
        for w in self._watches:
            w.queue.put_nowait(None)
        return len(self._watches)

    def forbid(self, resource: str, verbs: Iterable[str] = ("get", "list", "watch")) -> None:
        self._forbidden[resource] = set(verbs)

    def allow(self, resource: str) -> None:
        self._forbidden.pop(resource, None)

    async def pause(self, hang: bool = False) -> None:
        """API unreachable. hang=False: connections refused, open ones reset. hang=True: connections are
        accepted and requests never answered, open watches go silent (a dead network path)."""
        self._resumed.clear()
        if not hang:
            assert self._site is not None and self._runner is not None and self._runner.server is not None
            await self._site.stop()
            for conn in list(self._runner.server.connections):
                if conn.transport is not None:
                    conn.transport.abort()

    async def resume(self) -> None:
        """Back: requests are answered, and after a pause without hang the port listens again."""
        self._resumed.set()
        assert self._runner is not None
        if self._site not in self._runner.sites:
            await self._listen()

    @property
    def open_watches(self) -> int:
        return len(self._watches)

    async def watch_opened(self, index: int, timeout: float = 5.0, **query: str) -> dict[str, str]:
        """The first watch request at or after position ``index`` of watch_log whose query has ``query``
        (resource="pods" unless given)."""
        want = {"resource": "pods", **query}
        async with asyncio.timeout(timeout):
            while True:
                for q in self.watch_log[index:]:
                    if want.items() <= q.items():
                        return q
                self._watch_opened.clear()
                await self._watch_opened.wait()

    # -- serving -------------------------------------------------------------------------------
    @web.middleware
    async def _gate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        await self._resumed.wait()
        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(_status(401, "Unauthorized", "Unauthorized"), status=401)
        return await handler(request)

    async def _serve(self, kind: _Kind, request: web.Request) -> web.StreamResponse:
        ns, name, q = request.match_info["ns"], request.match_info.get("name"), request.query
        watch = q.get("watch") in _TRUE
        verb = "get" if name else "watch" if watch else "list"
        if verb in self._forbidden.get(kind.resource, ()):
            res = f"{kind.resource}.{kind.group}" if kind.group else kind.resource
            msg = (
                f'{res}{" " + repr(name) if name else ""} is forbidden: User "system:serviceaccount:{ns}:kvroute" '
                f'cannot {verb} resource "{kind.resource}" in API group "{kind.group}" in the namespace "{ns}"'
            )
            return web.json_response(_status(403, "Forbidden", msg), status=403)
        if name:
            obj = self._objects.get((kind.resource, ns, name))
            if obj is None:
                return web.json_response(_status(404, "NotFound", f'{kind.resource} "{name}" not found'), status=404)
            return web.json_response(obj)
        try:
            w = _Watch(
                kind,
                ns,
                _selector(q.get("labelSelector")),
                _selector(q.get("fieldSelector")),
                q.get("allowWatchBookmarks") in _TRUE,
            )
        except ValueError as e:
            return web.json_response(_status(400, "BadRequest", str(e)), status=400)
        if watch:
            return await self._watch(request, w)
        items = [o for o in self._current(kind) if w.matches(o)]
        return web.json_response(
            {
                "kind": f"{kind.kind}List",
                "apiVersion": kind.api_version,
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }
        )

    def _current(self, kind: _Kind) -> list[Obj]:
        objs = [o for (res, _, _), o in self._objects.items() if res == kind.resource]
        return sorted(objs, key=lambda o: int(o["metadata"]["resourceVersion"]))

    def _too_old(self, rv: int) -> Obj:
        return {"type": "ERROR", "object": _status(410, "Expired", f"too old resource version: {rv} ({self._oldest})")}

    async def _watch(self, request: web.Request, w: _Watch) -> web.StreamResponse:
        q = request.query
        self.watch_log.append({"resource": w.kind.resource, **q})
        self._watch_opened.set()
        rv = int(q.get("resourceVersion") or 0)
        if rv and rv < self._oldest:
            backlog = [self._too_old(rv)]
        elif rv:  # resume: the changes since rv
            backlog = [ev for c in self._history if c.rv > rv and (ev := w.event(c)) is not None]
        else:  # from now, starting with the current objects as ADDED (what an unversioned watch gets)
            backlog = [{"type": "ADDED", "object": o} for o in self._current(w.kind) if w.matches(o)]
        for ev in backlog:
            w.queue.put_nowait(ev)
        self._watches.add(w)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        loop = asyncio.get_running_loop()
        deadline = (loop.time() + float(q["timeoutSeconds"])) if "timeoutSeconds" in q else None
        try:
            await resp.prepare(request)
            while True:
                try:
                    ev = await asyncio.wait_for(w.queue.get(), None if deadline is None else deadline - loop.time())
                except TimeoutError:
                    ev = {"type": "END"}
                await self._resumed.wait()  # paused with hang: silent, not even the end of the watch
                if ev is None:
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                if ev["type"] == "END":
                    break
                await resp.write(json.dumps(ev).encode() + b"\n")
                if ev["type"] == "ERROR":
                    break
            with contextlib.suppress(ConnectionError):
                await resp.write_eof()
        except ConnectionError:  # the client went away
            pass
        finally:
            self._watches.discard(w)
        return resp


def _set_ready(pod: Obj, ready: bool) -> None:
    flag = "True" if ready else "False"
    pod["status"]["conditions"] = [
        {"type": t, "status": "True" if t in ("PodScheduled", "Initialized") else flag, "lastTransitionTime": _now()}
        for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
    ]
