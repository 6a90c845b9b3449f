"""Load from the pods' own /metrics: saturation sheds only sheddable requests; a pod whose /metrics
goes dark stops getting traffic."""

import httpx
import pytest
import yaml

from bench.envoy import EnvoyProcess
from bench.kvroute import KVRouteProcess
from tests.integration.test_discovery_envoy import wait_for

pytestmark = pytest.mark.integration


def scraped_again(fleet, times: int = 3) -> None:
    """Until kvroute has scraped every pod ``times`` more times: what the pods now report has been read
    (a condition, where a fixed sleep raced the scraper on a busy machine)."""
    before = [b.scrapes for b in fleet.backends]
    wait_for(lambda: all(b.scrapes >= n + times for b, n in zip(fleet.backends, before, strict=True)), 10,
             "kvroute to scrape every pod again")  # fmt: skip


def chat(i: int) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": f"doc {i} " + "lorem ipsum " * 100}]}


@pytest.fixture
def scraped(fleet, tmp_path):
    cfg = tmp_path / "kvroute.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "pools": {"default": {"endpoints": [{"address": a} for a in fleet.addresses]}},
                "scrape": {"enabled": True, "interval_s": 0.05, "max_age_s": 0.5, "stale_after_misses": 2},
                "routing": {"saturation": {"queue_threshold": 5}},
            }
        )
    )
    for b in fleet.backends:
        b.waiting, b.metrics_status = 0, 200
    with (
        KVRouteProcess(config=str(cfg)) as k,
        EnvoyProcess("epp.yaml", kvroute_port=k.grpc_port, pods=fleet.addresses) as env,
        httpx.Client(base_url=env.url, timeout=10) as c,
    ):
        yield c, k
    for b in fleet.backends:
        b.waiting, b.metrics_status = 0, 200


def test_saturation_sheds_only_sheddable(scraped, fleet):
    c, k = scraped
    assert (
        c.post("/v1/chat/completions", json=chat(0), headers={"x-gateway-inference-objective": "sheddable"}).status_code
        == 200
    )
    for b in fleet.backends:
        b.waiting = 10
    scraped_again(fleet)
    shed = c.post("/v1/chat/completions", json=chat(1), headers={"x-gateway-inference-objective": "sheddable"})
    assert shed.status_code == 429 and shed.json()["error"]["type"] == "rate_limit_error"
    assert c.post("/v1/chat/completions", json=chat(1)).status_code == 200  # standard: queues at a pod
    assert c.post("/v1/chat/completions", json=chat(1), headers={"x-kvroute-priority": "-1"}).status_code == 429
    # One pod drains: it takes the work, sheddable requests flow again.
    fleet.backends[2].waiting = 0
    scraped_again(fleet)
    r = c.post("/v1/chat/completions", json=chat(2), headers={"x-gateway-inference-objective": "sheddable"})
    assert r.status_code == 200 and r.json()["backend"] == fleet.backends[2].address
    assert 'kvroute_errors_total{kind="shed"} 2.0' in k.metrics()


def test_pod_with_dark_metrics_gets_no_traffic(scraped, fleet):
    c, _ = scraped
    dark = fleet.backends[0]
    dark.metrics_status = 500
    scraped_again(fleet)
    got = {c.post("/v1/chat/completions", json=chat(i)).json()["backend"] for i in range(30)}
    assert dark.address not in got and len(got) == 3
