"""Kubernetes discovery: each pool is the pods that a label selector, or an InferencePool, picks.

A pool's pods are listed, then watched (``kube_watch.Reflector``); after the list and after each
change the pool's whole endpoint set is published (``podIP:port`` per target port, draining while
NotReady or terminating). A pool that follows an InferencePool watches that object too and lists
its pods again when the pool's selector or target ports change.

Client library: kubernetes_asyncio. Maintained in step with the official client's releases, on
aiohttp (already ours), it loads kubeconfigs (contexts, client certificates, exec plugins) and
in-cluster service accounts (refreshing the projected token). Its ``Watch`` retries a 410 from the
same resourceVersion and builds a model per object, so the list+watch loop is ours, through its
generated list calls with ``_preload_content=False``. lightkube's watch re-watches without a relist
after a 410 and sends no allowWatchBookmarks; kr8s' re-watches from the expired version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.config.incluster_config import InClusterConfigLoader
from pydantic import ValidationError

from extproc.config import (
    EndpointConfig,
    KubernetesDiscoveryConfig,
    KubernetesPoolConfig,
    KVEventsConfig,
    PodFieldsConfig,
    Role,
    Scheme,
)
from extproc.discovery.base import DiscoveryError, Publish
from extproc.discovery.kube_watch import APIError, Gone, Health, Obj, Reflector, Unreachable
from extproc.tasks import cancel_and_wait

log = logging.getLogger("kvroute.discovery")

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
RBAC_FILE = "deploy/base/rbac.yaml"
_ROLES: dict[str, Role] = {"prefill": "prefill", "decode": "decode", "both": "both"}
_SCHEMES: dict[str, Scheme] = {"http": "http", "https": "https"}


@dataclass(frozen=True)
class Target:
    """Which pods (matchLabels) and which of their ports make a pool's endpoints."""

    selector: tuple[tuple[str, str], ...]
    ports: tuple[int, ...]

    @property
    def label_selector(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.selector)


def pool_target(pool: Obj) -> Target | None:
    """An InferencePool's spec.selector.matchLabels and spec.targetPorts; None when it has neither."""
    spec = pool.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    ports = [p.get("number") if isinstance(p, dict) else None for p in spec.get("targetPorts") or []]
    valid = [p for p in ports if isinstance(p, int) and 0 < p < 65536]
    if not labels or not valid or len(valid) != len(ports):
        return None
    return Target(tuple(sorted((str(k), str(v)) for k, v in labels.items())), tuple(dict.fromkeys(valid)))


class PodMapper:
    """A pod → its endpoints, one per target port; what the pod says is read from ``pod_fields``."""

    def __init__(self, fields: PodFieldsConfig, kv: KVEventsConfig) -> None:
        self._fields, self._kv = fields, kv
        self._warned: set[tuple[str, str]] = set()

    def _warn_once(self, key: tuple[str, str], message: str, **fields: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, extra={"fields": fields})

    def _port(self, value: str | None, field: str, pod: str) -> int | None:
        if value is None:
            return None
        if value.strip().isdigit() and 0 < int(value) < 65536:
            return int(value)
        self._warn_once((field, value), "pod port is not 1..65535: ignored", pod=pod, field=field, value=value)
        return None

    def __call__(self, pod: Obj, ports: Sequence[int]) -> list[EndpointConfig]:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        ip = status.get("podIP")
        if not ip or status.get("phase") in ("Succeeded", "Failed"):  # not started yet, or exited for good
            return []
        labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
        name = f"{meta.get('namespace')}/{meta.get('name')}"

        def get(key: str) -> str | None:
            return labels[key] if key in labels else notes.get(key)

        f = self._fields
        role = _ROLES.get(get(f.role) or "both")
        if role is None:
            self._warn_once(
                ("role", str(get(f.role))),
                "pod role is not prefill, decode or both: serving it as both",
                pod=name,
                value=str(get(f.role)),
            )
            role = "both"
        host = f"[{ip}]" if ":" in ip else ip
        kv_port = self._port(get(f.kv_events_port), f.kv_events_port, name) or self._kv.port
        replay_port = self._port(get(f.kv_replay_port), f.kv_replay_port, name) or self._kv.replay_port
        metrics_port = self._port(get(f.metrics_port), f.metrics_port, name)
        own_port = self._port(get(f.port), f.port, name)
        raw_scheme = get(f.scheme)
        scheme = _SCHEMES.get(raw_scheme or "")
        if raw_scheme is not None and scheme is None:
            self._warn_once(
                (f.scheme, raw_scheme), "pod scheme is not http or https: ignored", pod=name, value=raw_scheme
            )
        if own_port is not None:  # e.g. hostNetwork pods that share a node, each on a port of its own
            ports = (own_port,)
        ready = (
            status.get("phase") == "Running"
            and not meta.get("deletionTimestamp")
            and any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        )
        try:
            return [
                EndpointConfig(
                    address=f"{host}:{port}",
                    role=role,
                    kv_events=f"tcp://{host}:{kv_port}" if kv_port else None,
                    kv_replay=f"tcp://{host}:{replay_port}" if replay_port else None,
                    metrics=f"{host}:{metrics_port}" if metrics_port else None,
                    model=get(f.model),
                    cache_bucket=get(f.cache_bucket),
                    ready=ready,
                    uid=meta.get("uid"),
                    scheme=scheme,
                )
                for port in ports
            ]
        except ValidationError as e:
            self._warn_once(("pod", str(meta.get("uid"))), "pod left out", pod=name, error=str(e))
            return []


