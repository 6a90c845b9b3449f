"""Envoy in front of ``kvroute serve --workers 2``: SO_REUSEPORT spreads connections, not streams, so
both workers decide only once Envoy opens several connections to kvroute. ``kvroute envoy-config
--kvroute-max-streams N`` caps the ext_proc streams per connection (each lasts its request's exchange):
past N in flight, Envoy opens another connection."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.envoy import EnvoyProcess
from bench.kvroute import KVRouteProcess
from bench.redis_server import wait_for
from extproc.cli import main
from tests.integration.test_workers import both_serving, samples

pytestmark = pytest.mark.integration

IN_FLIGHT = 16  # requests held open at once (the backends answer after x-test-delay)
HOLD_S = "5"  # tests/backends.py's longest delay; the test waits on Envoy's counters, not on this


@pytest.fixture(scope="module")
def workers2(fleet) -> Iterator[KVRouteProcess]:
    with KVRouteProcess(fleet.addresses, ["--workers", "2", "--model", "m"]) as kv:
        wait_for(lambda: both_serving(kv), 15, "both workers to serve")
        yield kv


def decisions(kv: KVRouteProcess) -> dict[str, float]:
    return samples(kv, "kvroute_worker_decisions_total")


async def hold_requests(env: EnvoyProcess) -> list[int]:
    """IN_FLIGHT requests at once; returns their status codes once Envoy held all their ext_proc streams."""
    active = "cluster.kvroute.upstream_rq_active"
    async with httpx.AsyncClient(base_url=env.url, timeout=30) as c:
        sent = [
            asyncio.create_task(c.post("/v1/chat/completions", headers={"x-test-delay": HOLD_S}, json={
                "model": "m", "messages": [{"role": "user", "content": f"spread {i} " * 200}]}))
            for i in range(IN_FLIGHT)
        ]  # fmt: skip
        await asyncio.to_thread(wait_for, lambda: env.stats(active).get(active) == IN_FLIGHT, 4,
                                f"{IN_FLIGHT} ext_proc streams open at once")  # fmt: skip
        return [r.status_code for r in await asyncio.gather(*sent)]


@pytest.mark.parametrize(("max_streams", "connections"), [(1, IN_FLIGHT), (1000, 1)])
def test_both_workers_decide_when_envoy_opens_several_connections(
    workers2: KVRouteProcess, fleet, tmp_path: Path, max_streams: int, connections: int
) -> None:
    out = tmp_path / "envoy.yaml"
    argv = ["envoy-config", "--endpoints", ",".join(fleet.addresses), "--kvroute-max-streams", str(max_streams),
            "--no-failure-mode-allow", "-o", str(out)]  # fmt: skip
    assert main(argv) == 0
    before = decisions(workers2)
    with EnvoyProcess(out, kvroute_port=workers2.grpc_port, pods=fleet.addresses) as env:  # one Envoy worker thread
        assert asyncio.run(hold_requests(env)) == [200] * IN_FLIGHT
        opened = env.stats("cluster.kvroute.upstream_cx_total")["cluster.kvroute.upstream_cx_total"]
    assert opened == connections
    got = {w: n - before.get(w, 0) for w, n in decisions(workers2).items()}
    assert sum(got.values()) == IN_FLIGHT
    if connections == 1:  # one connection lands on one worker, whatever the load
        assert sorted(got.values()) == [0, IN_FLIGHT], got
    else:  # 16 connections, hashed over 2 workers: all on one has odds of 2**-15
        assert all(n > 0 for n in got.values()) and len(got) == 2, got
