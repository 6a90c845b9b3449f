"""P/D with pods that serve only https and require client certificates (bench.sim --tls-*), through
real Envoy: kvroute scrapes them and runs the gateway prefill legs over mTLS (pods.tls), Envoy dials
them over mTLS too (``kvroute envoy-config --pods-tls-*``)."""

from __future__ import annotations

import re
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.envoy import EnvoyProcess, validate
from bench.kvroute import KVRouteProcess
from bench.procs import python_module, start_with_ready_file, stop
from bench.redis_server import wait_for
from extproc.cli import main
from extproc.envoyconfig import TLSFiles
from tests.certs import make_certs
from tests.integration.test_pd import PD_FLEET, chat, long_doc, pd_config

pytestmark = pytest.mark.integration

POD_NAME = "vllm.pods.test"  # every pod's certificate carries it beside the pod's IP


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(
        tmp_path_factory.mktemp("pods-tls"),
        {"pod": f"IP:127.0.0.1,DNS:{POD_NAME}", "kvroute": "DNS:kvroute", "envoy": "DNS:envoy"},
    )


def pods_tls_flags(certs: Path) -> list[str]:
    """Envoy's upstream mTLS to the pods: verifies their certificates, presents its own."""
    return ["--pods-tls-ca", str(certs / "ca.crt"), "--pods-tls-cert", str(certs / "envoy.crt"),
            "--pods-tls-key", str(certs / "envoy.key")]  # fmt: skip


@pytest.fixture(scope="module")
def tls_fleet(certs: Path) -> Iterator[list[dict[str, Any]]]:
    proc, info = start_with_ready_file(
        python_module(
            "bench.sim",
            *PD_FLEET,
            *("--tls-cert", str(certs / "pod.crt"), "--tls-key", str(certs / "pod.key")),
            *("--tls-client-ca", str(certs / "ca.crt")),
        )
    )
    assert isinstance(info, dict)
    yield info["pods"]
    stop(proc)