@dataclass
class _Shared:
    cfg: KubernetesDiscoveryConfig
    health: Health
    mapper: PodMapper
    core: k8s.CoreV1Api
    custom: k8s.CustomObjectsApi
    publish: Publish


def _explain(e: APIError, what: str, rbac: str) -> str:
    if e.status == 401:
        return f"kubernetes: unauthorized to {e.verb} {what}: the API server rejects the credentials ({e.message})"
    if e.status == 403:
        return (
            f"kubernetes: forbidden to {e.verb} {what} (service account needs get/list/watch on {rbac}; "
            f"see {RBAC_FILE})"
        )
    if e.status == 404 and rbac.startswith(POOL_PLURAL):
        return (
            f"kubernetes: the API server has no {POOL_PLURAL}.{POOL_GROUP}/{POOL_VERSION} "
            f"(is the InferencePool CRD installed?)"
        )
    return f"kubernetes: cannot {e.verb} {what}: HTTP {e.status}: {e.message}"


class _Pool:
    """One kvroute pool: its pods' endpoints by UID, the watches that keep them current, what it published."""

    def __init__(self, pc: KubernetesPoolConfig, namespace: str, shared: _Shared) -> None:
        self.pc, self.namespace, self._s = pc, namespace, shared
        self.target: Target | None = None
        if pc.selector is not None and pc.target_port is not None:
            self.target = Target(tuple(sorted(pc.selector.items())), (pc.target_port,))
        self.published: list[EndpointConfig] | None = None
        self._pods: dict[str, list[EndpointConfig]] = {}
        self._pods_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """List (and open the first watch of) the InferencePool, if any, then the pods."""
        firsts: list[aiohttp.ClientResponse] = []
        try:
            pool_watch = None
            if self.pc.inference_pool is not None:
                pool_watch = self._pool_reflector(self.pc.inference_pool)
                firsts.append(await self._initial(pool_watch, f"{POOL_PLURAL}.{POOL_GROUP}"))
                if self.target is None:
                    raise DiscoveryError(
                        f'kubernetes: no InferencePool "{self.pc.inference_pool}" with a selector and target ports '
                        f'in namespace "{self.namespace}" (pool {self.pc.name})'
                    )
            pods = self._pod_reflector()
            firsts.append(await self._initial(pods, "pods"))
        except BaseException:
            for resp in firsts:
                resp.release()
            raise
        if pool_watch is not None:
            self._spawn(pool_watch.run(firsts[0]))
        self._pods_task = self._spawn(pods.run(firsts[-1]))

    async def _initial(self, r: Reflector, rbac: str) -> aiohttp.ClientResponse:
        """List and open the first watch within about request_timeout_s; what cannot work is a DiscoveryError."""
        cfg, loop = self._s.cfg, asyncio.get_running_loop()
        deadline, delay = loop.time() + cfg.request_timeout_s, cfg.backoff_initial_s
        while True:
            try:
                await r.list(timeout=max(deadline - loop.time(), 0.1))
                return await r.open_watch(timeout=max(deadline - loop.time(), 0.1))
            except Unreachable as e:
                self._s.health.down(e)
                left = deadline - loop.time()
                if left <= 0:
                    raise DiscoveryError(
                        f"kubernetes: API server {self._s.health.server} unreachable for {cfg.request_timeout_s:g} s "
                        f"({e})"
                    ) from e
                await asyncio.sleep(min(delay, left))
                delay *= 2
            except Gone as e:  # compacted between the list and the watch: list again
                r.resource_version = None
                if loop.time() > deadline:
                    raise DiscoveryError(f"kubernetes: cannot watch {r.what}: {e}") from e
            except APIError as e:
                raise DiscoveryError(_explain(e, r.what, rbac)) from e

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=f"kubernetes-discovery-{self.pc.name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def aclose(self) -> None:
        await cancel_and_wait(self._tasks)

    # -- the pods ------------------------------------------------------------------------------
    def _pod_reflector(self) -> Reflector:
        assert self.target is not None
        sel = self.target.label_selector
        fetch = partial(self._s.core.list_namespaced_pod, self.namespace, label_selector=sel)
        return Reflector("pods", self.namespace, sel, fetch, self._s.cfg, self._s.health, self._listed, self._changed)

    def _listed(self, pods: list[Obj]) -> None:
        self._pods = dict(self._endpoints(pod) for pod in pods)
        self._publish()

    def _changed(self, kind: str, pod: Obj) -> None:
        uid, endpoints = self._endpoints(pod)
        if kind == "DELETED":
            self._pods.pop(uid, None)
        else:
            self._pods[uid] = endpoints
        self._publish()

    def _endpoints(self, pod: Obj) -> tuple[str, list[EndpointConfig]]:
        meta = pod.get("metadata") or {}
        assert self.target is not None
        return meta.get("uid") or meta.get("name") or "", self._s.mapper(pod, self.target.ports)

    def _publish(self) -> None:
        """Publish the pool when its endpoints changed. Two pods on one address (an IP reused while the old
        pod terminates): the ready one wins."""
        by_address: dict[str, EndpointConfig] = {}
        for eps in self._pods.values():
            for ec in eps:
                if ec.address not in by_address or (ec.ready and not by_address[ec.address].ready):
                    by_address[ec.address] = ec
        endpoints = [by_address[a] for a in sorted(by_address)]
        if endpoints == self.published:
            return
        self.published = endpoints
        self._s.publish(self.pc.name, endpoints)
        ready = sum(ec.ready for ec in endpoints)
        log.info(
            "kubernetes pool endpoints",
            extra={
                "fields": {
                    "pool": self.pc.name,
                    "endpoints": len(endpoints),
                    "ready": ready,
                    "draining": len(endpoints) - ready,
                }
            },
        )

    # -- the InferencePool ---------------------------------------------------------------------
    def _pool_reflector(self, name: str) -> Reflector:
        fetch = partial(
            self._s.custom.list_namespaced_custom_object,
            POOL_GROUP,
            POOL_VERSION,
            self.namespace,
            POOL_PLURAL,
            field_selector=f"metadata.name={name}",
        )
        return Reflector(
            f"{POOL_PLURAL}.{POOL_GROUP}",
            self.namespace,
            name,
            fetch,
            self._s.cfg,
            self._s.health,
            lambda pools: self._pool_spec(pools[0] if pools else None),
            lambda kind, pool: self._pool_spec(None if kind == "DELETED" else pool),
        )

    def _pool_spec(self, pool: Obj | None) -> None:
        """Follow the InferencePool: a new selector or new ports list the pods again under it."""
        fields = {"pool": self.pc.name, "inference_pool": self.pc.inference_pool, "namespace": self.namespace}
        target = pool_target(pool) if pool is not None else None
        if target is None:
            if self._pods_task is not None:  # at start, start() says it; later, keep what we have
                why = "deleted" if pool is None else "without a selector or target ports"
                log.warning(f"InferencePool {why}: keeping its last pods", extra={"fields": fields})
            return
        if target == self.target:
            return
        self.target = target
        if self._pods_task is None:
            return
        log.info(
            "InferencePool changed: listing its pods again",
            extra={"fields": {**fields, "selector": target.label_selector, "ports": list(target.ports)}},
        )
        self._pods_task.cancel()
        self._pods_task = self._spawn(self._pod_reflector().run())


