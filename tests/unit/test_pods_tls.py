"""TLS from kvroute to the pods (pods.tls): the settings' validation, and /metrics scrapes and
prefill legs over real TLS on loopback against simulated pods that serve https (bench.sim)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.sim import Fleet, FleetConfig, SimPod, TLSFiles
from extproc.config import EndpointConfig, KVEventsConfig, PodFieldsConfig, PodTLSConfig, build_config
from extproc.discovery.kubernetes import PodMapper
from extproc.endpoints.metrics import MetricsScraper
from extproc.endpoints.tls import PodTLS
from extproc.errors import ConfigError
from extproc.pd import PrefillClient
from tests.certs import make_certs

StartPod = Callable[..., Awaitable[SimPod]]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ca.crt``; pod.crt for 127.0.0.1, named.crt for vllm.test only, kvroute.crt (a client cert)."""
    return make_certs(
        tmp_path_factory.mktemp("pki"), {"pod": "IP:127.0.0.1", "named": "DNS:vllm.test", "kvroute": "DNS:kvroute"}
    )


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("other-pki"), {})


@pytest.fixture
async def start_pod(certs: Path) -> AsyncIterator[StartPod]:
    fleets: list[Fleet] = []

    async def start(cert: str = "pod", client_ca: bool = False, role: str = "both") -> SimPod:
        tls = TLSFiles(
            str(certs / f"{cert}.crt"), str(certs / f"{cert}.key"), str(certs / "ca.crt") if client_ca else None
        )
        fleet = Fleet(FleetConfig(pods=1, zmq_base_port=None, roles=role, tls=tls))
        await fleet.start()
        fleets.append(fleet)
        return fleet.pods[0]

    yield start
    for f in fleets:
        await f.stop()


def pod_tls(**settings: Any) -> PodTLS:
    return PodTLS(PodTLSConfig(**settings))


async def scrape(pod: SimPod, tls: PodTLS, times: int = 1) -> tuple[MetricsScraper, list[bool]]:
    """``times`` scrapes of ``pod`` over https, one after the other (no poll loop running)."""
    async with aiohttp.ClientSession() as session:
        scraper = MetricsScraper(
            [pod.address], url_for=lambda ep: f"https://{ep}/metrics", tls=tls, stale_after_misses=2, session=session
        )
        return scraper, [await scraper.scrape_once(pod.address) for _ in range(times)]


# -- settings ------------------------------------------------------------------------------------
def config(pods_tls: dict[str, Any], endpoint: dict[str, Any] | None = None) -> dict[str, Any]:
    ep = {"address": "127.0.0.1:8000", **(endpoint or {})}
    return {"pools": {"p": {"endpoints": [ep]}}, "pods": {"tls": pods_tls}}


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"ca_file": "nope/ca.crt"}, r"pods\.tls: ca_file: nope/ca\.crt does not exist"),
        ({"cert_file": "{d}/kvroute.crt"}, "cert_file and key_file go together"),
        ({"cert_file": "{d}/kvroute.crt", "key_file": "{d}/missing.key"}, r"key_file: .*missing\.key does not exist"),
        ({"ca_file": "{d}/kvroute.key"}, r"ca_file .*kvroute\.key: not PEM CA certificates"),
        ({"cert_file": "{d}/ca.crt", "key_file": "{d}/kvroute.key"}, r"cert_file .*ca\.crt / key_file .*kvroute\.key"),
        ({"insecure_skip_verify": True, "ca_file": "{d}/ca.crt"}, "insecure_skip_verify checks no certificate"),
        ({"server_name": "a b"}, "server_name: 'a b' is not a host name"),
    ],
)
def test_bad_settings_are_named(certs: Path, settings: dict[str, str], error: str) -> None:
    resolved = {k: v.format(d=certs) if isinstance(v, str) else v for k, v in settings.items()}
    with pytest.raises(ConfigError, match=error):
        build_config(config(resolved))


def test_an_endpoint_cannot_opt_out_of_enabled_tls_but_can_opt_in_without_it(certs: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"pods\.tls is enabled: endpoint\(s\) 127\.0\.0\.1:8000 cannot be scheme http"
    ):
        build_config(config({"ca_file": str(certs / "ca.crt")}, {"scheme": "http"}))
    cfg = build_config(config({"enabled": False, "ca_file": str(certs / "ca.crt")}, {"scheme": "https"}))
    tls = PodTLS(cfg.pods.tls)
    assert tls.scheme(cfg.pools["p"].endpoints[0]) == "https"
    assert tls.scheme(EndpointConfig(address="127.0.0.1:8001")) == "http"
    assert PodTLS(None).scheme(EndpointConfig(address="127.0.0.1:8001")) == "http"
    required = pod_tls(ca_file=certs / "ca.crt")
    assert required.scheme(EndpointConfig(address="127.0.0.1:8001", scheme="http")) == "https"  # discovered: upgraded


