"""``kvroute envoy-config`` output accepted by the real Envoy (``envoy --mode validate``) for every mode,
with and without TLS, pods from flags or from kvroute's config, kvroute by IP or by DNS name; and a
kvroute reached by DNS name carrying real traffic."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.envoy import EnvoyProcess, validate
from bench.kvroute import KVRouteProcess
from extproc.cli import main
from tests.integration.test_envoy_cluster_tls import certs  # noqa: F401 - the CA, kvroute and envoy-client certificates

pytestmark = pytest.mark.integration

PODS = ["10.0.0.11:8000", "10.0.0.12:8000", "10.0.0.13:8000"]


def _kvroute_config(mode: str) -> dict[str, Any]:
    """A kvroute config whose Envoy config is ``mode``: roles and cluster names as each mode uses them."""
    if mode == "epp":
        return {"pools": {"p": {"endpoints": [{"address": a} for a in PODS]}}}
    if mode == "cluster":
        eps = [{"address": PODS[0]}, {"address": PODS[1], "cluster": "pod-b"}]
        return {"mode": "cluster", "pools": {"p": {"endpoints": eps}, "q": {"cluster": "pool-q",
                "endpoints": [{"address": PODS[2]}]}}}  # fmt: skip
    roles = ["prefill", "decode", "both"]
    return {
        "mode": "cluster",
        "pd": {"disaggregation": "always", "handoff": "cluster", "client_kv_transfer_params": "allow"},
        "pools": {"p": {"endpoints": [{"address": a, "role": r} for a, r in zip(PODS, roles, strict=True)]}},
    }


def _pod_flags(mode: str) -> list[str]:
    if mode == "pd-cluster":
        return ["--prefill", PODS[0], "--decode", ",".join(PODS[1:])]
    return ["--endpoints", ",".join(PODS)]


@pytest.mark.parametrize("kvroute", ["ip", "dns"])
@pytest.mark.parametrize("source", ["endpoints", "config"])
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "mtls"])
@pytest.mark.parametrize("mode", ["epp", "cluster", "pd-cluster"])
def test_generated_configs_validate(mode, tls, source, kvroute, certs: Path, tmp_path):  # noqa: F811
    argv = ["envoy-config", "--mode", mode]
    argv += ["--kvroute", "127.0.0.1:9002" if kvroute == "ip" else "kvroute.kvroute-system.svc.cluster.local:9002"]
    if tls:
        argv += ["--tls-ca", str(certs / "ca.crt"), "--tls-cert", str(certs / "envoy-client.crt"),
                 "--tls-key", str(certs / "envoy-client.key")]  # fmt: skip
    if source == "config":
        data = _kvroute_config(mode)
        if tls:
            data["server"] = {"tls": {"cert_file": str(certs / "kvroute.crt"), "key_file": str(certs / "kvroute.key"),
                                      "client_ca_file": str(certs / "ca.crt")}}  # fmt: skip
        (tmp_path / "kvroute.yaml").write_text(yaml.safe_dump(data))
        argv += ["--config", str(tmp_path / "kvroute.yaml")]
    else:
        argv += _pod_flags(mode)
    out = tmp_path / "envoy.yaml"
    assert main([*argv, "-o", str(out)]) == 0
    r = validate(out)
    assert r.returncode == 0, r.stdout + r.stderr
    clusters = {c["name"]: c for c in yaml.safe_load(out.read_text())["static_resources"]["clusters"]}
    assert ("transport_socket" in clusters["kvroute"]) is tls
    assert clusters["kvroute"]["type"] == ("STATIC" if kvroute == "ip" else "STRICT_DNS")
    per_pod = {"ep_10_0_0_11_8000", "ep_10_0_0_12_8000", "ep_10_0_0_13_8000"}
    targets = {
        "epp": set(),  # override_host on vllm_pool picks kvroute's pod
        "cluster": per_pod if source == "endpoints" else {"ep_10_0_0_11_8000", "pod-b", "ep_10_0_0_13_8000", "pool-q"},
        "pd-cluster": {"prefill", "decode"},
    }[mode]
    assert set(clusters) == targets | {"vllm_pool", "kvroute"}


def test_kvroute_by_dns_name_routes_traffic(fleet, tmp_path):
    """A STRICT_DNS kvroute cluster (localhost here, a Service in Kubernetes) carries the ext_proc
    stream: with fail-open off, every answer came through kvroute."""
    with KVRouteProcess(fleet.addresses) as k:
        out = tmp_path / "envoy.yaml"
        argv = ["envoy-config", "--kvroute", f"localhost:{k.grpc_port}", "--endpoints", ",".join(fleet.addresses),
                "--no-failure-mode-allow", "-o", str(out)]  # fmt: skip
        assert main(argv) == 0
        with (
            EnvoyProcess(out, kvroute_port=None, pods=fleet.addresses) as env,
            httpx.Client(base_url=env.url, timeout=10) as c,
        ):
            body = {"model": "m", "messages": [{"role": "user", "content": "dns " * 300}]}
            got = [c.post("/v1/chat/completions", json=body) for _ in range(3)]
    assert [r.status_code for r in got] == [200, 200, 200]
    backends = {r.json()["backend"] for r in got}
    assert len(backends) == 1 and got[0].json()["headers"]["x-gateway-destination-endpoint"] in backends


@pytest.mark.parametrize("mirror", ["ip", "dns"])
@pytest.mark.parametrize("body", ["BUFFERED", "STREAMED", "FULL_DUPLEX_STREAMED"])
@pytest.mark.parametrize("mode", ["epp", "cluster", "pd-cluster"])
def test_routes_and_mirror_validate(mode, body, mirror, tmp_path):
    """Per-route ext_proc settings (off, shadow) and a mirror to a shadow cluster, in every mode and body mode."""
    out = tmp_path / "envoy.yaml"
    to = "127.0.0.1:18080" if mirror == "ip" else "envoy.kvroute-shadow.svc.cluster.local:80"
    argv = ["envoy-config", "--mode", mode, *_pod_flags(mode), "--processing-mode", body,
            "--route", "/v1/chat/completions:shadow", "--route", "/v1/embeddings:off",
            "--mirror-to", to, "--mirror-fraction", "0.1", "-o", str(out)]  # fmt: skip
    assert main(argv) == 0
    r = validate(out)
    assert r.returncode == 0, r.stdout + r.stderr
