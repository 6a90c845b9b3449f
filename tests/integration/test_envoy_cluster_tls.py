"""Cluster mode and mTLS between Envoy and kvroute, through real Envoy."""

from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.envoy import CONFIG_DIR, EnvoyProcess, validate
from bench.kvroute import KVRouteProcess
from tests.certs import make_certs

pytestmark = pytest.mark.integration


def chat(i: int) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": f"doc {i} " + "lorem ipsum " * 200}]}


def test_cluster_mode_sticks_and_spreads(fleet):
    with (
        KVRouteProcess(fleet.addresses, extra_args=["--mode", "cluster"]) as k,
        EnvoyProcess("cluster.yaml", kvroute_port=k.grpc_port, pods=fleet.addresses) as env,
        httpx.Client(base_url=env.url, timeout=10) as c,
    ):
        homes: dict[int, set[str]] = {}
        for i in range(6):
            for _ in range(3):
                r = c.post("/v1/chat/completions", json=chat(i))
                assert r.status_code == 200, r.text
                got = r.json()
                assert got["headers"]["x-kvroute-cluster"].startswith("ep_127_0_0_1_")
                homes.setdefault(i, set()).add(got["backend"])
    assert all(len(h) == 1 for h in homes.values())
    assert len({next(iter(h)) for h in homes.values()}) >= 2


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    return make_certs(tmp_path_factory.mktemp("tls"), {"kvroute": "DNS:kvroute", "envoy-client": "DNS:envoy-client"})


def _tls_socket(certs: Path) -> dict:
    text = (CONFIG_DIR / "snippets" / "kvroute-mtls.yaml").read_text().replace("/etc/kvroute/tls", str(certs))
    return yaml.safe_load(text)["transport_socket"]


def test_mtls_between_envoy_and_kvroute(fleet, certs, tmp_path):
    cfg = tmp_path / "kvroute.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "pools": {"default": {"endpoints": [{"address": a} for a in fleet.addresses]}},
                "server": {
                    "tls": {
                        "cert_file": str(certs / "kvroute.crt"),
                        "key_file": str(certs / "kvroute.key"),
                        "client_ca_file": str(certs / "ca.crt"),
                    }
                },
            }
        )
    )
    with KVRouteProcess(config=str(cfg)) as k:
        # A client without a certificate is refused on the ext_proc port.
        with grpc.insecure_channel(f"127.0.0.1:{k.grpc_port}") as ch, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        with EnvoyProcess(
            "epp.yaml",
            kvroute_port=k.grpc_port,
            pods=fleet.addresses,
            kvroute_tls=_tls_socket(certs),
            ext_proc={"failure_mode_allow": False},
        ) as env:
            r = validate(env.config_path)
            assert r.returncode == 0, r.stderr
            with httpx.Client(base_url=env.url, timeout=10) as c:
                got = [c.post("/v1/chat/completions", json=chat(1)).json() for _ in range(3)]
    # Routed by kvroute (header set, same pod each time), over mTLS — failure_mode_allow is off, so a
    # broken TLS handshake would have been a 500, not a fallback.
    assert len({g["backend"] for g in got}) == 1
    assert got[0]["headers"]["x-gateway-destination-endpoint"] == got[0]["backend"]


def test_tls_files_are_checked_when_the_config_loads(certs):
    """A key that is not the certificate's, or a CA file that holds no certificate, fails validation
    (check-config, exit 2) naming the field, instead of surfacing as grpc's "cannot bind" at start."""
    from extproc.config import ConfigError, load_config

    def tls(cert: str, key: str, ca: str | None = None) -> dict:
        t = {"cert_file": str(certs / cert), "key_file": str(certs / key)}
        if ca:
            t["client_ca_file"] = str(certs / ca)
        return {"pools": {"p": {"endpoints": [{"address": "127.0.0.1:9"}]}}, "server": {"tls": t}}

    assert load_config(None, tls("kvroute.crt", "kvroute.key", "ca.crt")).server.tls is not None
    with pytest.raises(ConfigError, match=r"server\.tls: cert_file .*kvroute\.crt / key_file .*envoy-client\.key"):
        load_config(None, tls("kvroute.crt", "envoy-client.key"))
    with pytest.raises(ConfigError, match=r"server\.tls: client_ca_file .*kvroute\.key: not PEM CA certificates"):
        load_config(None, tls("kvroute.crt", "kvroute.key", "kvroute.key"))
