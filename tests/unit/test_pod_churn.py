"""Pods come and go, in Kubernetes each back under a new IP: what kvroute keeps per pod goes with it.

The soak (bench/soak.py) watches a real process's memory; this finds which structure would hold on.
Many cycles of pods added, scraped, routed to (both rollout arms, route-id pins, precise-index slots,
KV-event subscriptions, metrics) and removed: after each, every per-pod table names only the pods in
service, holds as much as after the first cycle, and nothing per request is left over. Each cycle's
pods are new loopback servers (a new port stands for a new IP)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bench.envoy import free_port
from extproc.config import EndpointConfig, load_config
from extproc.endpoints.events import KVEventSubscriber
from extproc.observability import Metrics
from extproc.request import InferenceRequest
from extproc.router import Router
from tests.backends import Backend, start_backend

CYCLES = 30
PODS_PER_CYCLE = 3
POD = re.compile(r"\d+\.\d+\.\d+\.\d+:\d+$")  # a pod address as a label value
# Two documents shared by every cycle (prefix hits), fresh ones, and pinned conversations.
DOCS = [
    (f"shared {i % 2} " + "lorem ipsum dolor sit amet " * 40, f"conv-{i}" if i % 3 == 0 else None) for i in range(12)
]


def request(i: int) -> InferenceRequest:
    doc, route_id = DOCS[i]
    return InferenceRequest(
        path="/v1/chat/completions",
        method="POST",
        request_id=f"r{i}",
        tenant="t",
        model="m",
        prompt_text=doc + f" question {i}",
        route_id=route_id,
        body={"model": "m", "messages": [{"role": "user", "content": doc}]},
    )


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[Router]:
    cfg = load_config(
        None,
        {
            # The test publishes the endpoint sets itself (registry.apply); the file is never read.
            "discovery": {"provider": "file", "file": {"path": str(tmp_path / "unused.yaml")}},
            "kv_events": {"enabled": True, "capacity_blocks": 4096},
            "scrape": {"enabled": True, "interval_s": 0.02},
            "rollout": {"enforce_fraction": 0.5},  # both arms: the shadow arm has its own history
        },
    )
    r = Router(cfg, Metrics())
    await r.live.start([])  # the scraper runs; pods arrive through registry.apply
    yield r
    await r.aclose()


async def pods(cycle: int, kv_events: str) -> tuple[list[Backend], list[EndpointConfig]]:
    """New pods serving /metrics; their KV events point at a closed port (subscribed, never heard)."""
    backends = [await start_backend() for _ in range(PODS_PER_CYCLE)]
    eps = [
        EndpointConfig(address=b.address, uid=f"pod-{cycle}-{i}", kv_events=kv_events) for i, b in enumerate(backends)
    ]
    return backends, eps


async def scraped(r: Router, addresses: list[str]) -> None:
    """Until every pod's metrics are fresh: stale ones are unhealthy, and take no requests."""
    scraper = r.live.scraper
    assert scraper is not None
    async with asyncio.timeout(5):
        while not all(scraper.get(a) for a in addresses):
            await asyncio.sleep(0.01)


def traffic(r: Router, addresses: list[str]) -> None:
    """Every request routed and finished (a shadowed one on the pod Envoy picked); the precise index
    learns each pod, as a pod's KV events or a speculative record would."""
    for i in range(len(DOCS)):
        out = r.route(request(i))
        if out.arm == "shadow":
            held = r.observe_upstream(out, addresses[i % len(addresses)])
            assert held is not None
            r.release(held)
        else:
            r.release(out.endpoint, out.local_prefill)
    assert r.precise is not None
    for n, addr in enumerate(addresses):
        r.precise.record([n + 1, n + 2], addr)


