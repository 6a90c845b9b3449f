"""Kubernetes discovery through the real client library against a loopback API server (tests/kubeapi.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from extproc.config import EndpointConfig, KubernetesDiscoveryConfig, KVEventsConfig
from extproc.discovery.base import DiscoveryError
from extproc.discovery.kubernetes import KubernetesProvider
from tests.certs import make_certs
from tests.kubeapi import KubeAPI

NS = "llm"
SEL = {"app": "vllm"}
POOL = {"name": "llama", "selector": SEL, "target_port": 8000}


class Recorder:
    """The publish callback: each pool's last set, and a way to wait for a condition on them."""

    def __init__(self) -> None:
        self.pools: dict[str, list[EndpointConfig]] = {}
        self.count = 0
        self._event = asyncio.Event()

    def __call__(self, pool: str, endpoints: Sequence[EndpointConfig]) -> None:
        self.pools[pool] = list(endpoints)
        self.count += 1
        self._event.set()

    def ready(self, pool: str = "llama") -> dict[str, bool]:
        """address → ready, as last published."""
        return {ec.address: ec.ready for ec in self.pools.get(pool, [])}

    async def until(self, pred: Callable[[], bool], timeout: float = 1.0) -> None:
        """Wait for a publish that makes ``pred`` true (1 s: how soon a change must reach the registry)."""
        async with asyncio.timeout(timeout):
            while not pred():
                self._event.clear()
                await self._event.wait()


async def until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.01)


@pytest.fixture
async def api() -> AsyncIterator[KubeAPI]:
    async with KubeAPI() as a:
        yield a


@pytest.fixture
def kubeconfig(api: KubeAPI, tmp_path: Path) -> Path:
    return api.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)


def k8s_config(
    kubeconfig: Path | None, pools: list[dict[str, Any]] | None = None, **kw: Any
) -> KubernetesDiscoveryConfig:
    opts: dict[str, Any] = {"backoff_initial_s": 0.05, "backoff_max_s": 0.2, "request_timeout_s": 1.0, **kw}
    return KubernetesDiscoveryConfig(kubeconfig=kubeconfig, pools=pools or [POOL], **opts)


@contextlib.asynccontextmanager
async def running(
    cfg: KubernetesDiscoveryConfig, kv: KVEventsConfig | None = None, **kw: Any
) -> AsyncIterator[tuple[KubernetesProvider, Recorder]]:
    rec = Recorder()
    provider = KubernetesProvider(cfg, kv or KVEventsConfig(), **kw)
    await provider.start(rec)
    try:
        yield provider, rec
    finally:
        await provider.aclose()


def _no_discovery_tasks() -> bool:
    return not [t for t in asyncio.all_tasks() if t.get_name().startswith("kubernetes-discovery")]


