"""Real Envoy + real kvroute over the ext_authz transports (envoy/epp-authz.yaml: one gRPC Check per
request; envoy/epp-authz-http.yaml: the same as an HTTP/1.1 request; Envoy's gRPC access log reporting
each finished request): the EPP data path end to end, on both."""

import asyncio
import time
from collections import Counter

import httpx
import pytest
import yaml

from bench.envoy import EnvoyProcess
from bench.kvroute import KVRouteProcess
from tests.integration.test_envoy_epp import (  # the same checks as over ext_proc, with this module's fixtures
    BAD_BODIES,
    DEST,
    chat,
    doc,
    statuses_through_a_kill,
    test_get_and_passthrough_paths_are_routed,  # noqa: F401 - collected here too, for each transport
    test_no_prompt_text_in_logs_or_metrics,  # noqa: F401
)
from tests.polling import wait_for

pytestmark = pytest.mark.integration
CONFIGS = {"grpc": "epp-authz.yaml", "http": "epp-authz-http.yaml"}


def envoy_for(api: str, k: KVRouteProcess, fleet) -> EnvoyProcess:  # type: ignore[no-untyped-def]
    return EnvoyProcess(CONFIGS[api], kvroute_port=k.grpc_port, kvroute_http_port=k.authz_http_port or None,
                        pods=fleet.addresses)  # fmt: skip


@pytest.fixture(scope="module", params=list(CONFIGS))
def api(request):  # type: ignore[no-untyped-def]
    return request.param


@pytest.fixture(scope="module")
def kvroute(fleet, api):  # type: ignore[no-untyped-def]
    with KVRouteProcess(fleet.addresses, extra_args=["--model", "m", "--model", "other"], authz_http=True) as k:
        yield k


@pytest.fixture(scope="module")
def envoy(kvroute, fleet, api):  # type: ignore[no-untyped-def]
    with envoy_for(api, kvroute, fleet) as e:
        yield e


def total(kvroute: KVRouteProcess, series: str) -> float:
    """A metric summed over its labels (every endpoint, reason)."""
    lines = kvroute.metrics().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(series + "{"))


def checks(kvroute: KVRouteProcess) -> float:
    return total(kvroute, "kvroute_decisions_total")


def inflight(kvroute: KVRouteProcess) -> float:
    return total(kvroute, "kvroute_inflight_requests")


def test_same_prefix_sticks_different_prefixes_spread(envoy, kvroute):
    before = checks(kvroute)
    with httpx.Client(base_url=envoy.url, timeout=10) as c:
        homes: dict[int, set[str]] = {}
        for d in range(16):
            for q in range(3):
                r = c.post("/v1/chat/completions", json=chat(doc(100 + d), f"question {q}"))
                assert r.status_code == 200, r.text
                got = r.json()
                assert got["headers"][DEST] == got["backend"]  # the Check's header picked the pod
                homes.setdefault(d, set()).add(got["backend"])
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len({next(iter(h)) for h in homes.values()}) >= 3
    assert checks(kvroute) - before >= 48  # every request was decided by kvroute, none passed on unrouted


def test_spoofed_routing_headers_are_stripped(envoy, fleet):
    with httpx.Client(base_url=envoy.url, timeout=10) as c:
        body = chat(doc(201), "q")
        home = c.post("/v1/chat/completions", json=body).json()["backend"]
        victim = next(a for a in fleet.addresses if a != home)
        r = c.post("/v1/chat/completions", json=body, headers={DEST: victim, "x-kvroute-cluster": "evil"})
    got = r.json()
    assert got["backend"] == home and got["headers"][DEST] == home
    assert "x-kvroute-cluster" not in got["headers"]


@pytest.mark.parametrize("body,status,needle", BAD_BODIES)
def test_errors_come_back_openai_shaped(envoy, body, status, needle):
    with httpx.Client(base_url=envoy.url, timeout=10) as c:
        r = c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status


def test_inflight_held_until_the_access_log_reports_the_request(envoy, kvroute):
    """A Check ends before the pod answers; the slot stays until Envoy logs the request as finished."""

    async def until(value: float, while_running: asyncio.Task | None = None) -> None:
        deadline = time.monotonic() + 10
        while inflight(kvroute) != value:
            assert while_running is None or not while_running.done(), "the request ended before it was counted"
            assert time.monotonic() < deadline, f"in flight never reached {value}"
            await asyncio.sleep(0.01)

    released = total(kvroute, "kvroute_authz_access_log_entries_total")

    async def go() -> None:
        async with httpx.AsyncClient(base_url=envoy.url, timeout=10) as c:
            task = asyncio.create_task(
                c.post("/v1/chat/completions", json=chat(doc(7), "slow"), headers={"x-test-delay": "1.0"})
            )
            await until(1.0, while_running=task)
            assert (await task).status_code == 200
        await until(0.0)

    asyncio.run(go())
    assert 'kvroute_authz_access_log_entries_total{result="released"}' in kvroute.metrics()
    assert total(kvroute, "kvroute_authz_access_log_entries_total") > released


def test_killed_kvroute_fails_open_and_loses_nothing(fleet, api):
    with (
        KVRouteProcess(fleet.addresses, authz_http=True) as k,
        envoy_for(api, k, fleet) as env,
    ):
        assert statuses_through_a_kill(env.url, k) == Counter({200: 120})


def test_a_body_rewrite_is_refused_not_dropped(fleet, api, tmp_path):
    """tenancy.cache_salt rewrites the body; ext_authz cannot carry that, so the request is refused
    (never sent on without the tenant's salt)."""
    (tmp_path / "secret").write_text("authz-secret-0123456789")
    cfg = tmp_path / "kvroute.yaml"
    cfg.write_text(yaml.safe_dump({
        "pools": {"default": {"endpoints": [{"address": a} for a in fleet.addresses]}},
        "tenancy": {"cache_salt": "inject", "secret_file": str(tmp_path / "secret")},
    }))  # fmt: skip
    with (
        KVRouteProcess(config=str(cfg), authz_http=True) as k,
        envoy_for(api, k, fleet) as env,
        httpx.Client(base_url=env.url, timeout=10) as c,
    ):
        before = fleet_requests(fleet)
        r = c.post("/v1/chat/completions", json=chat(doc(3), "q"), headers={"x-tenant-id": "acme"})
        assert r.status_code == (501 if api == "grpc" else 403)  # Envoy fails open on an HTTP server's 5xx
        assert "ext_authz" in r.json()["error"]["message"]
        assert fleet_requests(fleet) == before  # it never reached a pod
        wait_for(lambda: inflight(k) == 0, 5, "no slot held for the refused request")


def fleet_requests(fleet) -> int:
    return sum(len(fleet.by_address(a).seen) for a in fleet.addresses)