def per_pod(r: Router) -> dict[str, set[str]]:
    """Which pods each structure keyed by pod holds."""
    live, precise, scraper = r.live, r.live.precise, r.live.scraper
    assert precise is not None and scraper is not None
    # Any label naming a pod (endpoint or not): a series keyed by a gone pod is a leak.
    series = {v for fam in r.metrics.registry.collect() for s in fam.samples for v in s.labels.values() if POD.match(v)}
    return {
        "registry": set(r.registry.by_address) | set(r.registry.configs),
        "approx index": set(r.index.block_counts()),
        "shadow index": set(r.shadow_index.block_counts()),
        "route pins": {a for _, a in r.scheduler.routes._routes.items()},  # type: ignore[attr-defined]
        "precise index": set(precise.block_counts()) | set(precise.block_size_of),
        "scrape targets": set(live._metrics_at) | {a for a in r.registry.by_address if scraper.state(a)},
        "kv-event subscribers": set(live.subscribers),
        "kv-event intake": {c.endpoint for c in live.intake.consumers if isinstance(c, KVEventSubscriber)}
        if live.intake is not None
        else set(),
        "metric series": series,
        "metric children": {label for _, labels in r.metrics._children for label in labels if ":" in label},
    }


def sizes(r: Router) -> dict[str, int]:
    """Sizes that do not depend on which pods the requests went to (series and children labelled
    with a pod, which do, are checked above by the pods they name). Series without a pod label are
    not counted: their label sets are bounded enums (outcomes, reasons) that fill as events happen,
    and which events a loaded machine sees (a slow scrape, a timeout) is not deterministic."""
    assert r.live.precise is not None and r.live.scraper is not None
    return {
        "pods": len(r.registry.by_address),
        "approx index keys": r.index.distinct_keys(),  # type: ignore[attr-defined]
        "shadow index keys": r.shadow_index.distinct_keys(),  # type: ignore[attr-defined]
        "route pins": len(r.scheduler.routes),  # type: ignore[arg-type]
        "precise slots": r.live.precise.stats()["endpoints"],
        "scraped": r.live.scraper.stats()["endpoints"],
        "metric children": sum(1 for _, labels in r.metrics._children if not any(":" in x for x in labels)),
    }


async def settled(r: Router) -> None:
    """The removed pods' subscribers are closed (LiveView closes them in the background)."""
    async with asyncio.timeout(5):
        while r.live._closing:
            await asyncio.sleep(0.01)


async def test_every_per_pod_structure_follows_the_pods_in_service(router: Router) -> None:
    sink = f"tcp://127.0.0.1:{free_port()}"
    first: dict[str, int] | None = None
    previous: list[Backend] = []
    for cycle in range(CYCLES):
        backends, eps = await pods(cycle, sink)
        router.registry.apply("p", eps)  # the previous cycle's pods are removed
        for b in previous:
            await b.runner.cleanup()
        previous = backends
        addresses = [e.address for e in eps]
        await scraped(router, addresses)
        traffic(router, addresses)
        await settled(router)
        held = per_pod(router)
        assert {k: v - set(addresses) for k, v in held.items() if v - set(addresses)} == {}, f"cycle {cycle}"
        assert held["kv-event subscribers"] == set(addresses) and held["precise index"] == set(addresses)
        assert held["kv-event intake"] == set(addresses)
        now = sizes(router)
        first = first or now
        assert now == first, f"cycle {cycle}"
        # Nothing per request outlives it: in-flight counts, queued prefill estimates.
        for e in router.registry.by_address.values():
            assert e.inflight == 0 and e.prefills.own_wait(0.0) == 0.0
    # Background tasks: a scraper per pod in service and one KV-event intake for all, nothing else left running.
    tasks = {t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith(("kv-events", "metrics:"))}
    assert tasks == {"kv-events-intake", *(f"metrics:{a}" for a in router.live.subscribers)}

    router.registry.apply("p", [])
    for b in previous:
        await b.runner.cleanup()
    await settled(router)
    assert {k: v for k, v in per_pod(router).items() if v} == {}


async def test_a_pod_that_died_leaves_both_arms_history(router: Router) -> None:
    """Scrapes refused (the pod died, still listed): its routing history goes from both indexes."""
    backends, eps = await pods(0, f"tcp://127.0.0.1:{free_port()}")
    router.registry.apply("p", eps)
    addresses = [e.address for e in eps]
    await scraped(router, addresses)
    traffic(router, addresses)
    assert router.shadow_index.block_counts() and router.index.block_counts()
    for b in backends:
        await b.runner.cleanup()
    async with asyncio.timeout(5):  # refused scrapes: each pod is down, purged
        while router.index.block_counts() or router.shadow_index.block_counts():
            await asyncio.sleep(0.01)
    assert router.live.scraper is not None and router.live.scraper.downs == PODS_PER_CYCLE
