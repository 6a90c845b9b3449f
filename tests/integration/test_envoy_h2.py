"""Envoy's ext_proc stream to kvroute's own HTTP/2 gRPC server (server.h2_port, extproc/h2.py), end to end.

The EPP data path's tests (test_envoy_epp.py) run again here with Envoy dialing the h2 port: routing and
affinity, stripped headers, errors, every body mode with large chunked bodies, streamed responses read
for usage, the pod slot held for the whole exchange; P/D's gateway hand-off (test_pd.py's split and
slow-leg tests); plus mTLS, fail-open when kvroute dies, and workers sharing the port.
"""

import asyncio
from collections import Counter
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.envoy import EnvoyProcess, validate
from bench.faults import metric_of
from bench.kvroute import KVRouteProcess
from extproc.app import EXT_PROC_SERVICE
from extproc.cli import main
from tests.certs import make_certs
from tests.integration.test_envoy_cluster_tls import _tls_socket
from tests.integration.test_envoy_epp import (  # noqa: F401 (collected again here, over the h2 port)
    chat,
    doc,
    statuses_through_a_kill,
    test_errors_come_back_openai_shaped,
    test_inflight_held_for_the_whole_exchange,
    test_inflight_held_for_the_whole_exchange_in_the_streamed_modes,
    test_large_chunked_bodies_every_mode,
    test_multi_turn_conversation_sticks,
    test_same_prefix_sticks_different_prefixes_spread,
    test_spoofed_routing_headers_are_stripped,
    test_streaming_sse_and_usage_metrics,
)
from tests.integration.test_envoy_workers import IN_FLIGHT, decisions, hold_requests
from tests.integration.test_pd import (  # noqa: F401 (the P/D fleet, and two tests collected again over h2)
    pd_config,
    pd_fleet,
    test_long_prompt_is_split_and_streams_back,
    test_slow_prefill_leg_outlasting_envoys_message_timeout_still_hands_off,
)
from tests.integration.test_workers import both_serving
from tests.polling import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def kvroute(fleet):
    with KVRouteProcess(fleet.addresses, extra_args=["--model", "m", "--model", "other"], h2=True) as k:
        assert k.ext_proc_port == k.h2_port != k.grpc_port
        yield k


@pytest.fixture(scope="module")
def envoy(kvroute, fleet):
    # failure_mode_allow off: a stream the h2 server got wrong is a 500 here, not a quiet fallback.
    with EnvoyProcess("epp.yaml", kvroute_port=kvroute.h2_port, pods=fleet.addresses,
                      ext_proc={"failure_mode_allow": False}) as e:  # fmt: skip
        yield e


def test_decisions_come_over_h2_not_grpcio(envoy, kvroute):
    """The decisions of this module's requests are kvroute's (its metrics), made on streams of the h2 port."""
    with httpx.Client(base_url=envoy.url, timeout=10) as c:
        got = [c.post("/v1/chat/completions", json=chat(doc(40), str(i))).json() for i in range(4)]
    assert len({g["backend"] for g in got}) == 1
    assert all(g["headers"]["x-gateway-destination-endpoint"] == g["backend"] for g in got)
    # Every stream closed and released (Envoy ends its side a moment after the response).
    wait_for(lambda: metric_of(kvroute, "kvroute_open_streams") == 0, 10, "the streams to close")


