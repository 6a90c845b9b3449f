"""Replicas sharing state split the pods' /metrics scraping: each pod is scraped by one replica and the
others take its figures through Redis; when that replica dies, the survivor scrapes every pod again
before any figure goes stale."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from bench.faults import metric
from bench.kvroute import KVRouteProcess
from bench.replicas import KVRouteReplicas
from tests.backends import BackendFleet
from tests.integration.test_envoy_replicas import REDIS_SETTINGS, redis_up
from tests.polling import wait_for
from tests.redis_server import require_redis_server

pytestmark = pytest.mark.integration

INTERVAL_S = 0.1  # the shipped interval: figures held FIGURES_HOLD_S still arrive well inside 2.5 of it


def stat(k: KVRouteProcess, family: str, name: str) -> float:
    v = metric(k.metrics(), family, stat=name)
    assert v is not None, f"{family}{{stat={name!r}}} missing"
    return v


def scrape_stat(k: KVRouteProcess, name: str) -> float:
    return stat(k, "kvroute_scrape", name)


def redis_stat(k: KVRouteProcess, name: str) -> float:
    return stat(k, "kvroute_redis", name)


def polls(replicas: tuple[KVRouteProcess, ...]) -> tuple[float, float]:
    """(scrapes, scrapes left to the pod's owner) summed over ``replicas``: each replica polls each
    pod every interval and either scrapes it or leaves it to its owner."""
    return (sum(scrape_stat(k, "scrapes") for k in replicas), sum(scrape_stat(k, "left_to_owner") for k in replicas))


def test_each_pod_is_scraped_by_one_replica_and_the_survivor_takes_all(tmp_path: Path) -> None:
    require_redis_server()
    fleet = BackendFleet(4)
    config = tmp_path / "kvroute.yaml"
    scrape = {"enabled": True, "interval_s": INTERVAL_S, "timeout_s": 0.5, "max_age_s": 1.0}
    config.write_text(yaml.safe_dump({"redis": REDIS_SETTINGS, "scrape": scrape}))
    try:
        with KVRouteReplicas(2, fleet.addresses, ["--model", "m"], config=str(config), redis=True) as kv:
            a, b = kv.replicas
            wait_for(lambda: all(redis_up(k) == 1 for k in (a, b)), 10, "both replicas on Redis")
            # Each has heard the other (heartbeats): the split holds from then on. Which replica owns
            # which pods is up to the hash (one may own them all), so the figures are the fleet's.
            wait_for(lambda: all(redis_stat(k, "peers") == 1 for k in (a, b)), 10, "each replica to know the other")
            # Counted in polls, not time, so a slow machine cannot fail it: of two replicas' polls, about
            # half are left to the other replica (a pod scraped by both would leave none).
            scraped, left = polls((a, b))
            wait_for(lambda: polls((a, b))[0] + polls((a, b))[1] >= scraped + left + 80, 20, "80 more polls")
            more_scraped, more_left = polls((a, b))
            share_left = (more_left - left) / (more_scraped - scraped + more_left - left)
            assert 0.35 < share_left < 0.65, f"{share_left:.2f} of the polls left to the other replica"
            assert sum(scrape_stat(k, "shared") for k in (a, b)) > 0  # the owner's figures arrived
            assert all(scrape_stat(k, "stale") == 0 for k in (a, b))

            b.stop()  # its pods' figures stop coming: a scrapes them itself before they go stale
            t = time.monotonic()
            while redis_stat(a, "peers") != 0:  # until b times out, a owns only its share
                assert scrape_stat(a, "stale") == 0
                assert time.monotonic() - t < 5, "the stopped replica never timed out"
                time.sleep(0.05)
            scraped, left = polls((a,))
            wait_for(lambda: polls((a,))[0] >= scraped + 40, 20, "40 more scrapes")
            assert polls((a,))[1] == left and scrape_stat(a, "stale") == 0  # a owns every pod now
    finally:
        fleet.close()