class KubernetesProvider:
    name = "kubernetes"

    def __init__(
        self, cfg: KubernetesDiscoveryConfig, kv: KVEventsConfig, service_account_dir: Path = SERVICE_ACCOUNT_DIR
    ) -> None:
        self._cfg, self._kv, self._sa = cfg, kv, service_account_dir
        self._api: k8s.ApiClient | None = None
        self._health: Health | None = None
        self._pools: list[_Pool] = []

    async def _client(self) -> tuple[k8s.ApiClient, str | None]:
        """The API client, from the in-cluster service account or a kubeconfig, and its namespace."""
        conf = k8s.Configuration()
        token = self._sa / "token"
        if self._cfg.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST") and token.is_file():
            source = f"in-cluster service account ({self._sa})"
            try:
                loader = InClusterConfigLoader(token_filename=str(token), cert_filename=str(self._sa / "ca.crt"))
                loader.load_and_set(conf)
                ns_file = self._sa / "namespace"
                namespace = ns_file.read_text().strip() if ns_file.is_file() else None
            except (k8s_config.ConfigException, OSError) as e:
                raise DiscoveryError(f"kubernetes: {source}: {e}") from e
        else:
            explicit = self._cfg.kubeconfig
            path = str(explicit.expanduser() if explicit else os.environ.get("KUBECONFIG") or "~/.kube/config")
            path = os.pathsep.join(os.path.expanduser(p) for p in path.split(os.pathsep))
            source = f"kubeconfig {path}"
            if not any(Path(p).is_file() for p in path.split(os.pathsep) if p):
                where = "" if explicit else f", and not in a cluster (KUBERNETES_SERVICE_HOST unset or no {token})"
                raise DiscoveryError(f"kubernetes: no kubeconfig at {path}{where}")
            try:
                kube = await k8s_config.load_kube_config(
                    config_file=path, context=self._cfg.context, client_configuration=conf, persist_config=False
                )
                namespace = ((kube.current_context or {}).get("context") or {}).get("namespace")
            except Exception as e:  # the loader raises ConfigException, KeyError, yaml errors...
                raise DiscoveryError(f"kubernetes: cannot use {source}: {type(e).__name__}: {e}") from e
        log.info("kubernetes API", extra={"fields": {"server": conf.host, "config": source}})
        api = k8s.ApiClient(conf)
        api.user_agent = "kvroute"
        return api, namespace

    async def start(self, publish: Publish) -> None:
        self._api, namespace = await self._client()
        self._health = Health(str(self._api.configuration.host))
        shared = _Shared(
            self._cfg,
            self._health,
            PodMapper(self._cfg.pod_fields, self._kv),
            k8s.CoreV1Api(self._api),
            k8s.CustomObjectsApi(self._api),
            publish,
        )
        default_ns = self._cfg.namespace or namespace or "default"
        self._pools = [_Pool(pc, pc.namespace or default_ns, shared) for pc in self._cfg.pools]
        try:
            for pool in self._pools:
                await pool.start()
        except BaseException:
            await self.aclose()
            raise
        log.info(
            "kubernetes discovery started",
            extra={"fields": {"pools": {p.pc.name: len(p.published or ()) for p in self._pools}}},
        )

    async def aclose(self) -> None:
        for pool in self._pools:
            await pool.aclose()
        if self._api is not None:
            with contextlib.suppress(Exception):
                await self._api.close()
            self._api = None

    def stats(self) -> dict[str, float]:
        h = self._health
        if h is None:
            return {}
        out = {k: float(v) for k, v in h.counts.items()}
        out["api_reachable"] = float(h.reachable)
        out["endpoints"] = float(sum(len(p.published or ()) for p in self._pools))
        return out