def test_the_h2_port_answers_grpc_health_checks(envoy, kvroute):
    """The h2 port answers grpc.health.v1.Health/Check as grpcio's port does: epp.yaml's kvroute cluster
    health-checks the ExternalProcessor service there, and its host turns healthy by those checks (not
    by Envoy's panic routing); an unknown service is NOT_FOUND, Watch is grpcio's only."""
    success = "cluster.kvroute.health_check.success"
    wait_for(lambda: envoy.stats(success).get(success, 0) >= 1, 10, "Envoy's first health check of the h2 port")
    assert envoy.stats("cluster.kvroute.health_check.failure")["cluster.kvroute.health_check.failure"] == 0
    assert envoy.cluster_hosts("kvroute") == {f"127.0.0.1:{kvroute.h2_port}": True}
    with grpc.insecure_channel(f"127.0.0.1:{kvroute.h2_port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "readiness", EXT_PROC_SERVICE):
            got = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert got.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as e:
            next(health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_killed_kvroute_fails_open_over_h2(fleet):
    with (
        KVRouteProcess(fleet.addresses, h2=True) as k,
        EnvoyProcess("epp.yaml", kvroute_port=k.h2_port, pods=fleet.addresses) as env,
    ):
        assert statuses_through_a_kill(env.url, k) == Counter({200: 120})


@pytest.fixture(scope="module")
def gateway(pd_fleet, tmp_path_factory):  # noqa: F811
    """P/D with the gateway hand-off over the h2 port: the prefill leg runs after the body's first answer
    (a task; Envoy's later messages wait behind it), the decode pod's answer after it."""
    cfg = tmp_path_factory.mktemp("pd") / "kvroute.yaml"
    cfg.write_text(yaml.safe_dump(pd_config(pd_fleet)))
    addrs = [p["address"] for p in pd_fleet]
    with (
        KVRouteProcess(config=str(cfg), h2=True) as k,
        EnvoyProcess("epp.yaml", kvroute_port=k.h2_port, pods=addrs) as env,
        httpx.Client(base_url=env.url, timeout=30) as c,
    ):
        yield c, k


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    return make_certs(tmp_path_factory.mktemp("tls"), {"kvroute": "DNS:kvroute", "envoy-client": "DNS:envoy-client"})


def test_mtls_over_h2(fleet, certs, tmp_path):
    tls = {"cert_file": str(certs / "kvroute.crt"), "key_file": str(certs / "kvroute.key"),
           "client_ca_file": str(certs / "ca.crt")}  # fmt: skip
    cfg = tmp_path / "kvroute.yaml"
    cfg.write_text(yaml.safe_dump({"pools": {"default": {"endpoints": [{"address": a} for a in fleet.addresses]}},
                                   "server": {"tls": tls}}))  # fmt: skip
    with (
        KVRouteProcess(config=str(cfg), h2=True) as k,
        EnvoyProcess(
            "epp.yaml",
            kvroute_port=k.h2_port,
            pods=fleet.addresses,
            kvroute_tls=_tls_socket(certs),
            ext_proc={"failure_mode_allow": False},
        ) as env,  # fmt: skip
    ):
        r = validate(env.config_path)
        assert r.returncode == 0, r.stderr
        with httpx.Client(base_url=env.url, timeout=10) as c:
            got = [c.post("/v1/chat/completions", json=chat(doc(41), "q")).json() for _ in range(3)]
    assert len({g["backend"] for g in got}) == 1
    assert got[0]["headers"]["x-gateway-destination-endpoint"] == got[0]["backend"]


def test_workers_share_the_h2_port(fleet, tmp_path):
    """``--workers 2``: both workers listen on the h2 port (SO_REUSEPORT) and both decide once Envoy opens a
    connection per request."""
    with KVRouteProcess(fleet.addresses, ["--workers", "2", "--model", "m"], h2=True) as kv:
        wait_for(lambda: both_serving(kv), 15, "both workers to serve")
        out = tmp_path / "envoy.yaml"
        argv = ["envoy-config", "--endpoints", ",".join(fleet.addresses), "--kvroute-max-streams", "1",
                "--no-failure-mode-allow", "-o", str(out)]  # fmt: skip
        assert main(argv) == 0
        with EnvoyProcess(out, kvroute_port=kv.h2_port, pods=fleet.addresses) as env:
            assert asyncio.run(hold_requests(env)) == [200] * IN_FLIGHT
        got = decisions(kv)
    assert sum(got.values()) == IN_FLIGHT and len(got) == 2 and all(n > 0 for n in got.values()), got
