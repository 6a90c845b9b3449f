"""Per-route enforcement and the shadow cluster through real Envoy, from `kvroute envoy-config` output:
a `--route PREFIX:shadow` route is decided and measured but balanced by Envoy, a `PREFIX:off` route
never reaches kvroute, the rest is enforced, and no client header can move a request between them;
`--mirror-to` copies every request to a second Envoy whose own kvroute routes it in a second pool."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from bench.envoy import EnvoyProcess
from bench.kvroute import KVRouteProcess
from extproc.cli import main
from extproc.envoyconfig import UPSTREAM_HEADER, Address, Mirror
from extproc.rollout import ROLLOUT_METADATA
from tests.backends import BackendFleet
from tests.integration.test_discovery_envoy import metric, wait_for
from tests.integration.test_rollout_envoy import TURNS, N, conversations

pytestmark = pytest.mark.integration
PROMPT = {"model": "m", "prompt": "def fibonacci(n):\n" + "    # code " * 200}


def envoy_config(tmp_path: Path, pods: list[str], *flags: str) -> Path:
    out = tmp_path / "envoy.yaml"
    assert main(["envoy-config", "--endpoints", ",".join(pods), *flags, "-o", str(out)]) == 0
    return out


def kvroute_for(pods: list[str], tmp_path: Path, name: str = "kvroute.yaml") -> KVRouteProcess:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"pools": {"p": {"endpoints": [{"address": a} for a in pods]}}}))
    return KVRouteProcess(config=str(path))


def test_routes_shadow_off_and_enforced(fleet, tmp_path):
    config = envoy_config(tmp_path, fleet.addresses, "--route", "/v1/chat/completions:shadow",
                          "--route", "/v1/embeddings:off")  # fmt: skip
    with (
        kvroute_for(fleet.addresses, tmp_path) as kv,
        EnvoyProcess(config, kvroute_port=kv.grpc_port, pods=fleet.addresses) as env,
        httpx.Client(base_url=env.url, timeout=10) as c,
    ):
        # Chat: shadowed by the route although kvroute's config enforces everything.
        pods = conversations(env, N, TURNS)  # (asserts clients never see the pod header)
        assert all(len(set(p)) > 1 for p in pods.values()), pods  # Envoy's round robin moved each one
        assert metric(kv, "kvroute_rollout_decisions_total", arm="shadow") == N * TURNS
        assert metric(kv, "kvroute_rollout_tokens_total", arm="shadow", kind="prompt") == 100 * N * TURNS
        # Completions: enforced, one pod for the repeated prompt; a client's own rollout header changes nothing.
        got = [c.post("/v1/completions", json=PROMPT, headers={ROLLOUT_METADATA: "shadow"}) for _ in range(4)]
        assert [r.status_code for r in got] == [200] * 4
        assert len({r.json()["backend"] for r in got}) == 1
        assert metric(kv, "kvroute_rollout_decisions_total", arm="enforced") == 4
        # Embeddings: ext_proc off, so kvroute never sees them and Envoy balances them.
        fleet.clear()
        emb = [c.post("/v1/embeddings", json={"model": "m", "input": "same text"}) for _ in range(4)]
        assert [r.status_code for r in emb] == [200] * 4
        assert len({r.json()["backend"] for r in emb}) > 1
        assert all("x-gateway-destination-endpoint" not in r.json()["headers"] for r in emb)
        decided = sum(metric(kv, "kvroute_rollout_decisions_total", arm=a) or 0 for a in ("shadow", "enforced"))
        assert decided == N * TURNS + 4


def test_mirror_to_a_second_pool_routed_by_its_own_kvroute(fleet, tmp_path):
    shadow_pool = BackendFleet(2)
    try:
        live = envoy_config(tmp_path, fleet.addresses)
        with (
            kvroute_for(shadow_pool.addresses, tmp_path, "shadow.yaml") as kv_shadow,
            EnvoyProcess("epp.yaml", kvroute_port=kv_shadow.grpc_port, pods=shadow_pool.addresses) as env_shadow,
            kvroute_for(fleet.addresses, tmp_path) as kv,
            EnvoyProcess(
                live,
                kvroute_port=kv.grpc_port,
                pods=fleet.addresses,
                mirror=Mirror(Address("127.0.0.1", env_shadow.port)),
            ) as env,  # fmt: skip
            httpx.Client(base_url=env.url, timeout=10) as c,
        ):
            got = [c.post("/v1/completions", json=PROMPT) for _ in range(6)]
            assert [r.status_code for r in got] == [200] * 6
            # Clients get the live pool's answers only (the copies' responses are discarded).
            assert {r.json()["backend"] for r in got} <= set(fleet.addresses)
            assert all(UPSTREAM_HEADER not in r.headers or r.headers[UPSTREAM_HEADER] in fleet.addresses
                       for r in got)  # fmt: skip
            seen = lambda: [s for b in shadow_pool.backends for s in b.seen]  # noqa: E731
            wait_for(lambda: len(seen()) == 6, what="6 mirrored requests at the shadow pool")
            copies = seen()
            # Envoy marks the copies; the shadow Envoy stripped the live kvroute's pick (a live pod) and
            # its own kvroute chose within the shadow pool.
            assert all(s["headers"]["host"].partition(":")[0].endswith("-shadow") for s in copies), copies[0]["headers"]
            assert {s["headers"]["x-gateway-destination-endpoint"] for s in copies} <= set(shadow_pool.addresses)
            assert metric(kv_shadow, "kvroute_rollout_decisions_total", arm="enforced") == 6
            assert metric(kv, "kvroute_rollout_decisions_total", arm="enforced") == 6
    finally:
        shadow_pool.close()