@pytest.fixture(scope="module")
def admin(certs: Path) -> Iterator[httpx.Client]:
    """The test's own client to the pods' /sim admin, with a certificate they accept."""
    ctx = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    ctx.load_cert_chain(str(certs / "kvroute.crt"), str(certs / "kvroute.key"))
    with httpx.Client(verify=ctx, timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def kvroute_config(tls_fleet: list[dict[str, Any]], certs: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tmp_path_factory.mktemp("pd-tls") / "kvroute.yaml"
    pods_tls = {
        "ca_file": str(certs / "ca.crt"),
        "cert_file": str(certs / "kvroute.crt"),
        "key_file": str(certs / "kvroute.key"),
        "server_name": POD_NAME,  # Envoy's config takes it from here too
    }
    scrape = {"enabled": True, "interval_s": 0.05}
    cfg.write_text(yaml.safe_dump(pd_config(tls_fleet, scrape=scrape, pods={"tls": pods_tls})))
    return cfg


@pytest.fixture(scope="module")
def envoy_config(kvroute_config: Path, certs: Path) -> Path:
    """``kvroute envoy-config`` for this kvroute config: the pods, and TLS to them, from the command."""
    out = kvroute_config.parent / "envoy.yaml"
    assert main(["envoy-config", "--config", str(kvroute_config), *pods_tls_flags(certs), "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def gateway(tls_fleet: list[dict[str, Any]], kvroute_config: Path, envoy_config: Path):
    addrs = [p["address"] for p in tls_fleet]
    with (
        KVRouteProcess(config=str(kvroute_config)) as k,
        EnvoyProcess(envoy_config, kvroute_port=k.grpc_port, pods=addrs) as env,
        httpx.Client(base_url=env.url, timeout=30) as c,
    ):
        # Scraped endpoints count as healthy once their first scrape (over mTLS) came back.
        wait_for(lambda: 'kvroute_endpoints{pool="default",state="ready"} 4.0' in k.metrics(), 10, "4 scraped pods")
        yield c, k, env


def scrape_stat(k: KVRouteProcess, stat: str) -> float:
    m = re.search(rf'^kvroute_scrape{{stat="{stat}"}} (\S+)$', k.metrics(), re.M)
    assert m is not None, stat
    return float(m.group(1))


def test_prefill_leg_and_scrapes_over_mtls_end_to_end(gateway, tls_fleet, admin: httpx.Client) -> None:
    c, k, env = gateway
    assert all(p["url"].startswith("https://") for p in tls_fleet)

    def stat(role: str, key: str) -> int:
        return sum(admin.get(p["url"] + "/sim/stats").json()[key] for p in tls_fleet if p["role"] == role)

    transfers0, prefill0 = stat("decode", "transfers"), stat("prefill", "requests")
    with c.stream("POST", "/v1/chat/completions", json=chat(long_doc(1), stream=True)) as r:
        text = r.read().decode()
    assert r.status_code == 200 and text.rstrip().endswith("data: [DONE]")
    assert stat("prefill", "requests") == prefill0 + 1  # kvroute's leg reached a prefill pod over mTLS
    assert stat("decode", "transfers") == transfers0 + 1  # ... and the decode pod pulled its KV
    m = k.metrics()
    assert 'kvroute_pd_decisions_total{outcome="split",reason="uncached"}' in m
    assert "fallback-local" not in m
    assert scrape_stat(k, "scrapes") > 4 and scrape_stat(k, "tls_errors") == 0 and scrape_stat(k, "stale") == 0
    # Envoy's own leg went over TLS, the pods' name checked.
    ssl_stats = env.stats("cluster.vllm_pool.ssl.")
    assert ssl_stats["cluster.vllm_pool.ssl.handshake"] >= 1 and ssl_stats["cluster.vllm_pool.ssl.fail_verify_san"] == 0


def test_envoy_refuses_pods_without_the_configured_name(gateway, tls_fleet, envoy_config: Path, certs: Path) -> None:
    """The name check is real: the same config expecting another name reaches no pod."""
    _, k, _ = gateway
    wrong = TLSFiles(ca=str(certs / "ca.crt"), cert=str(certs / "envoy.crt"), key=str(certs / "envoy.key"),
                     server_name="not-" + POD_NAME)  # fmt: skip
    addrs = [p["address"] for p in tls_fleet]
    with (
        EnvoyProcess(envoy_config, kvroute_port=k.grpc_port, pods=addrs, pods_tls=wrong) as env,
        httpx.Client(base_url=env.url, timeout=30) as c,
    ):
        r = c.post("/v1/chat/completions", json=chat("hello"))
        assert r.status_code == 503
        assert env.stats("cluster.vllm_pool.ssl.")["cluster.vllm_pool.ssl.fail_verify_san"] >= 1


@pytest.mark.parametrize("mode", ["epp", "cluster", "pd-cluster"])
def test_pods_tls_configs_validate(mode: str, certs: Path, tmp_path: Path) -> None:
    """Every pod cluster of every mode carries the TLS socket (kvroute's cluster none), and Envoy takes it."""
    out = tmp_path / "envoy.yaml"
    pods = ["--prefill", "127.0.0.1:8001", "--decode", "127.0.0.1:8002"] if mode == "pd-cluster" else []
    argv = ["envoy-config", "--mode", mode, "--endpoints", "127.0.0.1:8000", *pods, *pods_tls_flags(certs),
            "--pods-tls-server-name", POD_NAME, "-o", str(out)]  # fmt: skip
    assert main(argv) == 0
    r = validate(out)
    assert r.returncode == 0, r.stdout + r.stderr
    clusters = {c["name"]: c for c in yaml.safe_load(out.read_text())["static_resources"]["clusters"]}
    with_tls = {n for n, c in clusters.items() if "transport_socket" in c}
    assert with_tls == set(clusters) - {"kvroute"} and {"vllm_pool", "kvroute"} <= set(clusters)