async def test_initial_list_maps_pods(api: KubeAPI, kubeconfig: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvroute.discovery")
    d0 = api.add_pod(
        NS,
        "decode-0",
        "10.0.0.1",
        {**SEL, "llm-d.ai/role": "decode", "cache-bucket": "b1"},
        {
            "kvroute.io/model": "meta-llama/Llama-3.1-8B-Instruct",
            "kvroute.io/kv-events-port": "6000",
            "kvroute.io/kv-replay-port": "6001",
            "kvroute.io/metrics-port": "9100",
        },
    )
    api.add_pod(NS, "prefill-0", "10.0.0.2", {**SEL, "llm-d.ai/role": "prefill"}, ready=False)
    api.add_pod(NS, "pending", None, SEL, ready=False, phase="Pending")
    api.add_pod(NS, "evicted", "10.0.0.3", SEL, ready=False, phase="Failed")
    api.add_pod(NS, "v6", "fd00::7", {**SEL, "llm-d.ai/role": "sidecar"})
    api.add_pod(NS, "other-app", "10.0.0.9", {"app": "other"})
    api.add_pod("elsewhere", "same-labels", "10.0.0.10", SEL)  # the kubeconfig's namespace is llm

    async with running(k8s_config(kubeconfig), KVEventsConfig(port=5557, replay_port=None)) as (provider, rec):
        eps = {ec.address: ec for ec in rec.pools["llama"]}
        assert list(eps) == ["10.0.0.1:8000", "10.0.0.2:8000", "[fd00::7]:8000"]
        assert eps["10.0.0.1:8000"] == EndpointConfig(
            address="10.0.0.1:8000",
            role="decode",
            kv_events="tcp://10.0.0.1:6000",
            kv_replay="tcp://10.0.0.1:6001",
            metrics="10.0.0.1:9100",
            model="meta-llama/Llama-3.1-8B-Instruct",
            cache_bucket="b1",
            ready=True,
            uid=d0["metadata"]["uid"],
        )
        p0 = eps["10.0.0.2:8000"]
        assert (p0.role, p0.ready, p0.kv_events, p0.kv_replay, p0.metrics) == (
            "prefill",
            False,
            "tcp://10.0.0.2:5557",
            None,
            None,
        )
        v6 = eps["[fd00::7]:8000"]
        assert (v6.role, v6.kv_events, v6.model, v6.cache_bucket) == ("both", "tcp://[fd00::7]:5557", None, None)
        stats = provider.stats()
        assert (stats["api_reachable"], stats["endpoints"], stats["relists"], stats["errors"]) == (1, 3, 0, 0)

        api.set_ready(NS, "v6", False)  # the same unknown role again: warned once
        await rec.until(lambda: rec.ready()["[fd00::7]:8000"] is False)
        assert [r.getMessage() for r in caplog.records].count(
            "pod role is not prefill, decode or both: serving it as both"
        ) == 1


async def test_watch_follows_pod_lifecycle(api: KubeAPI, kubeconfig: Path) -> None:
    a = api.add_pod(NS, "a", "10.0.0.1", SEL)
    async with running(k8s_config(kubeconfig)) as (provider, rec):
        assert rec.ready() == {"10.0.0.1:8000": True}
        api.add_pod(NS, "b", "10.0.0.2", SEL)
        await rec.until(lambda: rec.ready() == {"10.0.0.1:8000": True, "10.0.0.2:8000": True})
        api.set_ready(NS, "b", False)  # NotReady: drained, not dropped
        await rec.until(lambda: rec.ready() == {"10.0.0.1:8000": True, "10.0.0.2:8000": False})
        api.set_ready(NS, "b", True)
        await rec.until(lambda: rec.ready()["10.0.0.2:8000"])
        api.terminate(NS, "b")  # Terminating: drained while in-flight requests finish
        await rec.until(lambda: rec.ready() == {"10.0.0.1:8000": True, "10.0.0.2:8000": False})
        api.delete_pod(NS, "b")
        await rec.until(lambda: rec.ready() == {"10.0.0.1:8000": True})

        new = api.replace_pod(NS, "a", "10.0.0.3")  # same name, new UID and IP
        await rec.until(lambda: rec.ready() == {"10.0.0.3:8000": True})
        assert rec.pools["llama"][0].uid == new["metadata"]["uid"] != a["metadata"]["uid"]

        api.add_pod(NS, "not-ours", "10.0.0.4", {"app": "other"})
        api.add_pod(NS, "c", "10.0.0.5", SEL)  # events arrive in order: when c is there, not-ours was seen
        await rec.until(lambda: "10.0.0.5:8000" in rec.ready())
        assert "10.0.0.4:8000" not in rec.ready()
        stats = provider.stats()
        assert stats["relists"] == stats["errors"] == 0 and stats["events"] >= 8
    await until(lambda: api.open_watches == 0)
    assert _no_discovery_tasks()


async def test_bookmark_advances_resource_version(api: KubeAPI, kubeconfig: Path) -> None:
    async with running(k8s_config(kubeconfig)) as (provider, _rec):
        first = await api.watch_opened(0)
        assert first["allowWatchBookmarks"] in ("true", "True", "1") and first["timeoutSeconds"] == "60"
        n = len(api.watch_log)
        rv = api.bookmark()
        assert int(first["resourceVersion"]) < rv
        await until(lambda: provider.stats()["bookmarks"] == 1)
        api.drop_watches()
        assert (await api.watch_opened(n))["resourceVersion"] == str(rv)


async def test_dropped_watch_resumes_without_losing_events(api: KubeAPI, kubeconfig: Path) -> None:
    api.add_pod(NS, "a", "10.0.0.1", SEL)
    async with running(k8s_config(kubeconfig)) as (provider, rec):
        rv = (await api.watch_opened(0))["resourceVersion"]
        n = len(api.watch_log)
        api.drop_watches()
        api.add_pod(NS, "b", "10.0.0.2", SEL)  # sent on the dropped connection (lost there), replayed on resume
        await rec.until(lambda: "10.0.0.2:8000" in rec.ready())
        assert (await api.watch_opened(n))["resourceVersion"] == rv
        stats = provider.stats()
        assert stats["relists"] == 0 and stats["watch_restarts"] >= 1


async def test_expired_history_relists(api: KubeAPI, kubeconfig: Path) -> None:
    api.add_pod(NS, "a", "10.0.0.1", SEL)
    api.add_pod(NS, "b", "10.0.0.2", SEL)
    async with running(k8s_config(kubeconfig)) as (provider, rec):
        api.expire_history()  # the open watch gets ERROR 410
        await until(lambda: provider.stats()["relists"] == 1)
        api.add_pod(NS, "c", "10.0.0.3", SEL)
        await rec.until(lambda: "10.0.0.3:8000" in rec.ready())

        await api.pause()  # the watch is down while a pod goes and the history is compacted
        api.delete_pod(NS, "a")
        api.expire_history()
        await api.resume()  # the rewatch from the old version gets 410: the relist's truth is published
        await rec.until(lambda: rec.ready() == {"10.0.0.2:8000": True, "10.0.0.3:8000": True}, timeout=3.0)
        assert provider.stats()["relists"] == 2


async def test_api_outage_keeps_endpoints(api: KubeAPI, kubeconfig: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvroute.discovery")
    api.add_pod(NS, "a", "10.0.0.1", SEL)
    async with running(k8s_config(kubeconfig)) as (provider, rec):
        published = rec.count
        await api.pause()
        await until(lambda: provider.stats()["api_reachable"] == 0 and provider.stats()["errors"] >= 3)
        assert rec.count == published and rec.ready() == {"10.0.0.1:8000": True}
        messages = [r.getMessage() for r in caplog.records]
        assert messages.count("kubernetes API server unreachable: keeping the last endpoints") == 1

        await api.resume()
        api.add_pod(NS, "b", "10.0.0.2", SEL)
        await rec.until(lambda: "10.0.0.2:8000" in rec.ready(), timeout=3.0)
        assert provider.stats()["api_reachable"] == 1
        assert [r.getMessage() for r in caplog.records].count("kubernetes API server reachable again") == 1


async def test_silent_watch_is_noticed(api: KubeAPI, kubeconfig: Path) -> None:
    api.add_pod(NS, "a", "10.0.0.1", SEL)
    cfg = k8s_config(kubeconfig, watch_timeout_s=1, request_timeout_s=0.5)
    async with running(cfg) as (provider, rec):
        # the server ends each watch after timeoutSeconds: watched again from where it was, no error
        await until(lambda: provider.stats()["watch_restarts"] >= 1)
        assert provider.stats()["errors"] == provider.stats()["relists"] == 0
        await api.pause(hang=True)  # connections stay open and say nothing
        await until(lambda: provider.stats()["api_reachable"] == 0)
        await api.resume()
        api.add_pod(NS, "b", "10.0.0.2", SEL)
        await rec.until(lambda: "10.0.0.2:8000" in rec.ready(), timeout=3.0)
        assert rec.ready() == {"10.0.0.1:8000": True, "10.0.0.2:8000": True}


@pytest.mark.parametrize(
    ("resource", "verbs", "pool", "message"),
    [
        (
            "pods",
            ["list"],
            POOL,
            'kubernetes: forbidden to list pods in namespace "llm" (service account needs get/list/watch on pods; '
            "see deploy/base/rbac.yaml)",
        ),
        ("pods", ["watch"], POOL, 'kubernetes: forbidden to watch pods in namespace "llm"'),
        (
            "inferencepools",
            ["list"],
            {"name": "llama", "inference_pool": "llama"},
            'kubernetes: forbidden to list inferencepools.inference.networking.k8s.io in namespace "llm" '
            "(service account needs get/list/watch on inferencepools.inference.networking.k8s.io",
        ),
    ],
)
async def test_forbidden_at_start(
    api: KubeAPI, kubeconfig: Path, resource: str, verbs: list[str], pool: dict[str, Any], message: str
) -> None:
    api.put_inference_pool(NS, "llama", SEL, [8000])
    api.forbid(resource, verbs)
    with pytest.raises(DiscoveryError, match=re.escape(message)):
        await KubernetesProvider(k8s_config(kubeconfig, [pool]), KVEventsConfig()).start(Recorder())
    assert _no_discovery_tasks()


async def test_bad_token_and_missing_pool_at_start(api: KubeAPI, tmp_path: Path) -> None:
    bad = api.write_kubeconfig(tmp_path / "bad", namespace=NS, token="wrong")
    with pytest.raises(DiscoveryError, match='unauthorized to list pods in namespace "llm"'):
        await KubernetesProvider(k8s_config(bad), KVEventsConfig()).start(Recorder())
    good = api.write_kubeconfig(tmp_path / "good", namespace=NS)
    cfg = k8s_config(good, [{"name": "llama", "inference_pool": "nope"}])
    with pytest.raises(DiscoveryError, match=r'no InferencePool "nope" .*in namespace "llm"'):
        await KubernetesProvider(cfg, KVEventsConfig()).start(Recorder())


async def test_unreachable_at_start(api: KubeAPI, kubeconfig: Path) -> None:
    await api.pause()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(DiscoveryError, match=f"API server {re.escape(api.url)} unreachable for 0.5 s"):
        await KubernetesProvider(k8s_config(kubeconfig, request_timeout_s=0.5), KVEventsConfig()).start(Recorder())
    assert loop.time() - started < 1.5


async def test_no_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(DiscoveryError, match=r"no kubeconfig at .*/\.kube/config, and not in a cluster"):
        await KubernetesProvider(k8s_config(None), KVEventsConfig()).start(Recorder())


async def test_inference_pool_is_followed(api: KubeAPI, kubeconfig: Path, caplog: pytest.LogCaptureFixture) -> None:
    api.put_inference_pool(NS, "llama-pool", {"app": "a"}, [8000])
    api.add_pod(NS, "a0", "10.0.0.1", {"app": "a"})
    api.add_pod(NS, "b0", "10.0.0.2", {"app": "b"})
    cfg = k8s_config(kubeconfig, [{"name": "llama", "inference_pool": "llama-pool"}])
    async with running(cfg) as (provider, rec):
        assert rec.ready() == {"10.0.0.1:8000": True}
        api.put_inference_pool(NS, "llama-pool", {"app": "a"}, [8000, 8001])  # one endpoint per (pod, port)
        await rec.until(lambda: rec.ready() == {"10.0.0.1:8000": True, "10.0.0.1:8001": True})
        n = len(api.watch_log)
        api.put_inference_pool(NS, "llama-pool", {"app": "b"}, [8000])
        await rec.until(lambda: rec.ready() == {"10.0.0.2:8000": True})
        await api.watch_opened(n, labelSelector="app=b")  # the pods' watch follows the new selector

        api.add_pod(NS, "a1", "10.0.0.3", {"app": "a"})
        api.add_pod(NS, "b1", "10.0.0.4", {"app": "b"})
        await rec.until(lambda: rec.ready() == {"10.0.0.2:8000": True, "10.0.0.4:8000": True})

        published, events = rec.count, provider.stats()["events"]
        api.delete_inference_pool(NS, "llama-pool")  # kept: the last selector's pods go on being followed
        await until(lambda: provider.stats()["events"] == events + 1)
        assert rec.count == published
        assert "InferencePool deleted: keeping its last pods" in caplog.messages
        api.delete_pod(NS, "b0")
        await rec.until(lambda: rec.ready() == {"10.0.0.4:8000": True})


async def test_several_pools(api: KubeAPI, kubeconfig: Path) -> None:
    pools = [
        {"name": "prefill", "selector": {**SEL, "llm-d.ai/role": "prefill"}, "target_port": 8000},
        {"name": "all", "selector": SEL, "target_port": 8000},
        {"name": "staging", "namespace": "staging", "selector": SEL, "target_port": 9000},
    ]
    api.add_pod(NS, "p0", "10.0.0.1", {**SEL, "llm-d.ai/role": "prefill"})
    api.add_pod("staging", "s0", "10.0.1.1", SEL)
    async with running(k8s_config(kubeconfig, pools)) as (_provider, rec):
        assert rec.ready("prefill") == rec.ready("all") == {"10.0.0.1:8000": True}  # a pod in two pools: in each
        assert rec.ready("staging") == {"10.0.1.1:9000": True}
        api.add_pod(NS, "d0", "10.0.0.2", {**SEL, "llm-d.ai/role": "decode"})
        await rec.until(lambda: rec.ready("all") == {"10.0.0.1:8000": True, "10.0.0.2:8000": True})
        assert rec.ready("prefill") == {"10.0.0.1:8000": True}
        assert rec.ready("staging") == {"10.0.1.1:9000": True}


async def test_in_cluster_service_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with KubeAPI(token="sa-token", tls=make_certs(tmp_path, {"kubeapi": "IP:127.0.0.1"})) as api:
        for k, v in api.write_service_account(tmp_path / "sa", namespace=NS).items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("KUBECONFIG", raising=False)
        api.add_pod(NS, "a", "10.0.0.1", SEL)
        api.add_pod("default", "x", "10.0.0.9", SEL)
        async with running(k8s_config(None), service_account_dir=tmp_path / "sa") as (_provider, rec):
            assert rec.ready() == {"10.0.0.1:8000": True}  # https, the token, the namespace file
            api.add_pod(NS, "b", "10.0.0.2", SEL)
            await rec.until(lambda: "10.0.0.2:8000" in rec.ready())