def test_the_pod_annotation_sets_the_scheme_and_a_bad_value_is_ignored() -> None:
    mapper = PodMapper(PodFieldsConfig(), KVEventsConfig())

    def pod(scheme: str) -> dict[str, Any]:
        return {
            "metadata": {"name": "p", "namespace": "n", "uid": "u", "annotations": {"kvroute.io/scheme": scheme}},
            "status": {"podIP": "10.0.0.1", "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
        }

    assert [e.scheme for e in mapper(pod("https"), [8000])] == ["https"]
    assert [e.scheme for e in mapper(pod("ftp"), [8000])] == [None]


def test_insecure_skip_verify_is_logged_loudly(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvroute.tls"):
        pod_tls(insecure_skip_verify=True)
    assert any("insecure_skip_verify is ON" in r.getMessage() for r in caplog.records)


# -- scrapes -------------------------------------------------------------------------------------
async def test_scrape_over_tls_verifies_the_pod_against_the_ca(start_pod: StartPod, certs: Path) -> None:
    pod = await start_pod()
    scraper, ok = await scrape(pod, pod_tls(ca_file=certs / "ca.crt"))
    assert ok == [True]
    m = scraper.get(pod.address)
    assert m is not None and m.num_gpu_blocks == pod.capacity_blocks


async def test_server_name_checks_a_named_certificate_on_a_pod_reached_by_ip(start_pod: StartPod, certs: Path) -> None:
    pod = await start_pod(cert="named")
    assert (await scrape(pod, pod_tls(ca_file=certs / "ca.crt", server_name="vllm.test")))[1] == [True]
    # Without it the pod's IP must be in the certificate, which it is not.
    scraper, ok = await scrape(pod, pod_tls(ca_file=certs / "ca.crt"))
    assert ok == [False] and scraper.stats()["tls_errors"] == 1


async def test_wrong_ca_is_logged_once_and_the_pod_is_unscrapable(
    start_pod: StartPod, other_ca: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pod = await start_pod()
    with caplog.at_level(logging.WARNING, logger="extproc.endpoints.metrics"):
        scraper, ok = await scrape(pod, pod_tls(ca_file=other_ca / "ca.crt"), times=5)
    assert ok == [False] * 5
    st = scraper.state(pod.address)
    assert st is not None and st.stale and scraper.get(pod.address) is None
    assert scraper.stats()["tls_errors"] == 5
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1, logged  # once, and not again as "stale after 2 failed scrapes"
    assert pod.address in logged[0] and "certificate verify failed" in logged[0] and "ca_file" in logged[0]


async def test_https_to_a_plain_pod_says_so(certs: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with Fleet(FleetConfig(pods=1, zmq_base_port=None)) as fleet:
        with caplog.at_level(logging.ERROR, logger="extproc.endpoints.metrics"):
            _, ok = await scrape(fleet.pods[0], pod_tls(ca_file=certs / "ca.crt"))
    assert ok == [False]
    assert "does the pod serve https?" in caplog.records[0].getMessage()


async def test_a_pod_requiring_a_client_certificate_takes_the_configured_one(
    start_pod: StartPod, certs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pod = await start_pod(client_ca=True)
    with_cert = pod_tls(ca_file=certs / "ca.crt", cert_file=certs / "kvroute.crt", key_file=certs / "kvroute.key")
    assert (await scrape(pod, with_cert))[1] == [True]
    with caplog.at_level(logging.WARNING, logger="extproc.endpoints.metrics"):
        scraper, ok = await scrape(pod, pod_tls(ca_file=certs / "ca.crt"), times=2)
    assert ok == [False, False] and scraper.get(pod.address) is None
    # Said at once if the pod's alert arrives, else as the likely reason of the hang-up.
    assert "requires a client certificate" in caplog.records[-1].getMessage()


# -- prefill legs --------------------------------------------------------------------------------
async def test_prefill_leg_over_mtls_returns_the_kv_params(start_pod: StartPod, certs: Path) -> None:
    pod = await start_pod(client_ca=True, role="prefill")
    client = PrefillClient(
        pod_tls(ca_file=certs / "ca.crt", cert_file=certs / "kvroute.crt", key_file=certs / "kvroute.key")
    )
    body = {"model": "sim-model", "prompt": "a long enough prompt " * 20, "max_tokens": 50}
    try:
        leg = await client.prefill(pod.address, "/v1/completions", body, "r1", 5.0, scheme="https")
    finally:
        await client.aclose()
    assert leg.why == "ok" and leg.params is not None
    assert leg.params["do_remote_prefill"] and leg.params["remote_engine_id"] == pod.engine_id
    assert pod.stats()["requests"] == 1


async def test_prefill_leg_with_the_wrong_ca_falls_back_and_is_logged_once(
    start_pod: StartPod, other_ca: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pod = await start_pod(role="prefill")
    client = PrefillClient(pod_tls(ca_file=other_ca / "ca.crt"))
    body = {"model": "sim-model", "prompt": "x " * 50}
    try:
        with caplog.at_level(logging.INFO, logger="kvroute.pd"):
            legs = [
                await client.prefill(pod.address, "/v1/completions", body, f"r{i}", 5.0, scheme="https")
                for i in range(3)
            ]
    finally:
        await client.aclose()
    assert [(leg.params, leg.why) for leg in legs] == [(None, "tls")] * 3
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "certificate verify failed" in str(errors[0].__dict__["fields"]["error"])
    assert pod.stats()["requests"] == 0
