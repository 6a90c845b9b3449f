"""`python -m bench.sim --tls-cert/--tls-key/--tls-client-ca`: pods that serve https (mTLS optional)."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pytest

from bench.sim import Fleet, FleetConfig, TLSFiles
from bench.sim.__main__ import build_parser, main
from tests.certs import make_certs


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("sim-pki"), {"pod": "IP:127.0.0.1", "client": "DNS:client"})


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--tls-cert", "pod.crt"], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", "ca.crt"], "--tls-client-ca needs --tls-cert and --tls-key"),
        (["--tls-cert", "missing.crt", "--tls-key", "missing.key"], "TLS certificate/key/client CA"),
    ],
)
def test_bad_tls_flags_exit_2_naming_the_problem(
    args: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--quiet", *args]) == 2
    assert error in capsys.readouterr().err


def test_help_lists_the_tls_flags() -> None:
    text = build_parser().format_help()
    assert all(f in text for f in ("--tls-cert", "--tls-key", "--tls-client-ca"))


async def test_pods_serve_https_and_require_a_client_certificate_when_asked(certs: Path) -> None:
    tls = TLSFiles(str(certs / "pod.crt"), str(certs / "pod.key"), str(certs / "ca.crt"))
    trusted = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    with_cert = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    with_cert.load_cert_chain(str(certs / "client.crt"), str(certs / "client.key"))
    async with Fleet(FleetConfig(pods=1, zmq_base_port=None, tls=tls)) as fleet:
        pod = fleet.pods[0]
        assert pod.url.startswith("https://127.0.0.1:") and fleet.describe()[0]["url"] == pod.url
        async with httpx.AsyncClient(verify=with_cert) as c:
            assert (await c.get(pod.url + "/health")).status_code == 200
        async with httpx.AsyncClient(verify=trusted) as c:
            with pytest.raises(httpx.TransportError):  # no client certificate: the pod hangs up
                await c.get(pod.url + "/health")
